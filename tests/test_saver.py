"""The snapshot saver process (app/training/saver.py): its own faults, and that no process outlives a trainer."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from app.training import saver, snapshot
from tests.helpers import REPO, _tagged, clean_env, read_metrics, run_trainer, snapshot_steps, start_trainer, wait_for
from tests.test_snapshot import snapshots

pytestmark = pytest.mark.unit

BIG = 37_500_000        # 150 MB of float32: a write long enough to be caught in the middle


def big_parts(step: int) -> snapshot.State:
    weights = torch.zeros(BIG)
    weights[0] = step
    return {"model": {"w": weights}, "optimizer": {}, "scheduler": {}, "scaler": {}, "train_state": {"step": step}}


def in_the_middle(directory: Path) -> bool:
    """A write has begun its first part and not finished it."""
    return any((p / "model.safetensors").exists() for p in directory.glob(f"{snapshot.TMP_PREFIX}*"))


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"     # exited, not yet reaped
    except OSError:
        return True


def saver_in_the_middle_of_a_write(directory: Path) -> tuple[snapshot.Snapshots, Any, int]:
    """Snapshots handing its saver a 150 MB write of step 1, returned once the write has begun; the saver's pid."""
    ckpt, said = snapshots(directory)
    ckpt.start()
    pid = ckpt._saver.process.pid
    ckpt.save(1, big_parts(1))
    deadline = time.monotonic() + 60
    while not in_the_middle(directory):
        assert time.monotonic() < deadline, "the write never began"
        time.sleep(0.001)
    return ckpt, said, pid


def test_a_saver_killed_in_the_middle_of_a_write_is_replaced_and_the_write_done_again(tmp_path):
    ckpt, said, first = saver_in_the_middle_of_a_write(tmp_path)
    os.kill(first, signal.SIGKILL)
    ckpt.wait()
    assert said == said.warnings == [f"warning: the snapshot saver (pid {first}) ended by SIGKILL while writing "
                                     "step 1; a new saver writes step 1"]
    assert snapshot_steps(tmp_path) == [1] and snapshot.read_snapshot(tmp_path / "step-00000001")["model"]["w"][0] == 1
    ckpt.save(2, big_parts(2), background=False)          # the new saver goes on
    assert snapshot_steps(tmp_path) == [1, 2] and not list(tmp_path.glob(f"{snapshot.TMP_PREFIX}*"))
    second = ckpt._saver.process.pid
    ckpt.close()
    assert second != first and gone(second)


def test_a_saver_that_hangs_in_the_middle_of_a_write_is_killed_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(saver, "HUNG_AFTER_S", 2.0)
    ckpt, said, first = saver_in_the_middle_of_a_write(tmp_path)
    os.kill(first, signal.SIGSTOP)
    ckpt.wait()
    assert said == said.warnings == [f"warning: the snapshot saver (pid {first}) did not finish step 1 within 2 s "
                                     "and was killed; a new saver writes step 1"]
    assert snapshot_steps(tmp_path) == [1] and gone(first)
    ckpt.close()


# A trainer's side alone, in a session of its own as torchrun starts a worker: hands its saver a 150 MB write,
# says the saver's pid, and waits to be killed.
TRAINER = r"""
import sys, time, torch
from pathlib import Path
from tests.test_saver import big_parts
from tests.test_snapshot import snapshots
ckpt, _ = snapshots(Path(sys.argv[1]))
ckpt.start()
print(ckpt._saver.process.pid, flush=True)
ckpt.save(1, big_parts(1))
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["trainer", "group"])
def test_a_trainer_killed_while_its_saver_writes_leaves_a_complete_snapshot_and_no_process(tmp_path, how):
    """The saver finishes the snapshot it holds, then leaves: "trainer", the trainer alone SIGKILLed; "group",
    the trainer's process group SIGKILLed, as torchrun stops a worker (the saver is in a session of its own)."""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path)], cwd=REPO, env=clean_env(),
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        saver = int(trainer.stdout.readline())
        wait_for(lambda: in_the_middle(tmp_path), trainer, 60, "the write to begin", interval=0.001)
    finally:
        if how == "group":
            os.killpg(trainer.pid, signal.SIGKILL)
        else:
            trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 60
    while not gone(saver):
        assert time.monotonic() < deadline, "the saver outlived its trainer"
        time.sleep(0.05)
    assert snapshot_steps(tmp_path) == [1] and not list(tmp_path.glob(f"{snapshot.TMP_PREFIX}*"))
    assert snapshot.read_snapshot(tmp_path / "step-00000001")["model"]["w"][0] == 1


def test_closing_a_saver_that_not_even_sigkill_ends_gives_up_with_one_warning(tmp_path, monkeypatch):
    """A saver stuck in the kernel (a write on a dead mount, in D state, ends only when its write does) must
    not hold the trainer's exit: close() waits, kills, waits a bounded time more, and says so once."""
    monkeypatch.setattr(saver, "LEAVES_WITHIN_S", 1.0)
    monkeypatch.setattr(saver, "KILLED_WITHIN_S", 1.0)
    ckpt, said = snapshots(tmp_path)
    ckpt.start()
    process = ckpt._saver.process
    os.kill(process.pid, signal.SIGSTOP)                    # it never finds its socket closed
    monkeypatch.setattr(process, "kill", lambda: None)      # and SIGKILL does not end it, as in D state
    closing = threading.Thread(target=ckpt.close, name="close", daemon=True)
    closing.start()
    closing.join(10)
    try:
        assert not closing.is_alive(), "close() waited without a bound"
        assert said == said.warnings == [f"warning: the snapshot saver (pid {process.pid}) did not end within 1 s "
                                         "of SIGKILL (stuck in the kernel: a dead mount?); it is left behind"]
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


FAST = ["--dataset", "digits", "--model", "tiny", "--epochs", "2", "--batch-size", "64", "--save-every-steps", "3"]


@pytest.mark.parametrize("how", ["done", "error", "killed"])
def test_no_process_is_left_behind_after_any_exit(tmp_path, how):
    """After a run ends (trained to the end, a bad input, SIGKILL), no process of it is left: the launch's
    every process carries its tag in its environment, the saver too."""
    args = [*FAST, "--run-dir", tmp_path / "run"]
    if how == "error":
        args += ["--lr", "-1"]
    proc = start_trainer(args, nproc=0)
    if how == "killed":
        wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists() and read_metrics(tmp_path / "run", "snapshot"),
                 proc, 120, "a first snapshot")
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == {"done": 0, "error": 2, "killed": -signal.SIGKILL}[how]
    deadline = time.monotonic() + 30
    while [pid for pid in _tagged(proc.run_tag) if not gone(pid)]:
        assert time.monotonic() < deadline, f"left behind: {_tagged(proc.run_tag)}"
        time.sleep(0.05)
    if how == "done":
        assert snapshot_steps(tmp_path / "run" / "snapshots")


def test_resnet152_with_adamw_snapshots_every_two_steps_and_resumes(tmp_path, synthetic_data):
    """The issue's own lines at a tiny size: about 2,300 tensors, whose layout never fit one socket message."""
    args = ["--dataset", "synthetic", "--data-dir", synthetic_data, "--model", "resnet152", "--optimizer", "adamw",
            "--batch-size", "2", "--save-every-steps", "2", "--save-every-seconds", "0", "--run-dir", tmp_path]
    first = run_trainer([*args, "--max-steps", "3"], nproc=0, timeout=300)
    assert "warning" not in first.stderr and snapshot_steps(tmp_path / "snapshots") == [2, 3]
    second = run_trainer([*args, "--max-steps", "4", "--resume"], nproc=0, timeout=300)
    assert "resuming from" in second.stdout and snapshot_steps(tmp_path / "snapshots") == [2, 3, 4]
