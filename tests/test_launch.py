"""app/launch.py: torchrun with the fault policy, unique node names, stopped workers, one summary line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from app import launch
from app.core.errors import UserError
from app.recovery import failures
from app.core.policy import DEFAULT
from tests.helpers import REPO, clean_env, free_port, read_metrics, wait_for


def _conf(args) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in args.rdzv_conf.split(","))


@pytest.mark.unit
def test_the_policy_fills_in_what_torchrun_was_not_told():
    args = launch.torchrun_args(["--nnodes=1:2", "--rdzv-endpoint=h:29400", "--rdzv-id=j", "-m", "app.train",
                                 "--epochs", "3"], DEFAULT)
    assert (args.max_restarts, args.monitor_interval, args.rdzv_backend) == (DEFAULT.max_restarts, 1.0, "c10d")
    assert _conf(args)["last_call_timeout"] == str(DEFAULT.rdzv_last_call_s)
    assert _conf(args)["keep_alive_interval"] == str(DEFAULT.rdzv_keep_alive_interval_s)
    assert args.training_script == "app.train" and args.training_script_args == ["--epochs", "3"]


@pytest.mark.unit
def test_what_the_user_gives_wins():
    args = launch.torchrun_args(["--standalone", "--max-restarts=0", "--rdzv-conf=is_host=false,last_call_timeout=7",
                                 "-m", "app.train"], DEFAULT)
    assert args.max_restarts == 0
    assert _conf(args)["last_call_timeout"] == "7" and _conf(args)["is_host"] == "false"
    assert _conf(args)["join_timeout"] == str(DEFAULT.rdzv_join_timeout_s)
    with pytest.raises(UserError, match="key=value"):
        launch.torchrun_args(["--standalone", "--rdzv-conf=oops", "-m", "app.train"], DEFAULT)


@pytest.mark.unit
def test_a_rendezvous_endpoint_that_cannot_be_one_is_one_error_before_torchrun_starts():
    given = lambda endpoint: ["--nnodes=1:2", f"--rdzv-endpoint={endpoint}", "-m", "app.train"]  # noqa: E731
    with pytest.raises(UserError) as caught:
        launch.torchrun_args(given("127.0.0.1:99999"), DEFAULT)
    assert str(caught.value) == "--rdzv-endpoint 127.0.0.1:99999: port 99999 is out of range (1 to 65535)"
    with pytest.raises(UserError, match="^--rdzv-endpoint must look like HOST:PORT, got 'h:port'$"):
        launch.torchrun_args(given("h:port"), DEFAULT)
    assert launch.torchrun_args(given("storehost"), DEFAULT).rdzv_endpoint == "storehost"   # torchrun's port


@pytest.mark.unit
def test_node_names_start_from_a_random_counter():
    """Pins the private torch attribute the launcher sets (torch has no public way to name a node)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    generator = DynamicRendezvousHandler._node_desc_generator
    launch._unique_node_names()
    first = generator.generate("10.0.0.1")
    launch._unique_node_names()
    second = generator.generate("10.0.0.1")
    assert first.addr == second.addr and first.pid == second.pid and first.local_id != second.local_id


@pytest.mark.unit
def test_the_agent_kills_a_worker_that_stays_stopped_and_only_that_one():
    """A SIGSTOPped worker never handles torchrun's SIGTERM; the node's agent must not wait 30 s on it."""
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = threading.Event()      # the reaper watches every child of this process: it must not outlive the test
    reaper = threading.Thread(target=launch.reap_stopped_workers, args=(1.0, 0.1, done), daemon=True)
    try:
        reaper.start()
        os.kill(stopped.pid, signal.SIGSTOP)
        start = time.monotonic()
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert 0.9 <= time.monotonic() - start < 5
        assert running.poll() is None
    finally:
        done.set()
        reaper.join()
        stopped.kill()
        running.kill()


@pytest.mark.unit
def test_a_failure_is_summarised_with_the_first_ranks_own_line(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    (tmp_path / "0.json").write_text('{"message": "error: no dataset under /nowhere", "timestamp": 100}')
    (tmp_path / "1.json").write_text('{"message": "error: later", "timestamp": 200}')
    failed = ChildFailedError("app.train", {
        rank: ProcessFailure(local_rank=rank, pid=10 + rank, exitcode=failures.EXIT_BAD_INPUT,
                             error_file=str(tmp_path / f"{rank}.json")) for rank in (0, 1)})
    line, status = launch.failure_summary(failed)
    assert status == failures.EXIT_BAD_INPUT
    assert line == "error: 2 training process(es) failed (exit 2); rank 0 first: error: no dataset under /nowhere"


@pytest.mark.multiprocess
def test_bad_input_inside_the_workers_ends_at_once_with_one_summary_line_and_no_traceback(tmp_path):
    """One line, the launcher's, whichever rank meets it first: not torchrun's ChildFailedError wall,
    not --max-restarts more attempts that fail the same way, and not a worker's own line that the stop
    of its group may or may not let out first."""
    done = subprocess.run([sys.executable, "-m", "app.launch", "--standalone", "--nproc-per-node=2", "-m", "app.train",
                           "--dataset", "synthetic", "--data-dir", str(tmp_path / "nothing-here")],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == failures.EXIT_BAD_INPUT, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (f"error: data directory {tmp_path / 'nothing-here'} does not exist; prepare it with "
                         f"`python -m scripts.prepare --dataset synthetic --data-dir {tmp_path / 'nothing-here'}` "
                         "(bad input: the training processes were not restarted)"), lines[-1]
    assert sum("does not exist" in line for line in lines) == 1, "one attempt, said once"


@pytest.mark.multiprocess
def test_a_launcher_stopped_by_sigterm_says_so_in_one_line_and_no_traceback(tmp_path):
    """A Slurm requeue or `docker stop` sends SIGTERM to the launcher: its workers write their snapshot
    and say so, and the launcher adds one line, not torchrun's SignalException traceback (seen in the
    Slurm tier's torchft job on a requeue)."""
    launcher = subprocess.Popen([sys.executable, "-m", "app.launch", "--standalone", "--nproc-per-node=1",
                                 "-m", "app.train", "--dataset", "digits", "--epochs", "400",
                                 "--run-dir", str(tmp_path)], cwd=REPO, env=clean_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (tmp_path / "metrics.jsonl").exists() and bool(read_metrics(tmp_path, "train")),
                 launcher, 120, "a train row")
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "launcher stopped by SIGTERM", err[-3000:]
    assert any(line.startswith("stopped by SIGTERM: snapshot at step") for line in out.splitlines()), out[-2000:]
    assert launcher.returncode == 1


@pytest.mark.multiprocess
def test_joining_a_finished_job_is_one_line_and_its_own_status(tmp_path):
    """A finished job closes its rendezvous for good; a node that joins it afterwards (the container
    entrypoint's `docker compose run trainer --resume` on a finished run) gets one line, not torchrun's
    RendezvousClosedError traceback, and status 4, which docker/entrypoint.sh tells apart from a fault."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)     # held open until the end
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="finished", min_nodes=1,
                                  max_nodes=1, is_host="false")
    get_rendezvous_handler(params).set_closed()                       # what the job's last node does
    done = subprocess.run([sys.executable, "-m", "app.launch", "--nnodes=1", f"--rdzv-endpoint=127.0.0.1:{port}",
                           "--rdzv-id=finished", "-m", "app.train", "--run-dir", str(tmp_path)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == failures.EXIT_RDZV_CLOSED, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if "error" in line.lower()] == [
        f"error: job 'finished' has finished and closed its rendezvous at 127.0.0.1:{port}; continue it under a "
        "new rendezvous id (--rdzv-id; RDZV_ID in containers): it resumes from its last snapshot"]


@pytest.mark.multiprocess
def test_workers_that_fail_at_start_up_on_every_restart_end_the_job_after_the_bound_with_one_line(tmp_path):
    """Every worker dies as its interpreter starts (a sitecustomize that exits: no step, no snapshot,
    no line of its own): the agent restarts the group MAX_NO_PROGRESS_RESTARTS times, not MAX_RESTARTS,
    then ends the job with one line naming the last failure."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nif 'TORCHELASTIC_RESTART_COUNT' in os.environ:   # a worker, not the launcher\n    os._exit(7)\n")
    env = clean_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", MAX_NO_PROGRESS_RESTARTS="2", MAX_RESTARTS="10",
                    MONITOR_INTERVAL="0.2")
    done = subprocess.run([sys.executable, "-m", "app.launch", "--standalone", "--nproc-per-node=2", "-m", "app.train",
                           "--run-dir", str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == failures.EXIT_NO_PROGRESS, done.stderr[-3000:]
    assert done.stderr.count("failed (exitcode: 7) local_rank: 0") == 3, done.stderr[-3000:]   # 2 restarts
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: no newer committed step than 0 after 2 restarts in a row (MAX_NO_PROGRESS_RESTARTS=2): "
                      "not restarting again; the last cause: 2 training process(es) failed (exit 7); rank 0 first: "
                      "its error line is above"], done.stderr[-3000:]


@pytest.mark.unit
def test_the_folders_of_launchers_that_are_gone_are_removed_and_a_live_ones_kept(tmp_path):
    """A launcher killed outright leaves its app-launch folder in /tmp; the next launcher removes it."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"app-launch-{gone.pid}-abc"
    live = tmp_path / f"app-launch-{os.getpid()}-def"
    old_style = tmp_path / "app-launch-xyz"         # no pid in its name: not known to be orphaned
    for folder in (dead, live, old_style):
        folder.mkdir()
    (dead / "bad-input").write_text("a line")
    launch.remove_orphaned_folders(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, old_style.name])


# ---------------------------------------------------------------- a node of one process (app/cluster/solo.py)

@pytest.mark.unit
@pytest.mark.parametrize("argv, alone", [
    (["--standalone", "--nproc-per-node=1", "-m", "app.train", "--epochs", "3"], ["--epochs", "3"]),
    (["--nproc-per-node", "1", "--standalone", "-m", "app.train"], []),      # docker/entrypoint.sh's order
    (["--standalone", "--nproc-per-node=1", "--max-restarts=0", "-m", "app.train"], []),
    (["--standalone", "--nproc-per-node=2", "-m", "app.train"], None),
    (["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-endpoint=h:29400", "-m", "app.train"], None),
    (["--standalone", "--nproc-per-node=1", "--log-dir", "logs", "-m", "app.train"], None),
    (["--standalone", "--nproc-per-node=1", "-m", "bench.bare_ddp"], None),
    (["--standalone", "--nproc-per-node=1", "--max-restarts=many", "-m", "app.train"], None),
])
def test_one_standalone_trainer_and_nothing_else_for_torchrun_is_started_without_torchrun(argv, alone):
    from app.cluster import solo

    found = solo.parse(argv)
    assert (found.script_args if found else None) == alone


PROBE = "import json, os; print(json.dumps(dict(os.environ)))"


@pytest.mark.multiprocess
def test_a_lone_trainer_gets_the_variables_torchrun_gives_one_standalone_worker(tmp_path):
    """The trainer cannot tell the two launchers apart: the same names, the same values where they are not
    one launch's own (its port, run id and error file)."""
    from app.cluster import solo

    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           str(tmp_path / "probe.py")], env=clean_env(), capture_output=True, text=True, timeout=120)
    theirs = {k: v for k, v in json.loads(done.stdout).items() if k not in clean_env()}
    ours = {k: v for k, v in solo.worker_env(0, 0, "run", 1234, tmp_path / "error.json").items() if k not in os.environ}
    own = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}
    assert sorted(ours) == sorted(theirs)
    assert {k: v for k, v in ours.items() if k not in own} == {k: v for k, v in theirs.items() if k not in own}
    assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "False"     # as app.launch makes torchrun's: a store per worker


def _lone_trainer_training(tmp_path, launcher_args: list[str], trainer_args: list[str]) -> subprocess.Popen:
    """`python -m app.launch` of one standalone digits trainer, returned once it has written a train row."""
    launcher = subprocess.Popen([sys.executable, "-m", "app.launch", "--standalone", "--nproc-per-node=1",
                                 *launcher_args, "-m", "app.train", "--dataset", "digits", *trainer_args,
                                 "--run-dir", str(tmp_path)], cwd=REPO, env=clean_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: (tmp_path / "metrics.jsonl").exists() and bool(read_metrics(tmp_path, "train")),
             launcher, 120, "a train row")
    return launcher


@pytest.mark.multiprocess
def test_a_node_of_one_process_starts_its_trainer_without_importing_torch_and_restarts_it_after_a_kill(tmp_path):
    launcher = _lone_trainer_training(tmp_path, [], ["--epochs", "6", "--log-every-steps", "1"])
    try:
        assert "libtorch" not in open(f"/proc/{launcher.pid}/maps").read(), "the launcher imported torch"
        (worker,) = launch._children(launcher.pid)
        os.kill(worker, signal.SIGKILL)
        out, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert [r["restart_count"] for r in read_metrics(tmp_path, "start")] == [0, 1]
    assert f"Signal 9 (SIGKILL) received by PID {worker}: restarting it (1 of {DEFAULT.max_restarts} restarts)" in err
    assert "done: 6 epochs" in out


@pytest.mark.multiprocess
def test_a_lone_trainer_out_of_restarts_is_one_summary_line_with_its_cause(tmp_path):
    launcher = _lone_trainer_training(tmp_path, ["--max-restarts=0"], ["--epochs", "400"])
    try:
        (worker,) = launch._children(launcher.pid)
        os.kill(worker, signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == failures.EXIT_PEER_LOST and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"error: 1 training process(es) failed (exit -9); rank 0 first: "
                                            f"Signal 9 (SIGKILL) received by PID {worker}")


@pytest.mark.unit
def test_an_agent_that_fails_leaves_the_rendezvous_open_and_one_that_finished_closes_it(monkeypatch):
    """torchrun's agent closed the rendezvous after a failure of its own (a rendezvous round's store read
    that timed out while a peer was killed): every other node then took the job for finished and stopped
    (the chaos runner's elastic job, back_to_back)."""
    from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerState
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    closed, beats_stopped = [], []
    monkeypatch.setattr(DynamicRendezvousHandler, "shutdown", lambda handler: closed.append(handler) or True)
    monkeypatch.setattr(DynamicRendezvousHandler, "_stop_heartbeats", lambda handler: beats_stopped.append(handler))
    results = iter([RunResult(state=WorkerState.FAILED), RunResult(state=WorkerState.SUCCEEDED)])
    monkeypatch.setattr(SimpleElasticAgent, "run", lambda agent, role="default": next(results))
    launch._close_the_rendezvous_only_at_the_end()
    handler = object.__new__(DynamicRendezvousHandler)
    SimpleElasticAgent.run(None)
    assert DynamicRendezvousHandler.shutdown(handler) and closed == [] and beats_stopped == [handler]
    SimpleElasticAgent.run(None)
    DynamicRendezvousHandler.shutdown(handler)
    assert closed == [handler]


@pytest.mark.unit
def test_an_agent_that_fails_on_its_own_is_one_line_and_no_traceback(monkeypatch):
    import torch.distributed as dist
    import torch.distributed.run

    def rendezvous_read_timed_out(args):
        raise dist.DistStoreError("wait timeout after 60000ms, keys: /torch.rendezvous.job/MASTER_ADDR")

    monkeypatch.setattr(torch.distributed.run, "run", rendezvous_read_timed_out)
    for step in ("_close_the_rendezvous_only_at_the_end", "_unique_node_names"):     # this process's own state
        monkeypatch.setattr(launch, step, lambda: None)
    args = launch.torchrun_args(["--nnodes=1:2", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=job", "-m", "app.train"],
                                DEFAULT)
    assert launch._torchrun(args, None) == (
        "error: this node's launcher failed (wait timeout after 60000ms, keys: /torch.rendezvous.job/MASTER_ADDR); "
        "the rendezvous stays open: start the node again to rejoin", 1)
