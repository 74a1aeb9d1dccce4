"""The end of a training step shared by the RL and preference jobs (hyflow.jobs.step_end): when
it checkpoints, what it records, and how it stops (one process, fakes for the writer, progress
line and checkpointer; the jobs' multi-rank runs are in test_resume.py and
test_preference_job.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hyflow.jobs.step_end import StepEnd, save_due
from hyflow.training.supervisor import DivergenceError, StepOutcome, StepSupervisor


class FakeCheckpointer:
    def __init__(self) -> None:
        self.events: list = []

    def poll(self) -> None:
        self.events.append("poll")

    def wait(self) -> None:
        self.events.append("wait")

    def log(self, message: str) -> None:
        self.events.append(("log", message))


class Recorder:
    def __init__(self) -> None:
        self.rows: list = []

    def log(self, step: int, metrics: dict) -> None:
        self.rows.append((step, dict(metrics)))

    update = log


def _ends(total: int = 10, every: int = 4, writer=True):
    trainer = SimpleNamespace(total_steps=total, save_every=every)
    return StepEnd(trainer, FakeCheckpointer(), StepSupervisor(max_bad_steps=2), Recorder() if writer else None,
                   Recorder())


def test_checkpoints_every_save_every_steps_at_the_last_and_before_stopping():
    ends = _ends(total=10, every=4)
    saved = []
    for step in range(1, 11):
        assert ends.finish(step, {"loss": float(step)}, StepOutcome(), lambda s: saved.append(s) or f"ckpt{s}") is False
    assert saved == [4, 8, 10]
    assert ends.ckpt.events.count("poll") == 10  # every step: background saves are finalized
    assert [m["step"] for m in ends.history] == list(range(1, 11))
    assert ends.writer.rows == ends.progress.rows and ends.writer.rows[2] == (3, {"loss": 3.0, "step": 3})
    # save_every=0: only the last step, or a stop
    never = _ends(total=5, every=0)
    assert [s for s in range(1, 6) if save_due(never.trainer, s, StepOutcome())] == [5]
    assert save_due(never.trainer, 2, StepOutcome(preempted=True))
    assert save_due(never.trainer, 2, StepOutcome(diverged=True))


def test_a_stop_signal_saves_and_ends_the_loop():
    ends = _ends(writer=False)  # off rank 0: no metrics writer
    saved = []
    assert ends.finish(3, {}, StepOutcome(preempted=True), lambda s: saved.append(s) or "ckpt") is True
    assert saved == [3] and ends.history == [{"step": 3}]
    assert any(e[0] == "log" and "stopped after step 3" in e[1] for e in ends.ckpt.events if isinstance(e, tuple))


def test_divergence_raises_after_saving_and_names_the_checkpoint():
    ends = _ends()
    ends.supervisor.consecutive_bad, ends.supervisor.bad_step_numbers = 2, [5, 6]
    with pytest.raises(DivergenceError, match=r"\(5, 6\).*saved in runs/x/step_000006"):
        ends.finish(6, {"loss": float("nan")}, StepOutcome(bad=True, diverged=True), lambda s: f"runs/x/step_{s:06d}")
    assert ends.ckpt.events[-1] == "wait"  # the save finished before the error
    assert ends.history[-1]["step"] == 6 and ends.writer.rows[-1][0] == 6  # the bad step is still logged
