"""Real torchrun launches on CPU (gloo): DDP equivalence, exact resume after SIGKILL and SIGTERM,
resume across nodes that cannot see the snapshots, elastic world-size changes, and accuracy.

Runs that are compared bit for bit use one intra-op thread per process whatever the machine
(tests/helpers.py's clean_env sets OMP_NUM_THREADS=1, an explicit count the trainer keeps:
app/cluster/cores.py): results on CPU may depend on how a kernel splits its work across threads.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from app.training.snapshot import read_snapshot
from tests.helpers import (
    SYNTHETIC_TRAIN, assert_weights_equal, clean_env, finish, free_port, kill_all, newest_snapshot,
    newest_weights, read_metrics, run_trainer, snapshot_steps, start_trainer, wait_for, worker_pids,
)

pytestmark = pytest.mark.multiprocess

BATCH = 8                                        # per process
STEPS_PER_EPOCH = SYNTHETIC_TRAIN // (2 * BATCH)  # 24 at world size 2
EPOCHS = 2
SAVE_EVERY = 5


def common(data: Path) -> list:
    return ["--dataset", "synthetic", "--data-dir", data, "--model", "tiny", "--progress", "lines",
            "--save-every-seconds", "0", "--keep", "100"]


def exact_args(data: Path, run_dir: Path) -> list:
    """The deterministic 2-epoch job that the resume tests compare against an uninterrupted run."""
    return [*common(data), "--deterministic", "--batch-size", BATCH, "--epochs", EPOCHS,
            "--save-every-steps", SAVE_EVERY, "--log-every-steps", 4, "--run-dir", run_dir]


def copy_snapshot(src_dir: Path, step: int, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    shutil.copytree(src_dir / name, dest_dir / name)
    return dest_dir / name


def last(rows: list[dict], event: str) -> dict:
    found = [r for r in rows if r["event"] == event]
    assert found, f"no {event} row"
    return found[-1]


@pytest.fixture(scope="module")
def reference(synthetic_data, tmp_path_factory) -> Path:
    """An uninterrupted deterministic 2-process run; keeps every snapshot it makes."""
    run_dir = tmp_path_factory.mktemp("reference")
    run_trainer(exact_args(synthetic_data, run_dir), nproc=2, timeout=180)
    steps = snapshot_steps(run_dir / "snapshots")
    assert steps[-1] == EPOCHS * STEPS_PER_EPOCH and 10 in steps
    return run_dir


def assert_same_result(run_dir: Path, reference: Path) -> None:
    """Bit-identical final weights, final test accuracy and last logged training loss."""
    assert snapshot_steps(run_dir / "snapshots")[-1] == EPOCHS * STEPS_PER_EPOCH
    assert_weights_equal(newest_weights(run_dir / "snapshots"), newest_weights(reference / "snapshots"))
    ours, theirs = read_metrics(run_dir), read_metrics(reference)
    assert last(ours, "eval")["test_acc"] == last(theirs, "eval")["test_acc"]
    assert last(ours, "eval")["epoch"] == float(EPOCHS)
    assert last(ours, "train")["step"] == last(theirs, "train")["step"]
    assert last(ours, "train")["loss"] == last(theirs, "train")["loss"]

def assert_same_parameters(run_dir: Path, reference: Path) -> None:
    """As assert_same_result, for a run resumed from a snapshot that a rank other than 0 wrote: that
    rank kept its own batch-norm running statistics, one batch apart from rank 0's (DDP sends rank
    0's at the start of each forward; each rank then updates its copy). They are used only in
    evaluation: the parameters and the training loss stay bit-identical."""
    ours, theirs = newest_weights(run_dir / "snapshots"), newest_weights(reference / "snapshots")
    running = {k for k in ours if "running_" in k or "num_batches" in k}
    assert_weights_equal({k: v for k, v in ours.items() if k not in running},
                         {k: v for k, v in theirs.items() if k not in running})
    assert_weights_equal({k: ours[k].double() for k in running}, {k: theirs[k].double() for k in running},
                         atol=0.05, rtol=0.0)
    assert last(read_metrics(run_dir), "train")["loss"] == last(read_metrics(reference), "train")["loss"]


# ---------------------------------------------------------------- a. DDP equivalence

BN_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def test_two_processes_match_one_process_accumulating_the_same_micro_batches(synthetic_data, tmp_path):
    """DDP's gradient average over 2 processes = one process accumulating the same two micro-batches.

    Batch norm decides the shape of this test. 2 processes x b against 1 process x 2b would need
    synchronised batch norm (per-process statistics over b images legitimately differ from
    statistics over 2b), and PyTorch's SyncBatchNorm does not run on CPU. So the single process
    instead takes 2 micro-batches of b (--grad-accum 2), each normalised over itself as on one rank,
    with b = 1: only then are its micro-batches exactly the samples the two ranks get (the ranks are
    dealt the epoch's order round-robin, one process takes it in contiguous runs). The BN running
    statistics are not compared: DDP keeps rank 0's (broadcast every forward), the single process
    updates them once per micro-batch; they only matter for evaluation, never for the gradients.
    """
    k = 6
    args = [*common(synthetic_data), "--deterministic", "--label-smoothing", "0", "--epochs", 1, "--batch-size", 1,
            "--max-steps", k, "--save-every-steps", k]   # --max-steps stops without a save; this one saves step k
    run_trainer([*args, "--run-dir", tmp_path / "two"], nproc=2)
    run_trainer([*args, "--grad-accum", 2, "--run-dir", tmp_path / "one"], nproc=0)
    two, one = newest_snapshot(tmp_path / "two" / "snapshots"), newest_snapshot(tmp_path / "one" / "snapshots")
    assert two["train_state"]["step"] == one["train_state"]["step"] == k
    assert two["train_state"]["consumed"] == one["train_state"]["consumed"] == 2 * k
    assert two["scheduler"] == one["scheduler"]
    weights = lambda s: {n: t for n, t in s["model"].items() if not n.endswith(BN_STATISTICS)}  # noqa: E731
    fresh = initial_weights()
    assert weights(two).keys() == fresh.keys()       # every conv, BN affine and linear parameter
    assert_weights_equal(weights(two), weights(one), atol=1e-5)
    momentum = lambda s: [v["momentum_buffer"] for v in s["optimizer"]["state"].values()]  # noqa: E731
    assert len(momentum(two)) == len(weights(two))
    for a, b in zip(momentum(two), momentum(one)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # The weights did move: equal because they were trained alike, not because nothing happened.
    assert any(not torch.allclose(weights(two)[n], fresh[n], atol=1e-3) for n in fresh)


def initial_weights() -> dict[str, torch.Tensor]:
    """The parameters every run starts from (--seed 0 seeds the model on every rank)."""
    from app.training import models

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = models.build("tiny", 10)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_sync_bn_on_cpu_processes_is_a_clear_error(synthetic_data, tmp_path):
    result = run_trainer([*common(synthetic_data), "--batch-size", BATCH, "--sync-bn", "true",
                          "--run-dir", tmp_path], nproc=2, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --sync-bn needs GPUs: PyTorch's SyncBatchNorm does not run on CPU processes"]
    assert not re.search(r"\[rank\d+\]:\s*Traceback", result.stderr), result.stderr[-3000:]


# ---------------------------------------------------------------- b. exact resume after SIGKILL

def test_sigkill_mid_epoch_then_resume_is_exact(synthetic_data, tmp_path, reference):
    args = exact_args(synthetic_data, tmp_path)
    ckpt = tmp_path / "snapshots"
    proc = start_trainer(args, nproc=2)
    try:
        wait_for(lambda: (ckpt / f"step-{SAVE_EVERY:08d}").is_dir(), proc, timeout=120, what="the first snapshot")
    finally:
        kill_all(proc, signal.SIGKILL)            # launcher and workers at once: no clean shutdown
    proc.communicate(timeout=30)
    killed_at = newest_snapshot(ckpt)["train_state"]
    assert killed_at["consumed"] > 0 and killed_at["step"] < STEPS_PER_EPOCH, f"not mid-epoch: {killed_at}"

    result = run_trainer(args, nproc=2, timeout=180)
    step = killed_at["step"]
    assert f"resuming from {ckpt / f'step-{step:08d}'}" in result.stdout
    assert f"resumed at epoch 0, step {step}, {killed_at['consumed']} samples into the epoch" in result.stdout
    starts = [(r["resumed"], r["step"]) for r in read_metrics(tmp_path, "start")]
    assert starts == [(False, 0), (True, step)]
    assert_same_result(tmp_path, reference)


# ---------------------------------------------------------------- c. nodes without the snapshots

def test_the_newest_snapshot_on_any_node_wins_and_every_node_keeps_one(synthetic_data, tmp_path, reference):
    """Two torchrun 'nodes' on this host (static rendezvous), each with a snapshot directory of its own
    (no shared disk): node 0 holds an older snapshot, node 1 the newer one. The job must resume from
    node 1's (rank 0 never pulls it back), node 0 gets a copy, and the end is the uninterrupted run's."""
    node_dirs = [tmp_path / "node0-snapshots", tmp_path / "node1-snapshots"]
    copy_snapshot(reference / "snapshots", 10, node_dirs[0])
    copy_snapshot(reference / "snapshots", 15, node_dirs[1])
    port = free_port()
    procs = []
    try:
        for node in (0, 1):
            launcher = ["--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}", "--master-addr=127.0.0.1",
                        f"--master-port={port}"]
            env = clean_env(TRAIN_SNAPSHOT_DIR=str(node_dirs[node]))
            args = exact_args(synthetic_data, tmp_path / f"node{node}-run")
            procs.append(start_trainer(args, env=env, launcher_args=launcher))
        results = [finish(p, timeout=180) for p in procs]
    finally:
        for p in procs:
            kill_all(p)
    for r in results:
        assert r.returncode == 0, f"{r.args}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert f"resuming from {node_dirs[1] / 'step-00000015'} (read on rank 1's node)" in results[0].stdout
    assert read_metrics(tmp_path / "node0-run", "start")[0]["step"] == 15
    assert not (tmp_path / "node1-run" / "metrics.jsonl").exists()     # only rank 0 reports
    assert not list((tmp_path / "node1-run").glob("events.out.tfevents.*"))   # nor TensorBoard events
    assert list((tmp_path / "node0-run").glob("events.out.tfevents.*"))
    assert 15 in snapshot_steps(node_dirs[0])          # the copy: node 0 no longer lacks the newest
    for directory in node_dirs:            # both nodes write their own snapshots, to the same end
        assert snapshot_steps(directory)[-1] == EPOCHS * STEPS_PER_EPOCH
        assert_weights_equal(newest_weights(directory), newest_weights(reference / "snapshots"))
    final_acc = last(read_metrics(tmp_path / "node0-run"), "eval")["test_acc"]
    assert final_acc == last(read_metrics(reference), "eval")["test_acc"]


# ---------------------------------------------------------------- d. accuracy

def test_the_default_job_learns_digits(tmp_path):
    """What `make up NODES=2` runs on a machine without CIFAR: no settings but the directories.
    It must learn visibly in its first epoch (chance is 0.10) and end above 95%."""
    (tmp_path / "data").mkdir()
    start = time.monotonic()
    run_trainer(["--data-dir", tmp_path / "data", "--run-dir", tmp_path / "run", "--progress", "lines"],
                nproc=2, timeout=300)
    elapsed = time.monotonic() - start
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["dataset_used"] == "digits"
    evals = read_metrics(tmp_path / "run", "eval")
    epochs = record["config"]["epochs"]
    assert [r["epoch"] for r in evals] == [float(e) for e in range(1, epochs + 1)]
    assert all(r["world_size"] == 2 for r in evals)
    curve = " ".join(f"{r['test_acc']:.3f}" for r in evals)
    print(f"default job on digits, 2 processes: test_acc per epoch {curve}, {elapsed:.1f}s")
    assert evals[0]["test_acc"] >= 0.3, curve
    assert evals[-1]["test_acc"] >= 0.95, curve


# ---------------------------------------------------------------- e. SIGTERM

def test_sigterm_writes_a_snapshot_and_resume_continues_from_it(synthetic_data, tmp_path, reference):
    """torchrun forwards SIGTERM to its workers (as on a membership change): the current step is kept."""
    args = exact_args(synthetic_data, tmp_path)
    ckpt = tmp_path / "snapshots"
    proc = start_trainer(args, nproc=2)
    try:
        # Between two periodic saves (steps 5 and 10): the snapshot SIGTERM writes is a new one.
        wait_for(lambda: any(r["event"] == "train" and r["step"] >= 8 for r in read_metrics(tmp_path))
                 if (tmp_path / "metrics.jsonl").exists() else False, proc, timeout=120, what="step 8")
        proc.send_signal(signal.SIGTERM)             # to torchrun alone; it signals the workers
        result = finish(proc, timeout=90)
    finally:
        kill_all(proc)
    assert result.returncode != 0
    lines = [line for line in result.stdout.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(lines) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    step = int(lines[0].split("snapshot at step ")[1].split()[0])
    assert lines[0] == f"stopped by SIGTERM: snapshot at step {step} written"
    assert step % SAVE_EVERY != 0 and step >= 8
    assert snapshot_steps(ckpt)[-1] == step
    assert newest_snapshot(ckpt)["train_state"]["step"] == step
    assert not re.search(r"\[rank\d+\]:\s*Traceback", result.stderr), result.stderr[-3000:]

    resumed = run_trainer(args, nproc=2, timeout=180)
    assert f"resuming from {ckpt / f'step-{step:08d}'}" in resumed.stdout
    # Rank 0 writes it when it gets to its claim first; when the signal reaches rank 0 a step later,
    # rank 1 does (with its own batch-norm statistics).
    assert_same_parameters(tmp_path, reference)


def test_sigterm_reaching_ranks_at_different_steps(synthetic_data, tmp_path, reference):
    """Each rank checks for SIGTERM at its own step boundary, so a peer may stop one step earlier
    (across nodes, agents signal their workers at different moments). Rank 0's next collective then
    fails; the step both had finished must be kept, and the resumed run must train exactly on."""
    args = exact_args(synthetic_data, tmp_path)
    ckpt = tmp_path / "snapshots"
    proc = start_trainer(args, nproc=2)
    try:
        wait_for(lambda: (ckpt / f"step-{SAVE_EVERY:08d}").is_dir(), proc, timeout=120, what="the first snapshot")
        workers = worker_pids(proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGTERM)          # rank 1 stops at its next boundary and leaves
        time.sleep(0.5)                              # rank 0 runs into a collective with nobody there
        with contextlib.suppress(ProcessLookupError):   # the launcher may have stopped it already, as it
            os.kill(workers[0], signal.SIGTERM)          # would across nodes a little later
        result = finish(proc, timeout=90)
    finally:
        kill_all(proc)
    lines = [line for line in result.stdout.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(lines) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    step = int(lines[0].split("snapshot at step ")[1].split()[0])
    assert snapshot_steps(ckpt)[-1] == step and step >= SAVE_EVERY
    assert not re.search(r"\[rank\d+\]:\s*Traceback", result.stderr), result.stderr[-3000:]

    resumed = run_trainer(args, nproc=2, timeout=180)
    assert f"resuming from {ckpt / f'step-{step:08d}'}" in resumed.stdout
    # Rank 1 stopped first and kept the step (rank 0 was blocked in a collective that rank 1 left).
    assert_same_parameters(tmp_path, reference)


# ---------------------------------------------------------------- f. elastic world size

def test_resume_at_another_world_size(synthetic_data, tmp_path, reference):
    # 2 -> 1: the reference's mid-epoch snapshot at step 10, continued by one process.
    one = tmp_path / "one"
    start_step = 10
    src = train_state_at(reference / "snapshots", start_step)
    copy_snapshot(reference / "snapshots", start_step, one / "snapshots")
    result = run_trainer(exact_args(synthetic_data, one), nproc=0, timeout=180)
    assert "world size changed 2 -> 1" in result.stdout
    assert f"resumed at epoch 0, step {start_step}, {src['consumed']} samples into the epoch" in result.stdout
    rows = read_metrics(one)
    assert rows and all(r["world_size"] == 1 for r in rows)
    assert (rows[0]["event"], rows[0]["resumed"], rows[0]["step"]) == ("start", True, start_step)
    assert last(rows, "eval")["epoch"] == float(EPOCHS)
    # Every remaining sample of epoch 0 once, then a full epoch, 8 images per step.
    rest = SYNTHETIC_TRAIN - src["consumed"]
    final_one = start_step + rest // BATCH + SYNTHETIC_TRAIN // BATCH
    assert snapshot_steps(one / "snapshots")[-1] == final_one

    # 1 -> 2: a mid-epoch snapshot of that single-process run, continued by two processes.
    mid = [s for s in snapshot_steps(one / "snapshots") if s > start_step
           and (ts := train_state_at(one / "snapshots", s))["epoch"] == 1 and ts["consumed"] > 0]
    assert mid, "no mid-epoch snapshot in the second epoch"
    step = mid[len(mid) // 2]
    state = train_state_at(one / "snapshots", step)
    assert state["world_size"] == 1
    two = tmp_path / "two"
    copy_snapshot(one / "snapshots", step, two / "snapshots")
    result = run_trainer(exact_args(synthetic_data, two), nproc=2, timeout=180)
    assert "world size changed 1 -> 2" in result.stdout
    rows = read_metrics(two)
    assert rows and all(r["world_size"] == 2 for r in rows)
    assert (rows[0]["event"], rows[0]["resumed"], rows[0]["step"]) == ("start", True, step)
    assert last(rows, "eval")["epoch"] == float(EPOCHS)
    rest = SYNTHETIC_TRAIN - state["consumed"]
    assert snapshot_steps(two / "snapshots")[-1] == step + (rest - rest % 2) // 2 // BATCH
    assert f"done: {EPOCHS} epochs" in result.stdout



def train_state_at(directory: Path, step: int) -> dict:
    return read_snapshot(directory / f"step-{step:08d}")["train_state"]


# ---------------------------------------------------------------- e. just-in-time snapshots

def _train_rows_reach(run_dir: Path, step: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(r["event"] == "train" and r["step"] >= step for r in read_metrics(run_dir))


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0"])
def test_a_survivor_keeps_the_step_it_holds_and_the_resume_loses_nothing(synthetic_data, tmp_path, reference,
                                                                          victim):
    """SIGKILL one worker mid-epoch: the other writes the step it holds; the next launch resumes from
    it, loses no completed step, and ends bit-identical to the reference (the same arguments: where
    snapshots fall decides where the logged loss is summed in float64)."""
    args = exact_args(synthetic_data, tmp_path)
    once = ["--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    proc = start_trainer(args, nproc=2, launcher_args=once)
    wait_for(lambda: _train_rows_reach(tmp_path, 8), proc, timeout=120, what="step 8")
    os.kill(worker_pids(proc.pid)[victim], signal.SIGKILL)
    killed = finish(proc, timeout=120)
    assert killed.returncode != 0
    logged = max(r["step"] for r in read_metrics(tmp_path, "train"))
    kept = newest_snapshot(tmp_path / "snapshots")["train_state"]
    assert kept["step"] >= logged and 0 < kept["consumed"], (kept, logged)    # no completed step lost
    # The survivor learns of the loss from its next collective ("lost contact ...") or from torchrun's
    # SIGTERM, whichever comes first; either way it keeps the step it holds.
    said = killed.stdout + killed.stderr
    assert f"snapshot at step {kept['step']} written" in said or kept["step"] % SAVE_EVERY == 0, said[-3000:]

    resumed = run_trainer(args, nproc=2, timeout=180)
    assert read_metrics(tmp_path, "start")[-1]["step"] == kept["step"], resumed.stdout[-2000:]
    if victim == 1:
        assert_same_result(tmp_path, reference)
        return
    assert_same_parameters(tmp_path, reference)


@pytest.mark.serial     # found within 2 s of the heartbeat timeout
def test_a_frozen_rank_is_found_by_its_silent_heartbeat_and_its_peer_leaves_its_stacks(synthetic_data, tmp_path):
    """SIGSTOP one worker: its peer notices within the heartbeat timeout (3 s), long before the
    collective timeout (60 s here), writes the stacks of its threads to the run directory and says, in
    one line, where they are and that the frozen one cannot answer; then keeps its step."""
    args = [*common(synthetic_data), "--batch-size", BATCH, "--epochs", 50, "--run-dir", tmp_path,
            "--log-every-steps", 1, "--save-every-steps", 1000, "--collective-timeout", 60,
            "--heartbeat-timeout", 3]
    once = ["--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    proc = start_trainer(args, nproc=2, launcher_args=once)
    try:
        wait_for(lambda: _train_rows_reach(tmp_path, 5), proc, timeout=120, what="step 5")
        frozen_at = time.time()
        pids = worker_pids(proc.pid)
        os.kill(pids[1], signal.SIGSTOP)
        wait_for(lambda: bool(list((tmp_path / "snapshots").glob("step-*"))), proc, timeout=30,
                 what="the peer's just-in-time snapshot")
        kept = newest_snapshot(tmp_path / "snapshots")
    finally:
        kill_all(proc, signal.SIGKILL)
    out = finish(proc, timeout=60)
    manifest = json.loads(next((tmp_path / "snapshots").glob("step-*/manifest.json")).read_text())
    detected_s = manifest["created"] - frozen_at
    print(f"\n[heartbeat] frozen rank noticed and its peer's step kept after {detected_s:.2f} s")
    assert detected_s < 3 + 2.0, detected_s
    assert kept["train_state"]["step"] >= 5
    assert "rank 1 has not sent a heartbeat for 3 s" in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("hang stacks (")]
    assert len(lines) == 1, out.stderr[-3000:]
    stacks = list((tmp_path / "hangs").glob(f"*-rank0-pid{pids[0]}.txt"))
    assert len(stacks) == 1 and f"rank 0 (pid {pids[0]}, this one) in {stacks[0]}" in lines[0], lines[0]
    assert f"rank 1 (pid {pids[1]}) is stopped and cannot answer" in lines[0], lines[0]
    text = stacks[0].read_text()
    assert "Thread 0x" in text and "heartbeat.py" in text and "trainer.py" in text, text     # every thread
    print(f"[heartbeat] stacks written {stacks[0].stat().st_mtime - frozen_at:.2f} s after the freeze")


# ---------------------------------------------------------------- g. torch.compile

def test_compile_is_not_redone_after_a_resume(synthetic_data, tmp_path):
    """--compile compiles once per process; a resumed run compiles its graph afresh but never
    recompiles it (no guard fails on the restored state), and its first step is not counted in images/s."""
    args = [*common(synthetic_data), "--compile", "--batch-size", BATCH, "--epochs", 1, "--run-dir", tmp_path,
            "--log-every-steps", 1, "--save-every-steps", 3]
    env = clean_env(TORCH_LOGS="recompiles")
    run_trainer([*args, "--max-steps", 4], nproc=0, env=env, timeout=600)
    resumed = run_trainer([*args, "--max-steps", 8], nproc=0, env=env, timeout=600)
    assert read_metrics(tmp_path, "start")[-1]["step"] == 4
    assert "Recompiling" not in resumed.stderr, resumed.stderr[-3000:]
    firsts = [r for r in read_metrics(tmp_path, "train") if r["step"] in (1, 5)]
    assert [r["images_per_s"] for r in firsts] == [None, None]        # the compiling step is left out


class SlowProxy:
    """A TCP proxy to 127.0.0.1:`port` that holds every request `delay_s` before passing it on: an object
    store that answers, but slowly (a loaded server, a long way off)."""

    def __init__(self, port: int, delay_s: float) -> None:
        import socket
        import threading

        self.target, self.delay_s = port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client = self.listener.accept()[0]
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, self.delay_s), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, 0.0), daemon=True).start()

    @staticmethod
    def _pump(source, target, delay_s: float) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                time.sleep(delay_s)
                target.sendall(data)
        with contextlib.suppress(OSError):
            target.shutdown(1)

    def close(self) -> None:
        self.listener.close()


def test_a_slow_object_store_at_start_holds_no_rank_past_its_collective_timeout(object_store, synthetic_data, tmp_path):
    """Rank 0 reads the store before the ranks gather what each found; the others waited for it in the
    gather itself, whose timeout is the collective's: with a store slower than that, the job never started."""
    proxy = SlowProxy(object_store.port, delay_s=8.0)
    try:
        env = clean_env(**object_store.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}"))
        url = object_store.url(f"slow-{os.getpid()}-{time.monotonic_ns()}")
        result = run_trainer([*common(synthetic_data), "--batch-size", BATCH, "--max-steps", 3, "--run-dir", tmp_path,
                              "--collective-timeout", 5, "--snapshot-url", url], nproc=2, env=env, timeout=240)
    finally:
        proxy.close()
    assert [row["restart_count"] for row in read_metrics(tmp_path, "start")] == [0], result.stderr
    assert "Timed out" not in result.stderr
