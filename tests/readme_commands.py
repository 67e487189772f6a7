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
    ".venv/bin/python -m app.train --help": "tests/test_readme_commands.py::test_the_trainers_help_command",
}

# command -> why no test runs it yet, exactly as written
KNOWN_MISSING = {
    "make test": "the whole suite, this list included; CI runs it",
    "make run": "the default run (15 epochs) as one process: minutes; test_cli runs app.train directly",
    "make run-ddp NPROC=2 EPOCHS=5": "five epochs under torchrun; test_multiprocess launches torchrun directly",
    "python -m app.train --dataset cifar10 --model resnet18 --epochs 30": "needs CIFAR-10, not downloadable here",
    "torchrun --standalone --nproc-per-node=4 -m app.train --model resnet50":
        "four ResNet-50 processes: a GPU node's job, not a 2-core test",
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": "sets the environment of the multi-node line below, which no test runs either",
    "torchrun --nnodes=1:2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 "
    "--rdzv-id=job1 --max-restarts=10 -m app.train": "HOST is a placeholder; the containers' entrypoint runs the same c10d launch",
    "sbatch --nodes=2 scripts/train.sbatch --epochs 30": "30 epochs under Slurm; test_slurm submits a short job",
    "docker compose run --rm trainer --resume --epochs 20":
        "test_docker runs it with a fresh RDZV_ID and --epochs 3 (a finished job closed its rendezvous)",
    "export JOB_SECRET=$(openssl rand -hex 16)": "multi-host set-up: needs a second host",
    "RDZV_HOST=10.0.0.1 docker compose up -d store": "multi-host: 10.0.0.1 is an example address",
    "NODE_ADDR=10.0.0.1 RDZV_HOST=10.0.0.1 NODES=1 NNODES=1:2 docker compose up -d trainer":
        "multi-host: 10.0.0.1 is an example address",
    "NODE_ADDR=10.0.0.2 RDZV_HOST=10.0.0.1 NODES=1 NNODES=1:2 docker compose up -d --no-deps trainer":
        "multi-host: needs a second host",
    "make slurm": "the slurm tier starts its cluster with scripts/slurm-cluster.sh, not through make",
    "make slurm-job NODES=2 EPOCHS=3": "test_slurm submits with sbatch directly",
    "sbatch --nodes=4 --gpus-per-node=8 --time=12:00:00 scripts/train.sbatch --model resnet50 --epochs 90":
        "four 8-GPU nodes",
    "squeue": "JOBID-dependent follow-ups of a submitted job",
    "tail -f slurm-JOBID.out": "JOBID is a placeholder",
    "cat runs/slurm-JOBID/metrics.jsonl": "JOBID is a placeholder",
    "make slurm-stop": "stops the cluster the slurm tier shares",
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
