"""The commands README.md shows a user, and the test that runs each one exactly as written.

A command is one line of a ```bash block of README.md once `# comments` are stripped, `\\`
continuations joined and `;` lists split. tests/test_readme_commands.py fails when README shows a
command that neither RUN_BY nor KNOWN_MISSING names, and when a test named in RUN_BY does not
hold the command verbatim. Shrink KNOWN_MISSING by writing the test and moving the command to RUN_BY.
"""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

# command -> "tests/<file>.py::<test>" that runs it exactly (its string literal is in that test's module)
RUN_BY = {
    "make up NODES=2": "tests/test_make.py::test_make_targets_of_one_job",
    "make kill NODE=2": "tests/test_make.py::test_make_targets_of_one_job",
    "make restart NODE=2": "tests/test_make.py::test_make_targets_of_one_job",
    "make ps": "tests/test_make.py::test_make_targets_of_one_job",
    "make logs": "tests/test_make.py::test_make_targets_of_one_job",
    "make down": "tests/test_make.py::test_make_targets_of_one_job",
    "docker compose run trainer --resume": "tests/test_make.py::test_make_targets_of_one_job",
    "make up NODES=2 OBJECT_STORE=1": "tests/test_make.py::test_make_up_with_the_object_store_resumes_on_new_machines",
    "docker compose kill trainer": "tests/test_make.py::test_make_up_with_the_object_store_resumes_on_new_machines",
    "docker compose rm -f trainer": "tests/test_make.py::test_make_up_with_the_object_store_resumes_on_new_machines",
    "rm -rf runs/default/snapshots": "tests/test_make.py::test_make_up_with_the_object_store_resumes_on_new_machines",
    "make chaos FAULTS=3 ONLY=kill_rank0,freeze_worker,partition SEED=3 EPOCHS=100 BASELINE=0":
        "tests/test_chaos.py::test_three_faults_are_survived_within_wide_bounds",
    "make chaos NODES=4 FAULTS=1 ONLY=cut_peers FT=inplace SEED=1 EPOCHS=150 BASELINE=0":
        "tests/test_chaos.py::test_four_nodes_train_on_without_the_one_cut_off_from_its_peers",
    ".venv/bin/python -m app.train --epochs 3": "tests/test_readme_launch.py::test_one_process",
    ".venv/bin/python -m app.launch --standalone --nproc-per-node=2 -m app.train --epochs 3":
        "tests/test_readme_launch.py::test_one_node",
    ".venv/bin/python -m app.launch --nnodes=1:2 --nproc-per-node=1 --rdzv-endpoint=$HOST:29400 --rdzv-id=job1 "
    "-m app.train --epochs 3": "tests/test_readme_launch.py::test_two_nodes",
    ".venv/bin/python -m app.ft.lighthouse": "tests/test_readme_launch.py::test_torchft_groups",
    ".venv/bin/python -m app.launch --standalone --nproc-per-node=1 -m app.train --ft torchft "
    "--lighthouse http://$HOST:29510 --epochs 3": "tests/test_readme_launch.py::test_torchft_groups",
    ".venv/bin/python -m app.node store": "tests/test_readme_launch.py::test_inplace_nodes",
    ".venv/bin/python -m app.launch --standalone --nproc-per-node=1 -m app.train --ft inplace "
    "--group-store $HOST:29400 --epochs 3": "tests/test_readme_launch.py::test_inplace_nodes",
}

# command -> why no test runs it exactly as written
KNOWN_MISSING = {
    "make test": "the whole suite, this list included; .ci/run runs it",
}

_BLOCK = re.compile(r"^```bash[ \t]*\n(.*?)^```", re.M | re.S)
_COMMENT = re.compile(r"(^|\s)#.*$")   # a word that starts with # opens a comment, as in bash


def commands(markdown: str) -> list[str]:
    """The commands of the ```bash blocks, in order, each on one line with single spaces."""
    found: list[str] = []
    for block in _BLOCK.findall(markdown):
        pending = ""
        for line in block.splitlines():
            line = _COMMENT.sub("", line).rstrip()
            if line.endswith("\\"):              # continued on the next line
                pending += line[:-1] + " "
                continue
            found += [" ".join(c.split()) for c in (pending + line).split(";") if c.strip()]
            pending = ""
    return found


def readme_commands() -> list[str]:
    return commands(README.read_text())
