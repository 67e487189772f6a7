"""Readers of metrics.jsonl: one row per step after a resume, and the plot drawn from them."""
from __future__ import annotations

import json

import pytest

from app import plot
from app.core.errors import UserError
from app.reporting import metrics
from app.reporting.metrics import KEYS, Reporter, latest_per_step, read

pytestmark = pytest.mark.unit


def row(event: str, step: int, t: float, world: int = 2, restarts: int = 0, **values) -> dict:
    """A row as Reporter.record writes it: every key of KEYS, None where not known."""
    return {"event": event, "time": t, **dict.fromkeys(KEYS), "step": step, "epoch": step / 10, "world_size": world,
            "restart_count": restarts, **values}


def train(step: int, t: float, loss: float, images: float = 100.0, **kw) -> dict:
    return row("train", step, t, loss=loss, lr=0.1, test_acc=None, images_per_s=images, **kw)


def killed_and_resumed() -> list[dict]:
    """Trained to step 25 at world 2 (a snapshot at 10, an eval at 20), was killed, and resumed from
    the snapshot at step 10 at world 1, whose epoch ends fall on other steps (the next eval at 22)."""
    return [
        row("start", 0, 0.0),
        train(5, 1.0, 5.0), train(10, 2.0, 4.0),
        row("snapshot", 10, 2.1),
        train(15, 3.0, 3.0), train(20, 4.0, 2.0),
        row("eval", 20, 4.1, test_acc=0.5, test_loss=2.0),
        train(25, 5.0, 1.5),
        row("start", 10, 9.0, world=1, restarts=1),
        train(15, 10.0, 3.3, world=1, restarts=1), train(20, 11.0, 2.2, world=1, restarts=1),
        row("eval", 22, 11.5, world=1, restarts=1, test_acc=0.6, test_loss=1.8),
    ]


def steps(rows: list[dict], event: str) -> list[tuple[int, float | None]]:
    return [(r["step"], r.get("loss", r.get("test_acc"))) for r in rows if r["event"] == event]


def test_redone_steps_replace_the_earlier_rows():
    rows = latest_per_step(killed_and_resumed())
    assert steps(rows, "train") == [(5, 5.0), (10, 4.0), (15, 3.3), (20, 2.2)]
    # Past the resumed step, also the rows never redone are gone: step 25 and the eval at step 20.
    assert [(r["step"], r["test_acc"]) for r in rows if r["event"] == "eval"] == [(22, 0.6)]


def test_every_start_and_snapshot_row_stays_in_file_order():
    rows = latest_per_step(killed_and_resumed())
    assert [(r["event"], r["step"]) for r in rows if r["event"] in ("start", "snapshot")] == \
        [("start", 0), ("snapshot", 10), ("start", 10)]
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)


def test_same_event_and_step_keeps_the_last_row_at_its_place():
    rows = [train(5, 1.0, 9.0), row("eval", 5, 1.5, test_acc=0.1), train(5, 2.0, 8.0), train(10, 3.0, 7.0)]
    kept = latest_per_step(rows)
    # Train and eval rows of one step are different series: both stay.
    assert [(r["event"], r["time"]) for r in kept] == [("eval", 1.5), ("train", 2.0), ("train", 3.0)]


def test_rows_of_one_incarnation_pass_unchanged():
    rows = [row("start", 0, 0.0), train(5, 1.0, 2.0), row("eval", 5, 1.1, test_acc=0.3), train(10, 2.0, 1.0)]
    assert latest_per_step(rows) == rows


def test_plot_draws_images_per_second_per_incarnation(tmp_path):
    rows = [
        row("start", 0, 1000.0),
        train(10, 1060.0, 2.0, images=100.0), train(20, 1120.0, 1.5, images=110.0),
        train(30, 1180.0, 1.2, images=120.0),                       # superseded by the resume below
        row("start", 20, 1300.0, world=1, restarts=1),
        train(30, 1360.0, 1.1, images=50.0, world=1, restarts=1),
        row("eval", 30, 1370.0, world=1, restarts=1, test_acc=0.7, test_loss=1.0),
        train(40, 1420.0, 0.9, images=55.0, world=1, restarts=1),
    ]
    fig = plot.figure(latest_per_step(rows), "test rows")
    ax = next(a for a in fig.axes if a.get_ylabel() == "images/s")
    curves = [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
              if line.get_linestyle() == "-"]
    # One line per incarnation, in minutes since the first row: the restart is a gap, not a slope.
    assert curves == [([1.0, 2.0], [100.0, 110.0]), ([6.0, 7.0], [50.0, 55.0])]
    restarts = [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert restarts == [5.0]
    assert any("world 1" in t.get_text() for t in ax.texts)

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot.plot(metrics, tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_stacks_each_process_lifes_seconds_by_where_they_went_and_titles_the_jobs_goodput():
    parts = {"startup": 5.0, "train": 40.0, "redo": 0.0, "detection": 1.0, "regroup": 2.0, "heal": 0.0,
             "slow_peer": 0.0, "eval": 1.0, "snapshot": 1.0, "other": 0.0}
    rows = [row("start", 0, 1005.0, process_started=1000.0), train(10, 1030.0, 2.0),
            row("goodput", 10, 1050.0, life_started=1000.0, wall_s=50.0, parts_s=parts),
            row("start", 8, 1064.0, restarts=1, process_started=1060.0), train(20, 1080.0, 1.0, restarts=1)]
    fig = plot.figure(latest_per_step(rows), "test rows")
    ax = next(a for a in fig.axes if a.get_ylabel() == "seconds")
    bars = [(round(b.get_x() + b.get_width() / 2), b.get_height()) for b in ax.patches if b.get_height() > 0]
    # Life 1 as its row says, in PART_COLOURS' order; life 2 was killed: start to last row, unrecorded.
    assert bars == [(1, 40.0), (1, 5.0), (1, 1.0), (1, 2.0), (1, 1.0), (1, 1.0), (2, 20.0)]
    assert ax.get_title() == "goodput 0.50; down between lives 10 s"     # 40 of 80 s, 1050 -> 1060 down


@pytest.mark.parametrize("where, message", [
    ("a-file", "run directory {tmp}/a-file is not a directory"),
    ("a-file/run", "cannot write {tmp}/a-file/run/metrics.jsonl: Not a directory"),
])
def test_a_run_directory_that_cannot_hold_metrics_is_one_error(tmp_path, where, message):
    (tmp_path / "a-file").write_text("hello")
    with pytest.raises(UserError) as err:
        Reporter(tmp_path / where, active=True, mode="lines")
    assert str(err.value) == message.format(tmp=tmp_path)
    assert (tmp_path / "a-file").read_text() == "hello"


UNUSABLE = ['42', '[1]', '"text"', 'null', '{"event": "train"}', '{"step": 3, "loss": 1.0}',
            json.dumps({**train(30, 3.0, 1.0), "step": "30"}), '{"event": "train", "ste']


def metrics_with_unusable_lines(tmp_path) -> tuple:
    """A metrics.jsonl whose good rows are interleaved with lines no reader can use."""
    good = [row("start", 0, 0.0), train(10, 1.0, 2.0), row("eval", 10, 1.5, test_acc=0.4, test_loss=1.9),
            train(20, 2.0, 1.5)]
    lines = [json.dumps(good[0]), *UNUSABLE[:4], json.dumps(good[1]), json.dumps(good[2]), *UNUSABLE[4:],
             json.dumps(good[3])]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, good


def test_unusable_lines_are_skipped_with_one_warning_that_counts_them(tmp_path, capsys):
    path, good = metrics_with_unusable_lines(tmp_path)
    assert read(path) == good
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: {path}: skipped {len(UNUSABLE)} unusable lines (each must be a JSON object with "
                   "event, time, step, epoch, loss, lr, test_acc, images_per_s, world_size, restart_count)"]
    path.write_text("".join(json.dumps(r) + "\n" for r in good))
    assert read(path) == good and capsys.readouterr().err == ""


def test_the_trainer_finds_its_last_step_past_unusable_lines(tmp_path, capsys):
    path, _ = metrics_with_unusable_lines(tmp_path)
    reporter = Reporter(tmp_path, active=True, mode="lines")
    try:
        assert reporter.last_step() == 20
    finally:
        reporter.close()
    assert capsys.readouterr().err.count("warning: ") == 1


def test_plot_draws_past_unusable_lines_and_says_one_error_when_nothing_is_left(tmp_path, capsys):
    path, _ = metrics_with_unusable_lines(tmp_path)
    assert plot.main([str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().err.count("\n") == 1
    path.write_text("\n".join(UNUSABLE) + "\n")
    assert plot.main([str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("warning: ")
    assert err[1] == f"error: {path} has no train or eval rows yet"


def test_warnings_go_to_stderr_information_to_stdout_and_only_from_the_active_reporter(tmp_path, capsys):
    for active in (True, False):
        reporter = Reporter(tmp_path / str(active), active=active, mode="lines")
        reporter.say("world size changed 2 -> 1")
        reporter.warn("snapshot at step 2 failed")
        reporter.close()
    assert capsys.readouterr() == ("world size changed 2 -> 1\n", "warning: snapshot at step 2 failed\n")


def test_a_step_line_says_the_lineage_that_trained_it_where_the_row_has_one(tmp_path, capsys):
    """The chaos runner reads step, world size and lineage (inplace's generation) off a node's console
    (app.reporting.metrics.STEP_LINE): two lineages taking the same steps are a split brain there."""
    from app.reporting.metrics import STEP_LINE

    reporter = Reporter(tmp_path, active=True, mode="lines")
    for lineage in ({"lineage": "7.0123456789ab"}, {}):
        reporter.record("train", step=12, epoch=0.5, loss=1.0, lr=0.1, images_per_s=100.0, world_size=2,
                        restart_count=0, **lineage)
    reporter.close()
    lines = capsys.readouterr().out.splitlines()
    assert [STEP_LINE.search(line).groups() for line in lines] == [("12", "2", "7.0123456789ab"), ("12", "2", None)]
    assert [r.get("lineage") for r in read(tmp_path / "metrics.jsonl")] == ["7.0123456789ab", None]


def test_plot_of_a_missing_or_unwritable_file_is_one_plain_error(tmp_path, capsys):
    assert plot.main([str(tmp_path / "nothing-here")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nothing-here'}: No such file or directory\n"
    path, _ = metrics_with_unusable_lines(tmp_path)
    assert plot.main([str(path), "-o", str(tmp_path / "no-dir" / "curves.png")]) == 2
    out = tmp_path / "no-dir" / "curves.png"
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {out}: No such file or directory"


def test_a_value_that_is_not_finite_is_written_as_null_and_every_line_stays_json(tmp_path, capsys):
    nan, inf = float("nan"), float("inf")
    reporter = Reporter(tmp_path, active=True, mode="lines")
    reporter.record("train", step=1, epoch=0.5, loss=nan, lr=inf, images_per_s=-inf, world_size=1, restart_count=0,
                    node_gpus={"10.0.0.2": [nan, 1.5]})
    reporter.record("eval", step=1, epoch=1.0, test_acc=0.1, test_loss=nan, world_size=1, restart_count=0)
    reporter.close()

    def refuse(name: str) -> None:
        pytest.fail(f"{name} is not JSON")

    rows = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["loss"], r["lr"], r["images_per_s"], r.get("test_loss")) for r in rows] == [(None,) * 4, (None,) * 4]
    assert rows[0]["node_gpus"] == {"10.0.0.2": [None, 1.5]} and rows[1]["test_acc"] == 0.1
    assert "loss nan" in capsys.readouterr().out       # the console says what it was


def test_pace_is_steps_over_wall_time_at_one_size_after_the_first_seconds():
    """10 steps/s at world 2 from t=1.1, with a 5 s stall after step 200, to step 400 at t=46; then world 1."""
    rows = [row("start", 0, 0.0)]
    rows += [train(s, 1.0 + s / 10 + (5.0 if s > 200 else 0.0), 1.0) for s in range(1, 401)]
    rows += [train(s, 47.0 + s / 100, 1.0, world=1) for s in range(401, 500)]
    # counted from PACE_SETTLE_S after the first row (step 101 at t=11.1) to step 400 at t=46.0
    assert metrics.pace(rows, 2) == pytest.approx((400 - 101) / (46.0 - 11.1))
    assert metrics.pace(rows, 2) < 9.0, "the stall counts: wall time, not a median of the rows' rates (10)"
    assert metrics.pace(rows, 2, until=20.0) == pytest.approx(10.0)
    assert metrics.pace(rows, 2, since=30.0) == pytest.approx(10.0)      # settled again from the first row after 30
    assert metrics.pace(rows, 3) is None and metrics.pace(rows, 2, until=11.0) is None


def test_pace_counts_anew_from_a_resume_that_went_back():
    rows = [train(s, s / 10, 1.0) for s in range(1, 200)]                          # to step 199 at t=19.9
    rows += [train(s, 20.0 + (s - 150) / 5, 1.0) for s in range(150, 200)]        # resumed at 150, 5 steps/s
    assert metrics.pace(rows, 2) == pytest.approx(5.0)


def test_the_done_line_gives_images_over_wall_time():
    assert metrics.done_line(3, 132, 0.98, 8448, 4.0) == \
        "done: 3 epochs, 132 steps, test_acc 0.9800, 2112 img/s (8448 images in 4.0 s)"


def test_the_done_line_rounds_the_accuracy_as_the_eval_line_does():
    """359 of digits' 360 test images: the eval line says 0.9972, and so does the done line (it said
    0.9972222222222222); no evaluation reads `-`."""
    assert ", test_acc 0.9972, " in metrics.done_line(3, 132, 359 / 360, 8448, 4.0)
    assert ", test_acc -, " in metrics.done_line(3, 132, None, 8448, 4.0)
