"""Checkpoint bookkeeping and the step supervisor without ranks: discovery, markers, pruning,
RNG capture, preemption flags, non-finite update guards and bad-step accounting."""

import json
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from hyflow.checkpoint.discovery import (MARKER_FILE, checkpoint_status, latest_checkpoint, list_checkpoints,
                                         prune_checkpoints, resume_path, step_dir_name)
from hyflow.checkpoint.files import write_atomic
from hyflow.checkpoint.rng import capture_rng, restore_rng
from hyflow.training.supervisor import DivergenceError, StepSupervisor


def _fake_checkpoint(root: str, step: int, complete: bool = True) -> str:
    path = os.path.join(root, step_dir_name(step))
    os.makedirs(path)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"step": step}, f)
    if complete:
        with open(os.path.join(path, MARKER_FILE), "w") as f:
            json.dump({"step": step}, f)
    return path


def test_discovery_skips_incomplete_and_prune_keeps_last(tmp_path):
    root = str(tmp_path / "checkpoints")
    for step, complete in ((1, True), (2, True), (3, True), (4, False), (5, False)):
        _fake_checkpoint(root, step, complete)
    write_atomic(os.path.join(root, step_dir_name(3), MARKER_FILE), "{trunc")  # a torn marker
    warnings = []
    entry = latest_checkpoint(root, warnings.append)
    assert entry.step == 2
    assert [w.split()[3].rstrip(":") for w in warnings] == [os.path.join(root, step_dir_name(s)) for s in (5, 4, 3)]
    assert "interrupted" in warnings[0] and "unreadable" in warnings[2]
    assert resume_path("auto", str(tmp_path), lambda m: None).endswith(step_dir_name(2))
    assert resume_path("never", str(tmp_path)) is None
    assert resume_path("auto", str(tmp_path / "fresh")) is None
    assert resume_path(str(tmp_path), "elsewhere", lambda m: None).endswith(step_dir_name(2))
    with pytest.raises(ValueError, match="incomplete"):
        resume_path(os.path.join(root, step_dir_name(4)), str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resume_path(str(tmp_path / "empty"), str(tmp_path))
    _fake_checkpoint(root, 6)
    removed = prune_checkpoints(root, keep_last=2)
    assert sorted(os.path.basename(p) for p in removed) == [step_dir_name(s) for s in (1, 3, 4, 5)]
    assert [(e.step, e.complete) for e in list_checkpoints(root)] == [(2, True), (6, True)]
    assert checkpoint_status(os.path.join(root, step_dir_name(6))) == (True, "")


def test_rng_capture_restore_undoes_every_draw():
    state = capture_rng()
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


class _FakeOptimizer:
    """What the guard needs of a Megatron optimizer: prepare_grads and the main grads."""

    def __init__(self) -> None:
        self.grad = torch.ones(3)

    def prepare_grads(self) -> bool:
        return False

    def get_main_grads_for_grad_norm(self) -> list:
        return [self.grad]

    def step(self) -> bool:  # Megatron: a True prepare_grads skips the update
        return not self.prepare_grads()


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_supervisor_skips_non_finite_updates_counts_and_diverges():
    actor, critic, ctrl = _FakeOptimizer(), _FakeOptimizer(), _Counter()
    sup = StepSupervisor(2, [actor, None, critic], protect=[ctrl]).install()
    try:
        sup.begin_step()
        assert actor.step() and critic.step()
        ctrl.value = 1
        out = sup.end_step(metrics := {"actor/pg_loss": 0.5, "actor/grad_norm": float("nan")}, step=1)
        assert not out.bad and not out.stop and metrics["training/bad_step"] == 0.0 and ctrl.value == 1

        actor.grad = torch.tensor([1.0, float("nan"), 0.0])
        sup.begin_step()
        ctrl.value = 99
        assert not actor.step() and not critic.step()  # the critic's finite update is skipped too
        out = sup.end_step(metrics := {}, step=2)
        assert out.bad and not out.diverged and ctrl.value == 1  # rolled back
        assert metrics == {"training/bad_step": 1.0, "training/bad_steps_total": 1.0}

        actor.grad = torch.ones(3)
        assert actor.step()  # outside a step (e.g. the SFT warm-up) nothing sticks
        sup.begin_step()
        assert actor.step()
        out = sup.end_step({"critic/value_loss": float("inf")}, step=3)
        assert out.bad and out.diverged and sup.skipped_updates == 2
        message = str(sup.divergence_error("/ckpt/step_000003"))
        assert "2 consecutive steps (2, 3)" in message and "/ckpt/step_000003" in message
        assert isinstance(sup.divergence_error(), DivergenceError)
        state = sup.state_dict()
    finally:
        sup.uninstall()
    assert actor.prepare_grads.__func__ is _FakeOptimizer.prepare_grads
    fresh = StepSupervisor(2)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state == {"bad_steps_total": 2, "consecutive_bad": 2, "bad_step_numbers": [2, 3]}


def test_supervisor_turns_signals_into_a_stop_at_the_step_boundary():
    previous = signal.getsignal(signal.SIGUSR1)
    with StepSupervisor(3) as sup:
        sup.begin_step()
        os.kill(os.getpid(), signal.SIGUSR1)  # would terminate the process without the handler
        out = sup.end_step({}, step=1)
        assert out.preempted and out.stop and not out.bad and sup.signal_name == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_a_non_finite_kl_or_log_prob_makes_the_step_bad_and_says_so(capsys):
    """Issue #39 point 1: NaN weights showed as `kl nan` while the loss stayed finite, and no line
    said the step was bad."""
    from hyflow.jobs.step_end import StepEnd

    class _Quiet:
        def log(self, message):
            pass

        def poll(self):
            pass

        def wait(self):
            pass

    class _Writer:
        def log(self, step, metrics):
            pass

    class _Progress:
        def update(self, step, metrics):
            pass

    trainer = type("T", (), {"save_every": 0, "total_steps": 10})()
    with StepSupervisor(3) as sup:
        ends = StepEnd(trainer, _Quiet(), sup, _Writer(), _Progress())
        for step, metrics in enumerate(({"actor/pg_loss": 0.1, "actor/reward_kl_penalty": float("nan")},
                                        {"actor/pg_loss": 0.1, "rollout/logprob_diff_max": float("inf")},
                                        {"actor/pg_loss": 0.1, "actor/entropy": 1.0, "actor/grad_norm": float("nan")}),
                                       start=1):
            sup.begin_step()
            out = sup.end_step(metrics, step=step)
            ends.finish(step, metrics, out, save=lambda s: None)
            assert out.bad == (step < 3), (step, metrics)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[hyflow] step 1 is bad: non-finite actor/reward_kl_penalty; its updates were skipped (1 of "
                     "trainer.max_bad_steps=3 consecutive)",
                     "[hyflow] step 2 is bad: non-finite rollout/logprob_diff_max; its updates were skipped (2 of "
                     "trainer.max_bad_steps=3 consecutive)"]


def test_ctrl_c_and_sighup_stop_at_the_step_boundary_and_a_second_ctrl_c_aborts():
    for sig in (signal.SIGINT, signal.SIGHUP):
        with StepSupervisor(3) as sup:
            sup.begin_step()
            os.kill(os.getpid(), sig)
            out = sup.end_step({}, step=1)
            assert out.preempted and sup.signal_name == signal.Signals(sig).name
    with StepSupervisor(3) as sup:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs between bytecodes
