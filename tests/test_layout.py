"""docs/layout.md's promises about app/, checked on the source: its top level holds only entry points
and packages, nothing in a package imports an entry point, and no two packages import each other
(the parts form layers a newcomer can read from the bottom up)."""
from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.unit

APP = REPO / "app"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """The app modules (or packages) that `path` imports, at any depth of its code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("app"):
            found |= {n for n in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if _is_module(n)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("app.")}
    return found


def _part(module: str) -> str:
    """The package a module belongs to, or the module itself at app's top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (APP / parts[-1]).is_dir() else module


def test_the_top_level_holds_only_entry_points_and_packages():
    loose = [p.name for p in APP.glob("*.py") if p.name not in ("__init__.py", "__main__.py")
             and 'if __name__ == "__main__":' not in p.read_text()]
    assert loose == [], f"modules at app/'s top level that are no entry point: {loose}"


def test_no_package_imports_an_entry_point_and_no_two_packages_import_each_other():
    graph: dict[str, set[str]] = {}
    for path in APP.rglob("*.py"):
        module = _module(path)
        if _part(module) == module:
            continue        # an entry point imports whatever it runs
        for target in _imports(path):
            assert _part(target) != target or target == "app", f"{module} imports the entry point {target}"
            if _part(target) != _part(module) and target != "app":
                graph.setdefault(_part(module), set()).add(_part(target))
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as cycle:
        pytest.fail(f"packages that import each other: {cycle.args[1]}")
