"""app/core/policy.py: one owner for the fault timings, their order, and every file that uses them."""
from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from datetime import timedelta

import pytest

from app.core.errors import UserError
from app.core.policy import DEFAULT, TORCHRUN_WORKER_STOP_GRACE_S, FaultPolicy
from tests.helpers import REPO, clean_env

ENV_NAMES = [f.metadata["env"] for f in dataclasses.fields(FaultPolicy)]


@pytest.mark.unit
def test_the_defaults_are_in_order():
    assert DEFAULT.check() is DEFAULT
    assert DEFAULT.dead_node_window_s == 3


@pytest.mark.unit
@pytest.mark.parametrize("given, names", [
    ({"heartbeat_timeout_s": 40.0}, ("--heartbeat-timeout", "--collective-timeout")),
    ({"heartbeat_interval_s": 5.0}, ("HEARTBEAT_INTERVAL", "--heartbeat-timeout")),
    ({"monitor_interval_s": 2.0}, ("MONITOR_INTERVAL", "RDZV_LAST_CALL_TIMEOUT")),
    ({"jit_snapshot_budget_s": 45.0}, ("JIT_SNAPSHOT_BUDGET", "torchrun's worker stop grace")),
    ({"stop_grace_s": 20.0}, ("torchrun's worker stop grace", "STOP_GRACE")),
    ({"rdzv_keep_alive_max_attempt": 1}, ("RDZV_KEEP_ALIVE_INTERVAL (1 s)", "x RDZV_KEEP_ALIVE_MAX_ATTEMPT (1 s)")),
])
def test_a_conflicting_pair_is_one_error_naming_both(given, names):
    with pytest.raises(UserError) as caught:
        dataclasses.replace(DEFAULT, **given).check()
    line = str(caught.value)
    assert "\n" not in line and all(name in line for name in names), line


@pytest.mark.unit
def test_a_heartbeat_turned_off_needs_no_order():
    assert dataclasses.replace(DEFAULT, heartbeat_timeout_s=0.0, collective_timeout_s=1.0).check()


@pytest.mark.unit
def test_the_environment_overrides_and_bad_values_are_one_error():
    policy = FaultPolicy.from_env({"RDZV_LAST_CALL_TIMEOUT": "5", "MAX_RESTARTS": "4"})
    assert policy.rdzv_conf()["last_call_timeout"] == 5 and policy.max_restarts == 4
    with pytest.raises(UserError, match="RDZV_LAST_CALL_TIMEOUT='soon'"):
        FaultPolicy.from_env({"RDZV_LAST_CALL_TIMEOUT": "soon"})


@pytest.mark.unit
@pytest.mark.parametrize("name, raw", [("HEARTBEAT_INTERVAL", "inf"), ("STOP_GRACE", "nan"),
                                       ("FT_QUORUM_TIMEOUT", "-inf")])
def test_a_timing_that_is_not_finite_is_one_error(name, raw):
    with pytest.raises(UserError, match=rf"^{name}='{raw}': expected a number"):
        FaultPolicy.from_env({name: raw})


@pytest.mark.unit
@pytest.mark.parametrize("name, port", [("RDZV_PORT", "99999"), ("LIGHTHOUSE_PORT", "65536")])
def test_a_port_out_of_range_is_one_error(name, port):
    with pytest.raises(UserError) as caught:
        FaultPolicy.from_env({name: port}).check()
    assert str(caught.value) == f"{name}: port {port} is out of range (1 to 65535)"


@pytest.mark.unit
def test_the_trainer_refuses_a_conflicting_pair_in_one_line():
    done = subprocess.run([sys.executable, "-m", "app.train", "--heartbeat-timeout", "40"], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --heartbeat-timeout (40 s) must be shorter than --collective-timeout (30 s): a hung peer must be "
        "declared lost (and the step kept) before the collective waiting for it fails on its own"]


@pytest.mark.unit
def test_the_shell_reads_named_settings_and_refuses_unknown_ones():
    run = lambda *names, **env: subprocess.run([sys.executable, "-m", "app.core.policy", *names], cwd=REPO,
                                               env=clean_env(**env), capture_output=True, text=True, timeout=60)
    assert run("REJOIN_ATTEMPTS", "REJOIN_PAUSE", REJOIN_PAUSE="0.5").stdout.split() == [
        f"REJOIN_ATTEMPTS={DEFAULT.rejoin_attempts}", "REJOIN_PAUSE=0.5"]
    bad = run("REJOIN_SOMETIMES")
    assert bad.returncode == 2 and bad.stderr.startswith("error: no fault-policy setting REJOIN_SOMETIMES")


# ---------------------------------------------------------------- every other file takes it from here

# Under Slurm the store lives in the first node's agent, and the torchft Lighthouse beside it, on ports
# of each job's own (so that two jobs can share a first node): different defaults on purpose, not the
# store service's ports restated.
OWN_DEFAULTS = {"scripts/train.sbatch": {"RDZV_PORT", "LIGHTHOUSE_PORT"}}


@pytest.mark.unit
@pytest.mark.parametrize("path", ["docker/entrypoint.sh", "scripts/train.sbatch"])
def test_the_shell_files_restate_no_timing(path):
    text = (REPO / path).read_text()
    restated = [name for name in ENV_NAMES if re.search(rf"\${{{name}:-", text)
                and name not in OWN_DEFAULTS.get(path, ())]
    assert not restated, f"{path} gives its own default for {restated}: read it from app/core/policy.py"
    assert "torch.distributed.run" not in text and "app.node torchrun" not in text   # app.launch adds the policy


@pytest.mark.unit
def test_compose_passes_every_timing_on_and_its_defaults_are_the_policys():
    text = (REPO / "compose.yaml").read_text()
    trainer = text[text.index("\n  trainer:"):]
    # The store's port reaches the nodes inside RDZV_ENDPOINT.
    missing = [n for n in ENV_NAMES if n != "RDZV_PORT" and not re.search(rf"^\s+{n}:", trainer, re.M)]
    assert not missing, f"compose.yaml does not pass {missing} on to the nodes"
    defaults = dict(re.findall(r"\$\{(\w+):-(\d+(?:\.\d+)?)\}", text))
    assert float(defaults["STOP_GRACE"]) == DEFAULT.stop_grace_s
    assert int(defaults["RDZV_PORT"]) == DEFAULT.store_port
    assert "MAX_RESTARTS:-" not in text


# ---------------------------------------------------------------- the torch behaviour it relies on

@pytest.mark.unit
def test_torchrun_stops_workers_with_the_grace_the_policy_assumes():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert inspect.signature(LocalElasticAgent._shutdown).parameters["timeout"].default == TORCHRUN_WORKER_STOP_GRACE_S


@pytest.mark.unit
def test_torchs_c10d_rendezvous_reads_every_key_the_policy_gives_it():
    """A key torch does not read is ignored without a word (`heartbeat=5` once was): pin each one."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    policy = dataclasses.replace(DEFAULT, rdzv_last_call_s=7, rdzv_join_timeout_s=70, rdzv_close_timeout_s=17,
                                 rdzv_keep_alive_interval_s=2, rdzv_keep_alive_max_attempt=4)
    params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id="pin", min_nodes=1, max_nodes=2,
                                  **{k: str(v) for k, v in policy.rdzv_conf().items()})
    store = HashStore()
    handler = create_handler(store, C10dRendezvousBackend(store, "pin"), params)
    settings = handler.settings
    assert (settings.timeout.last_call, settings.timeout.join, settings.timeout.close) == (
        timedelta(seconds=7), timedelta(seconds=70), timedelta(seconds=17))
    assert (settings.keep_alive_interval, settings.keep_alive_max_attempt) == (timedelta(seconds=2), 4)


@pytest.mark.unit
def test_the_documented_budget_is_the_policy():
    """docs/fault-tolerance.md's table: every setting once, with the policy's default."""
    from app.core.policy import _format

    text = (REPO / "docs" / "fault-tolerance.md").read_text()
    documented = dict(re.findall(r"^\| `(?:--[a-z-]+` / `)?([A-Z0-9_]+)` \| ([\d.]+) \|", text, re.M))
    expected = {f.metadata["env"]: _format(getattr(DEFAULT, f.name)) for f in dataclasses.fields(FaultPolicy)}
    assert documented == expected
