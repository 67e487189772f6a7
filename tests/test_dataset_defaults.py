"""Per-dataset defaults: settings left unset are filled in once the dataset is known; given ones stay."""
from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from app.core import config
from tests.helpers import REPO, clean_env, describe, trainer_cmd

pytestmark = pytest.mark.unit

PER_DATASET = ("model", "batch_size")


def parse(*argv: str, **env: str) -> config.Config:
    return config.parse(list(argv), environ=env)


def test_every_loadable_dataset_has_valid_defaults():
    assert set(config.DATASET_DEFAULTS) == set(config.DATASETS) - {"auto"}
    for defaults in config.DATASET_DEFAULTS.values():
        assert set(defaults) == set(PER_DATASET)
        assert defaults["model"] in config.MODELS and defaults["batch_size"] > 0


def test_unset_until_the_dataset_is_known():
    cfg = parse()
    assert (cfg.model, cfg.batch_size) == (None, None)


@pytest.mark.parametrize("dataset, model, batch_size", [
    ("digits", "tiny", 32),
    ("cifar10", "resnet18", 128),
    ("cifar100", "resnet18", 128),
    ("synthetic", "resnet18", 128),
])
def test_resolve_fills_in_the_dataset_defaults(dataset, model, batch_size):
    cfg = parse()
    resolved = config.resolve(cfg, dataset)
    assert (resolved.model, resolved.batch_size) == (model, batch_size)
    # Nothing else changes but the snapshot cadences, which are the device's (SNAPSHOT_DEFAULTS).
    cadences = dict.fromkeys(config.SNAPSHOT_DEFAULTS["cpu"])
    assert dataclasses.replace(resolved, model=None, batch_size=None, **cadences) == cfg


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_resolve_fills_in_the_devices_snapshot_cadences_and_a_setting_wins(device):
    resolved = config.resolve(parse(), "cifar10", device)
    assert {k: getattr(resolved, k) for k in config.SNAPSHOT_DEFAULTS[device]} == config.SNAPSHOT_DEFAULTS[device]
    assert config.resolve(parse("--save-every-steps", "7", TRAIN_SAVE_EVERY_SECONDS="5"), "cifar10", device
                          ).save_every_steps == 7
    assert config.resolve(parse(TRAIN_SAVE_EVERY_SECONDS="5"), "cifar10", device).save_every_seconds == 5


def test_a_flag_wins_over_the_dataset_default():
    resolved = config.resolve(parse("--model", "resnet18"), "digits")
    assert (resolved.model, resolved.batch_size) == ("resnet18", 32)


def test_an_environment_variable_wins_over_the_dataset_default():
    resolved = config.resolve(parse(TRAIN_BATCH_SIZE="64"), "cifar10")
    assert (resolved.model, resolved.batch_size) == ("resnet18", 64)
    resolved = config.resolve(parse("--batch-size", "8", TRAIN_BATCH_SIZE="64", TRAIN_MODEL="resnet34"), "digits")
    assert (resolved.model, resolved.batch_size) == ("resnet34", 8)


def test_help_states_the_per_dataset_defaults():
    text = " ".join(config.help_text().split())        # argparse wraps lines
    assert "default per dataset: resnet18 for cifar10, cifar100, synthetic; tiny for digits" in text
    assert "default per dataset: 128 for cifar10, cifar100, synthetic; 32 for digits" in text
    assert "(default: None)" not in text


def test_config_json_records_the_resolved_values(tmp_path):
    """A real run: `auto` without CIFAR under the data directory is digits, whose defaults apply;
    a TRAIN_* variable still wins over them."""
    (tmp_path / "data").mkdir()
    args = ["--data-dir", tmp_path / "data", "--run-dir", tmp_path / "run", "--epochs", "1", "--max-steps", "2",
            "--progress", "lines"]
    result = subprocess.run(trainer_cmd(args, nproc=0), cwd=REPO, env=clean_env(TRAIN_BATCH_SIZE="16"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, describe(result, "trainer failed")
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["dataset_used"] == "digits" and record["config"]["dataset"] == "auto"
    assert (record["config"]["model"], record["config"]["batch_size"]) == ("tiny", 16)
