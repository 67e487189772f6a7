"""The stacks of a hang (app/recovery/stacks.py): a process answers with every thread's stacks, a
stopped one is said to be stopped at once, and a process writes its own."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from app.recovery import stacks

pytestmark = pytest.mark.unit


@pytest.fixture
def armed():
    stacks.arm()
    yield
    stacks.disarm()


def _stuck(until: threading.Event) -> None:
    until.wait()


def test_a_live_process_answers_with_the_stacks_of_every_thread(armed, tmp_path):
    """Asked by signal, as a peer on the same host asks a silent one; the answer lands in the run directory."""
    release = threading.Event()
    helper = threading.Thread(target=_stuck, args=(release,), name="stuck")
    helper.start()
    try:
        said = stacks.ask(tmp_path, 3, os.getpid(), "a test")
    finally:
        release.set()
        helper.join()
    [written] = (tmp_path / stacks.FOLDER).glob(f"*-rank3-pid{os.getpid()}.txt")
    assert said == f"rank 3 (pid {os.getpid()}) in {written}"
    text = written.read_text()
    assert text.startswith(f"# rank 3 pid {os.getpid()}, asked by pid {os.getpid()}: a test\n")
    assert "_stuck" in text and "test_a_live_process_answers" in text, text     # both threads


def test_a_stopped_process_cannot_answer_and_is_not_waited_for(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        sleeper.send_signal(signal.SIGSTOP)
        while stacks.process_state(sleeper.pid) != "T":
            time.sleep(0.01)
        began = time.monotonic()
        said = stacks.ask(tmp_path, 1, sleeper.pid, "a test")
        assert time.monotonic() - began < stacks.ANSWER_WAIT_S     # it did not wait for an answer
    finally:
        sleeper.kill()
        sleeper.wait()
    assert said == f"rank 1 (pid {sleeper.pid}) is stopped and cannot answer: no stacks"
    assert not (tmp_path / stacks.FOLDER).exists()


def test_a_process_that_has_not_armed_itself_is_not_signalled(tmp_path):
    """Node containers on one host share its name (host network), not their PID namespaces: the silent peer's
    pid was the survivor's own launcher here, which the signal ended (the 20-fault chaos run, elastic,
    freeze_worker: the survivor's node restarted, 14 s and 2 steps lost). Only an armed process is asked."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        said = stacks.ask(tmp_path, 1, sleeper.pid, "a test")
        assert said == f"rank 1 (pid {sleeper.pid}) is not a process of this host that answers (another container?): not asked"
        time.sleep(0.2)
        assert sleeper.poll() is None, "the signal ended a process that does not handle it"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_process_writes_its_own_stacks_with_why(tmp_path):
    written = stacks.dump_own(tmp_path, 0, "no training step for 61 s")
    assert written.parent == tmp_path / stacks.FOLDER and written.name.endswith(f"-rank0-pid{os.getpid()}.txt")
    text = written.read_text()
    assert text.startswith(f"# rank 0 pid {os.getpid()}: no training step for 61 s\n")
    assert "test_a_process_writes_its_own_stacks" in text


def test_disarming_leaves_no_armed_file():
    stacks.arm()
    path = stacks._armed_path(os.getpid())
    assert path.exists()
    stacks.disarm()
    assert not path.exists()
