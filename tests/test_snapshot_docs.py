"""docs/snapshots.md's lines that load a trained model without this project, run as written."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from app.training import models
from app.training.snapshot import PARTS, write_snapshot
from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.unit


def test_a_snapshots_model_loads_in_a_few_lines_without_the_project(tmp_path):
    block = re.search(r"```python\n(.*?)```", (REPO / "docs" / "snapshots.md").read_text(), re.S)[1]
    lines = [line.strip() for line in block.splitlines()]
    path = re.search(r'load_file\("([^"]+)"\)', block)[1]
    folder = tmp_path / path.rsplit("/", 2)[0]
    folder.mkdir(parents=True)
    step = int(path.split("step-")[1].split("/")[0])
    trained = models.build("resnet18", 10)
    write_snapshot(folder, step, {**dict.fromkeys(PARTS, {}), "model": trained.state_dict()})
    # In a folder of its own, with the project off the path: only torch, torchvision and safetensors.
    done = subprocess.run([sys.executable, "-I", "-c", "\n".join(lines)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "torch.Size([1, 10])"
