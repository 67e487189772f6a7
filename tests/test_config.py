"""Config: flags, TRAIN_* environment variables, and validation."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from app.core import config
from app.core.errors import UserError

pytestmark = pytest.mark.unit


def parse(*argv: str, **env: str) -> config.Config:
    return config.parse(list(argv), environ=env)


def test_defaults_without_flags_or_environment():
    cfg = parse()
    assert cfg == config.Config()
    assert cfg.snapshot_dir == Path("runs/latest/snapshots")
    assert cfg.resume is None and cfg.nesterov is None


def test_environment_sets_values():
    cfg = parse(TRAIN_EPOCHS="7", TRAIN_BATCH_SIZE="32", TRAIN_LR="0.05", TRAIN_DATASET="digits",
                TRAIN_SYNC_BN="yes", TRAIN_DETERMINISTIC="1", TRAIN_CHECKPOINT_DIR="/ckpt", TRAIN_RESUME="false",
                TRAIN_RUN_DIR="/runs/x", TRAIN_PROGRESS="lines")
    assert (cfg.epochs, cfg.batch_size, cfg.lr, cfg.dataset) == (7, 32, 0.05, "digits")
    assert cfg.sync_bn is True and cfg.deterministic is True and cfg.resume is False
    assert cfg.snapshot_dir == Path("/ckpt")
    assert cfg.run_dir == Path("/runs/x") and cfg.progress == "lines"


def test_flag_wins_over_environment():
    cfg = parse("--epochs", "3", "--dataset", "synthetic", "--sync-bn", "false", "--no-resume",
                TRAIN_EPOCHS="7", TRAIN_DATASET="digits", TRAIN_SYNC_BN="true", TRAIN_RESUME="true")
    assert (cfg.epochs, cfg.dataset, cfg.sync_bn, cfg.resume) == (3, "synthetic", False, False)


def test_environment_fills_what_flags_leave_out():
    cfg = parse("--epochs", "3", TRAIN_BATCH_SIZE="16")
    assert (cfg.epochs, cfg.batch_size) == (3, 16)


@pytest.mark.parametrize("raw, expected", [("", None), ("auto", None), ("AUTO", None), ("1", True), ("no", False)])
def test_resume_from_environment(raw, expected):
    assert parse(TRAIN_RESUME=raw).resume is expected


def test_empty_snapshot_dir_means_default():
    assert parse("--run-dir", "r", TRAIN_SNAPSHOT_DIR="").snapshot_dir == Path("r/snapshots")
    assert parse("--run-dir", "r", TRAIN_CHECKPOINT_DIR="").snapshot_dir == Path("r/snapshots")


def test_checkpoint_dir_is_an_alias_of_snapshot_dir():
    assert parse("--checkpoint-dir", "/a").snapshot_dir == Path("/a")
    assert parse("--snapshot-dir", "/b", TRAIN_CHECKPOINT_DIR="/a").snapshot_dir == Path("/b")


def test_bare_boolean_switches():
    cfg = parse("--deterministic", "--amp", "--epochs", "2")
    assert cfg.deterministic is True and cfg.amp is True and cfg.epochs == 2
    assert parse("--deterministic", "false").deterministic is False


@pytest.mark.parametrize("name, raw, fragment", [
    ("TRAIN_EPOCHS", "many", "invalid literal for int()"),
    ("TRAIN_LR", "fast", "could not convert string to float"),
    ("TRAIN_SYNC_BN", "maybe", "expected true or false"),
    ("TRAIN_RESUME", "sometimes", "expected true or false"),
    ("TRAIN_DATASET", "mnist", "choose from auto, cifar10, cifar100, digits, synthetic"),
    ("TRAIN_MODEL", "vgg", "choose from tiny, resnet18"),
    ("TRAIN_PROGRESS", "fancy", "choose from auto, bar, lines"),
])
def test_bad_environment_value_names_the_variable(name, raw, fragment):
    with pytest.raises(UserError) as err:
        parse(**{name: raw})
    message = str(err.value)
    assert message.startswith(f"environment variable {name}={raw!r}: "), message
    assert fragment in message
    assert "\n" not in message


def test_bad_environment_value_is_reported_even_when_a_flag_overrides_it():
    # A typo in the environment is a configuration error whether or not a flag shadows it.
    with pytest.raises(UserError, match="TRAIN_EPOCHS"):
        parse("--epochs", "3", TRAIN_EPOCHS="x")


def test_unrelated_environment_is_ignored():
    assert parse(TRAINING="x", TRAIN_NOT_A_FLAG="1", HOME="/root") == config.Config()


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "--epochs must be positive, got 0"),
    (["--epochs", "-3"], "--epochs must be positive, got -3"),
    (["--batch-size", "0"], "--batch-size must be positive, got 0"),
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--lr", "-0.1"], "--lr must be positive, got -0.1"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--grad-accum", "0"], "--grad-accum must be positive, got 0"),
    (["--keep", "0"], "--keep must be positive, got 0"),
    (["--log-every-steps", "0"], "--log-every-steps must be positive, got 0"),
    (["--eval-every-epochs", "0"], "--eval-every-epochs must be positive, got 0"),
    (["--collective-timeout", "0"], "--collective-timeout must be positive, got 0.0"),
    (["--save-every-steps", "-1"], "--save-every-steps must be zero or more, got -1"),
    (["--save-every-seconds", "-1"], "--save-every-seconds must be zero or more, got -1.0"),
    (["--upload-every-seconds", "-1"], "--upload-every-seconds must be zero or more, got -1.0"),
    (["--max-steps", "-1"], "--max-steps must be zero or more, got -1"),
    (["--warmup-epochs", "-0.5"], "--warmup-epochs must be zero or more, got -0.5"),
    (["--weight-decay=-1e-4"], "--weight-decay must be zero or more, got -0.0001"),
    (["--momentum", "-0.9"], "--momentum must be zero or more, got -0.9"),
    (["--threads", "-1"], "--threads must be zero or more, got -1"),
    (["--full-size", "-1"], "--full-size must be zero or more, got -1"),
    (["--full-size", "2"], "--full-size (spares) works in --ft inplace only, not elastic (docs/spares.md)"),
    (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1), got 1.0"),
    (["--label-smoothing", "-0.1"], "--label-smoothing must be in [0, 1), got -0.1"),
    (["--optimizer", "adamw", "--nesterov", "true"], "--nesterov applies to --optimizer sgd only, not adamw"),
    (["--momentum", "0"], "Nesterov SGD needs --momentum > 0 (or pass --nesterov false)"),
    (["--momentum", "0", "--nesterov", "true"], "Nesterov SGD needs --momentum > 0 (or pass --nesterov false)"),
])
def test_validation_messages(argv, message):
    with pytest.raises(UserError) as err:
        parse(*argv)
    assert str(err.value) == message


FLOAT_FLAGS = ["--lr", "--momentum", "--weight-decay", "--warmup-epochs", "--label-smoothing", "--save-every-seconds",
               "--upload-every-seconds", "--collective-timeout", "--heartbeat-timeout", "--bucket-mb"]


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_setting_refuses_a_value_that_is_not_finite(flag, value):
    with pytest.raises(UserError) as err:
        parse(f"{flag}={value}")
    assert str(err.value) == f"{flag} must be a finite number, got {float(value)}"


def test_the_float_settings_tried_above_are_all_of_them():
    floats = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(config.Config) if f.type in ("float", "float | None")}
    assert floats == set(FLOAT_FLAGS)


@pytest.mark.parametrize("argv, message", [
    (["--group-store", "127.0.0.1:99999"], "--group-store 127.0.0.1:99999: port 99999 is out of range (1 to 65535)"),
    (["--group-store", "storehost:0"], "--group-store storehost:0: port 0 is out of range (1 to 65535)"),
    (["--group-store", "storehost"], "--group-store must look like HOST:PORT, got 'storehost'"),
    (["--lighthouse", "http://h:70000"], "--lighthouse http://h:70000: port 70000 is out of range (1 to 65535)"),
    (["--lighthouse", "h:29510"], "--lighthouse must look like http://HOST:PORT, got 'h:29510'"),
])
def test_a_host_port_setting_that_cannot_be_one_is_one_error(argv, message):
    with pytest.raises(UserError) as err:
        parse(*argv)
    assert str(err.value) == message


@pytest.mark.parametrize("text, host_port", [("h:1", ("h", 1)), ("[::1]:65535", ("::1", 65535)),
                                             ("10.0.0.2:29400", ("10.0.0.2", 29400))])
def test_a_host_port_setting_is_split_once_for_everyone(text, host_port):
    assert config.endpoint(text, "--group-store") == host_port
    assert config.lighthouse_endpoint(f"http://{text}/") == host_port


def test_validation_applies_to_environment_values_too():
    with pytest.raises(UserError, match=r"^--batch-size must be positive, got -4$"):
        parse(TRAIN_BATCH_SIZE="-4")
    with pytest.raises(UserError, match="--nesterov applies to --optimizer sgd only"):
        parse(TRAIN_OPTIMIZER="adamw", TRAIN_NESTEROV="true")


@pytest.mark.parametrize("argv", [
    ["--momentum", "0", "--nesterov", "false"],
    ["--optimizer", "adamw"],
    ["--optimizer", "adamw", "--nesterov", "false"],
    ["--save-every-steps", "0", "--save-every-seconds", "0", "--max-steps", "0", "--warmup-epochs", "0"],
    ["--label-smoothing", "0"],
])
def test_valid_edge_values(argv):
    parse(*argv)


@pytest.mark.parametrize("argv, fragment", [
    (["--resume", "--no-resume"], "argument --no-resume: not allowed with argument --resume"),
    (["--no-resume", "--resume"], "argument --resume: not allowed with argument --no-resume"),
    (["--dataset", "mnist"], "argument --dataset: invalid choice: 'mnist'"),
    (["--model", "vgg16"], "argument --model: invalid choice: 'vgg16'"),
    (["--epochs", "1.5"], "argument --epochs: invalid int value: '1.5'"),
    (["--sync-bn", "perhaps"], "argument --sync-bn: invalid boolean value: 'perhaps'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_parse_errors_are_user_errors(argv, fragment):
    with pytest.raises(UserError) as err:
        parse(*argv)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_to_dict_is_json_friendly():
    import json

    d = parse("--snapshot-dir", "/c").to_dict()
    assert d["snapshot_dir"] == "/c" and d["run_dir"] == "runs/latest"
    json.dumps(d)


def test_help_mentions_environment_variables():
    assert "TRAIN_FOO_BAR" in config.help_text()


def test_snapshots_live_in_the_run_directory_by_default():
    assert parse("--run-dir", "x").snapshot_dir == Path("x/snapshots")


def test_help_states_who_reads_and_writes_the_snapshots():
    # argparse wraps the help text: compare with the line breaks undone.
    help_text = " ".join(config.help_text().split())
    assert config.SNAPSHOT_RULE in help_text
    assert "only global rank 0" not in help_text


def test_the_resolved_config_keeps_the_policy_of_the_environment_it_was_parsed_from():
    """resolve() copies the config: the copy must not rebuild its policy from another environment."""
    cfg = config.parse(["--dataset", "digits"], environ={"FT_HEARTBEAT_TIMEOUT": "2"})
    resolved = config.resolve(cfg, "digits")
    assert resolved.fault_policy() is cfg.fault_policy() and resolved.fault_policy().ft_heartbeat_timeout_s == 2.0
