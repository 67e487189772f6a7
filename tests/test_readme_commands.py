"""Every command README.md shows is run by a test exactly as written, or listed as known missing."""
from __future__ import annotations

import ast

import pytest

from tests.helpers import REPO
from tests.readme_commands import KNOWN_MISSING, RUN_BY, commands, readme_commands

pytestmark = pytest.mark.unit


def test_commands_are_read_from_bash_blocks_only():
    text = ("```bash\nmake a X=1   # why\n# a comment line\nmake b \\\n    --c 1; make d\necho '#x' # y \\\n"
            "make e\n```\n\nmake f\n```\nmake g\n```\n")
    assert commands(text) == ["make a X=1", "make b --c 1", "make d", "echo '#x'", "make e"]


def test_every_readme_command_is_run_by_a_test_or_known_missing():
    shown = readme_commands()
    assert shown, "README.md shows no ```bash block: the extraction no longer matches it"
    unaccounted = [c for c in shown if c not in RUN_BY and c not in KNOWN_MISSING]
    assert not unaccounted, f"README shows commands no test runs (tests/readme_commands.py): {unaccounted}"
    gone = sorted((RUN_BY.keys() | KNOWN_MISSING.keys()) - set(shown))
    assert not gone, f"tests/readme_commands.py lists commands README no longer shows: {gone}"
    assert not RUN_BY.keys() & KNOWN_MISSING.keys()


@pytest.mark.parametrize("command", sorted(RUN_BY))
def test_the_named_test_holds_the_command_verbatim(command):
    """The named test exists, and its module has the command as a string literal (what it runs)."""
    path, _, name = RUN_BY[command].partition("::")
    tree = ast.parse((REPO / path).read_text())
    assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, RUN_BY[command]
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert command in literals, f"{path} never spells {command!r}"

