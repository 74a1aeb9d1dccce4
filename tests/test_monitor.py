"""Monitoring: metrics.jsonl (+ TensorBoard), phase timers, progress output and the PNG plot."""
from __future__ import annotations

import glob
import io
import json
import logging
import math
import sys

import numpy as np
import pytest

from hyflow.jobs.trainer_config import TrainerConfig
from hyflow.monitor import (
    PHASE_KEYS,
    REQUIRED_KEYS,
    MetricsWriter,
    PhaseTimers,
    Progress,
    format_duration,
    plot_metrics,
    trailing_mean,
    auto_smooth_window,
    read_metrics,
)


def full_row(step: int) -> dict:
    row = {k: 0.5 for k in REQUIRED_KEYS if k != "step"}
    row["critic/score/mean"] = step / 10
    return row


# ----------------------------------------------------------------------------- metrics.jsonl

def test_metrics_rows_and_value_conversion(tmp_path, caplog):
    torch = pytest.importorskip("torch")
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        with caplog.at_level(logging.WARNING, logger="hyflow.monitor.metrics"):
            w.log(1, {"critic/score/mean": torch.tensor(0.25), "actor/reward_kl_penalty": np.float32(0.5), "actor/grad_norm": float("nan"),
                      "perf/throughput": 7, "note": "warmup"})
            w.log(2, {"critic/score/mean": 0.75, "actor/reward_kl_penalty": float("inf")})
        with pytest.raises(ValueError, match="step 2 is not after the last logged step 2"):
            w.log(2, {})
        with pytest.raises(TypeError, match="metric 'x' = \\[1\\] is not a number"):
            w.log(3, {"x": [1]})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]   # strict JSON: NaN/inf became null
    assert rows[0] == {"step": 1, "critic/score/mean": 0.25, "actor/reward_kl_penalty": 0.5, "actor/grad_norm": None,
                       "perf/throughput": 7.0, "note": "warmup"}
    assert rows[1] == {"step": 2, "critic/score/mean": 0.75, "actor/reward_kl_penalty": None}
    assert list(rows[0])[0] == "step" and w.bad_values == 2
    assert read_metrics(str(tmp_path)) == rows
    # each missing required key is warned about once, when it first goes missing
    warnings = [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()]
    assert len(warnings) == 2
    assert "actor/pg_clipfrac" in warnings[0] and "timing_s/gen" in warnings[0] and "actor/reward_kl_penalty" not in warnings[0]
    assert warnings[1] == "metrics row for step 2 lacks actor/grad_norm, perf/throughput"


def test_required_keys_use_verl_names():
    for key in ("step", "critic/score/mean", "actor/pg_clipfrac", "actor/entropy",
                "actor/grad_norm", "response_length/mean", "perf/throughput", "timing_s/gen", "timing_s/update_actor"):
        assert key in REQUIRED_KEYS
    assert PHASE_KEYS == ("gen", "reshard", "reward", "old_log_prob", "ref", "values", "adv", "update_actor",
                          "update_critic")


def test_fresh_run_starts_a_new_file_and_resume_keeps_rows_up_to_the_checkpoint(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:
        for s in range(1, 6):
            w.log(s, full_row(s))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')                       # torn line from a crash
    with MetricsWriter(str(tmp_path), tensorboard=False, resume_step=3) as w:
        assert w.last_step == 3
        with pytest.raises(ValueError, match="not after"):
            w.log(3, {})
        w.log(4, full_row(40))
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]
    assert read_metrics(str(tmp_path))[-1]["critic/score/mean"] == 4.0
    with MetricsWriter(str(tmp_path), tensorboard=False) as w:   # not resuming: a new file, the old one kept
        w.log(1, full_row(1))
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]
    assert len(list(tmp_path.glob("metrics.*.jsonl"))) == 1


def test_tensorboard_events_written(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = TrainerConfig(output_dir=str(tmp_path / "run"), loggers=["console", "tensorboard"])
    with MetricsWriter.from_config(cfg) as w:
        assert w.tensorboard_enabled
        w.log(1, {"critic/score/mean": 0.5, "note": "x"})
        w.log(2, {"critic/score/mean": 0.7})
    events = glob.glob(str(tmp_path / "run" / "tensorboard" / "events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(events[0])
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("critic/score/mean")] == [(1, 0.5), (2, 0.7)]


def test_tensorboard_missing_degrades_to_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level(logging.WARNING, logger="hyflow.monitor.metrics"):
        w = MetricsWriter(str(tmp_path), tensorboard=True)
    assert not w.tensorboard_enabled
    assert "TensorBoard logging off" in caplog.text and "pip install tensorboard" in caplog.text
    w.log(1, full_row(1))
    w.close()
    assert read_metrics(str(tmp_path))[0]["step"] == 1


# ----------------------------------------------------------------------------- timers

class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_phase_timers_accumulate_and_reset():
    clock, syncs = FakeClock(), []
    timers = PhaseTimers(clock=clock, sync=lambda: syncs.append(clock.t))
    with timers.phase("gen"):
        clock.t += 2.0
    with timers.phase("update_actor"):
        clock.t += 1.0
    with timers.phase("gen"):
        clock.t += 0.5
    timers.add("custom", 0.25)
    clock.t += 0.1
    s = timers.step_summary()
    zero = {f"timing_s/{p}": 0.0 for p in PHASE_KEYS}
    assert s == pytest.approx(dict(zero, **{"timing_s/gen": 2.5, "timing_s/update_actor": 1.0,
                                            "timing_s/custom": 0.25, "timing_s/step": 3.6}))
    assert len(syncs) == 6                                   # one sync at each phase boundary
    with timers.phase("ref"):
        clock.t += 1.0
    s2 = timers.step_summary()
    assert s2["timing_s/gen"] == 0.0 and s2["timing_s/ref"] == pytest.approx(1.0)
    assert s2["timing_s/step"] == pytest.approx(1.0)
    assert "timing_s/custom" not in s2
    assert timers.totals() == pytest.approx({"gen": 2.5, "update_actor": 1.0, "custom": 0.25, "ref": 1.0})


def test_phase_timer_errors_and_exceptions():
    clock = FakeClock()
    timers = PhaseTimers(clock=clock)
    with pytest.raises(KeyError):
        with timers.phase("reward"):
            clock.t += 3.0
            raise KeyError("boom")
    assert timers.step_times["reward"] == 3.0                # stopped despite the exception
    timers.start("generate")
    with pytest.raises(RuntimeError, match="already running"):
        timers.start("generate")
    with pytest.raises(RuntimeError, match="still running: generate"):
        timers.step_summary()
    timers.stop("generate")
    with pytest.raises(RuntimeError, match="was not started"):
        timers.stop("generate")


# ----------------------------------------------------------------------------- progress

class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_non_tty_prints_every_n_plus_first_and_last():
    clock, out = FakeClock(), io.StringIO()
    bar = Progress(total=10, every=4, stream=out, clock=clock)
    assert not bar.tty
    for step in range(1, 11):
        clock.t += 2.0
        bar.update(step, {"critic/score/mean": step / 10, "actor/reward_kl_penalty": 0.00012, "other": 1})
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["1/10", "4/10", "8/10", "10/10"]
    assert "\r" not in out.getvalue()
    assert lines[1] == "[hyflow] step  4/10 ( 40%) | reward 0.4 | kl 1.20e-04 | 2 s/step | eta 12s"
    assert lines[-1].endswith("eta 0s")


def test_progress_tty_is_a_tqdm_bar_that_ends_its_line_before_messages():
    pytest.importorskip("tqdm")
    clock, out = FakeClock(), FakeTTY()
    bar = Progress(total=100, initial=50, stream=out, clock=clock, width=10)
    assert bar.tty
    bar.update(51, {"critic/score/mean": 0.9, "comm/seconds": 0.41, "comm/bytes": 24.6e6})
    redirected = sys.stdout
    bar.write("checkpoint saved")
    bar.update(52, {"critic/score/mean": 0.8})
    bar.close()
    assert sys.stdout is not redirected  # print() went through tqdm only while the bar was up
    text = out.getvalue()
    # the message sits on a line of its own: the bar was cleared (\r) before it and redrawn after
    before, after = text.split("checkpoint saved\n")
    assert before.endswith("\r") and after.startswith("\r")
    assert "step 52/100" in after and "reward 0.8" in after and text.endswith("\n")
    assert "reward 0.9 | comm 0.41s 24.6MB" in text
    assert bar.last_line.startswith("[hyflow] step 52/100  52%|#####")


def test_progress_comm_part_of_ci_line():
    clock, out = FakeClock(), io.StringIO()
    bar = Progress(total=2, stream=out, clock=clock)
    clock.t += 1.0
    bar.update(1, {"critic/score/mean": 0.5, "comm/seconds": 0.25, "comm/bytes": 2_500_000})
    assert out.getvalue().splitlines()[0] == "[hyflow] step 1/2 ( 50%) | reward 0.5 | comm 0.25s 2.5MB | 1 s/step | eta 1s"


def test_format_duration():
    assert [format_duration(s) for s in (5, 65, 3600 * 2 + 7 * 60, -1, math.inf)] == ["5s", "1m05s", "2h07m", "?", "?"]


# ----------------------------------------------------------------------------- plot

def _rgb(path: str) -> np.ndarray:
    """The PNG's pixels as an [h, w, 3] array of 0-255 ints."""
    import matplotlib.image as mpimg

    return (mpimg.imread(path)[..., :3] * 255).round().astype(int)


def _count(rgb: np.ndarray, color, tol: int = 10) -> int:
    return int((np.abs(rgb - np.array(color)).max(-1) <= tol).sum())


def _has(rgb: np.ndarray, color, tol: int = 10) -> bool:
    return _count(rgb, color, tol) > 0


def test_png_plot_draws_both_curves(tmp_path):
    rows = [{"step": s, "critic/score/mean": s / 20, "actor/reward_kl_penalty": None if s == 10 else 0.01 * s} for s in range(1, 21)]
    path = plot_metrics(rows, str(tmp_path / "p.png"), smooth=1)
    rgb = _rgb(path)
    assert rgb.shape == (520, 800, 3)
    assert _has(rgb, (31, 119, 180)) and _has(rgb, (214, 39, 40))      # reward (blue) and KL (red) curves
    assert not _has(rgb[:260], (214, 39, 40))                          # KL only in the lower panel


def test_trailing_mean_matches_a_direct_computation():
    values = [0.2, None, 0.5, 0.9, 0.1, 0.4, None, 0.7]
    points = [(float(i + 1), v) for i, v in enumerate(values)]
    for window in (1, 2, 3, 8, 20):
        got = trailing_mean(points, window)
        assert [x for x, _ in got] == [x for x, _ in points]
        for i, (_, y) in enumerate(got):
            if values[i] is None:
                assert y is None
                continue
            present = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
            assert y == pytest.approx(sum(present) / len(present), abs=1e-12)
    with pytest.raises(ValueError, match="window"):
        trailing_mean(points, 0)
    assert [auto_smooth_window(n) for n in (1, 19, 20, 45, 250, 1000)] == [1, 1, 5, 5, 12, 50]


def test_plot_draws_faint_raw_curve_under_the_trailing_mean(tmp_path):
    rows = [{"step": s, "critic/score/mean": (s % 2) * 0.8 + s / 100, "actor/reward_kl_penalty": 0.01 * s} for s in range(1, 41)]
    images = [_rgb(plot_metrics(rows, str(tmp_path / f"s{smooth}.png"), smooth=smooth)) for smooth in (1, None)]
    faint_blue = (177, 207, 229)        # (31, 119, 180) at alpha 0.35 over white
    raw, smoothed = (_count(img, faint_blue, tol=2) for img in images)
    assert smoothed > 2000 and smoothed > 10 * raw      # (raw: only anti-aliased edges of the blue line)
    assert _has(images[0], (31, 119, 180)) and _has(images[1], (31, 119, 180))
    with pytest.raises(ValueError, match="window"):
        plot_metrics(rows, str(tmp_path / "bad.png"), smooth=0)


def test_plot_from_run_dir_and_edge_cases(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as mw:
        mw.log(1, {"critic/score/mean": 0.3})                 # a single point, no KL at all
    path = plot_metrics(str(tmp_path))
    assert path == str(tmp_path / "reward_kl.png")
    assert _rgb(path).shape == (520, 800, 3)
    with pytest.raises(ValueError, match="out_path is required"):
        plot_metrics([{"step": 1}])
