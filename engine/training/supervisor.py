"""Stopping safely between steps: preemption signals and non-finite updates.

:class:`StepSupervisor` is the trainer's view of both. Used like::

    supervisor = StepSupervisor(max_bad_steps=3, optimizers=[opt], protect=[kl_ctrl]).install()
    for step in ...:
        supervisor.begin_step()
        metrics = train_one_step()
        outcome = supervisor.end_step(metrics)    # collective: every rank, every step
        if outcome.stop:
            save_checkpoint()
            break                                 # then raise supervisor.divergence_error(...) if diverged
    supervisor.uninstall()

* SIGTERM, SIGUSR1 (Slurm's warning before the time limit, see :mod:`hyflow.launch.preemption`),
  SIGHUP and the first SIGINT (Ctrl-C) only set a flag; a second SIGINT aborts at once. :meth:`StepSupervisor.end_step` all-reduces (MAX) the flags of every rank at the
  step boundary, so all ranks stop after the same step even when the signal reached only some of
  them, and nothing ever exits inside a collective.
* :class:`NonFiniteGradGuard` makes the Megatron optimizers skip an update whose gradients hold a
  NaN / inf (parameters, Adam moments and the LR schedule stay as they were), the way Megatron
  skips an update on a loss-scale overflow, and every later update of the same step (actor and
  critic alike; mini-batches applied before the first bad one stay applied). A step with a
  skipped update or a non-finite loss is *bad*: the objects in ``protect`` (e.g. the adaptive
  KL controller) are rolled back to the start of the step, the step is counted (``training/bad_step``,
  ``training/bad_steps_total`` metrics), and after ``max_bad_steps`` consecutive bad steps the outcome
  says ``diverged``.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

#: Signals that ask for a save-and-exit at the next step boundary: SIGTERM, Slurm's SIGUSR1, a
#: closed terminal's SIGHUP and the first Ctrl-C (a second SIGINT aborts: KeyboardInterrupt).
STOP_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


class DivergenceError(RuntimeError):
    """Too many consecutive steps with NaN / inf losses or gradients."""


@dataclass
class StepOutcome:
    """What the ranks agreed on at a step boundary.

    Attributes:
        bad: the step had a NaN / inf loss or gradient (its non-finite updates were skipped).
        preempted: a stop signal reached some rank: save and exit cleanly.
        diverged: ``max_bad_steps`` consecutive bad steps: save and stop with an error.
    """

    bad: bool = False
    preempted: bool = False
    diverged: bool = False

    @property
    def stop(self) -> bool:
        return self.preempted or self.diverged


def _sub_optimizers(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


class _Trip:
    """Shared by the guards of one step: once an update was skipped inside a step (between
    ``begin_step`` and ``end_step``), skip the step's other updates too."""

    def __init__(self) -> None:
        self.tripped = False
        self.in_step = False


class NonFiniteGradGuard:
    """Make ``optimizer`` (a Megatron optimizer) skip updates whose gradients are not finite.

    Wraps the optimizer's ``prepare_grads`` (whose True return makes ``step()`` return
    ``(False, None, None)`` without touching the parameters): after the gradients are ready it
    checks them and agrees on the answer over the optimizer's gradient-statistics group, the
    group Megatron reduces the gradient norm over (data-parallel replicas hold the same reduced
    gradients, so every rank decides alike). :attr:`skipped` counts the skipped updates.

    Guards sharing a ``trip`` also skip every later update of a step (``trip.in_step``) once
    one was skipped, so a bad step leaves all models alone from its first non-finite update on.
    """

    def __init__(self, optimizer: Any, trip: Optional[_Trip] = None, device: Optional[torch.device] = None) -> None:
        self.optimizer = optimizer
        self.device = device if device is not None else torch.device("cpu")  # when it holds no gradient
        self.skipped = 0
        self.trip = trip or _Trip()
        self._original = optimizer.prepare_grads
        optimizer.prepare_grads = self._prepare_grads

    def _prepare_grads(self) -> bool:
        found_inf = (self.trip.in_step and self.trip.tripped) or bool(self._original())
        if not found_inf:
            found_inf = self._grads_not_finite()
        if found_inf:
            self.skipped += 1
            self.trip.tripped = True
        return found_inf

    @torch.no_grad()
    def _grads_not_finite(self) -> bool:
        grads = [g for opt in _sub_optimizers(self.optimizer)
                 if not getattr(opt, "is_stub_optimizer", False) for g in opt.get_main_grads_for_grad_norm()]
        device = grads[0].device if grads else self.device
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:  # one fused kernel; a NaN / inf element makes its tensor's norm non-finite
            norms = torch.stack([n.float() for n in torch._foreach_norm(grads)])
            flag[0] = torch.isfinite(norms).all().logical_not().float()
        if dist.is_initialized():
            try:
                group = self.optimizer.get_grad_stats_parallel_group()
            except (AssertionError, AttributeError):  # chained optimizers over different groups
                group = None
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def remove(self) -> None:
        """Give the optimizer its own ``prepare_grads`` back."""
        if self.optimizer.prepare_grads == self._prepare_grads:
            self.optimizer.prepare_grads = self._original


#: Metric names whose non-finite value makes a step bad: losses, KL terms, entropies and
#: log-probability statistics (a NaN in the weights or the logits shows in these first, even when
#: the loss itself is masked or clipped to a finite number).
_WATCHED = ("loss", "kl", "entropy", "logprob", "log_prob")


def _not_finite_losses(metrics: Mapping[str, Any]) -> list[str]:
    """Names of loss / KL / entropy / log-prob metrics that are NaN / inf, and of infinite
    gradient norms (a NaN norm alone means "not computed": Megatron reports none without
    clipping or on a skip)."""
    bad = []
    for key, value in metrics.items():
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if key.endswith("grad_norm"):
            if math.isinf(value):
                bad.append(key)
        elif any(w in key.lower() for w in _WATCHED) and not math.isfinite(value):
            bad.append(key)
    return bad


class StepSupervisor:
    """Preemption flags and bad-step accounting of a training loop (see the module docstring).

    Args:
        max_bad_steps: consecutive bad steps after which :meth:`end_step` reports ``diverged``.
        optimizers: Megatron optimizers to guard against non-finite updates (None entries are
            ignored).
        protect: objects with ``state_dict`` / ``load_state_dict`` rolled back after a bad step.
        signals: the signals that ask for a save-and-exit.
        group: the process group the flags are agreed over (default: the world).
        device: where the flags are reduced (the rank's device; default: the CPU).
    """

    def __init__(self, max_bad_steps: int, optimizers: Iterable[Any] = (), protect: Sequence[Any] = (),
                 signals: Sequence[int] = STOP_SIGNALS, group: Any = None,
                 device: Optional[torch.device] = None) -> None:
        if max_bad_steps < 1:
            raise ValueError(f"max_bad_steps must be >= 1, got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self.optimizers = [o for o in optimizers if o is not None]
        self.protect = list(protect)
        self.signals = tuple(signals)
        self.group = group
        self.device = device if device is not None else torch.device("cpu")
        self.requested = False
        self.signal_name: Optional[str] = None
        self._interrupts = 0
        self._announced = False
        self.bad_steps_total = 0
        self.consecutive_bad = 0
        self.bad_step_numbers: list[int] = []
        self.bad_reasons: list[str] = []  # this rank's view of the last step: what was not finite
        self._guards: list[NonFiniteGradGuard] = []
        self._trip = _Trip()
        self._previous: dict[int, Any] = {}
        self._snapshot: list[dict] = []
        self._skipped_before = 0

    # ----------------------------------------------------------------- lifecycle

    def install(self) -> "StepSupervisor":
        """Install the signal handlers (main thread only; elsewhere a warning) and the guards."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        else:
            print("[hyflow] warning: not on the main thread; preemption signals are not handled",
                  file=sys.stderr, flush=True)
        self._guards = [NonFiniteGradGuard(o, self._trip, self.device) for o in self.optimizers]
        return self

    def uninstall(self) -> None:
        """Restore the previous signal handlers and the optimizers' own ``prepare_grads``."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        for guard in self._guards:
            guard.remove()
        self._guards = []

    def __enter__(self) -> "StepSupervisor":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: Any) -> None:
        # Only set flags: printing here could re-enter a write the main thread is in.
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:  # the second Ctrl-C: abort, no save
                raise KeyboardInterrupt
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True

    def request_stop(self, reason: str = "request") -> None:
        """Ask for a save-and-exit at the next step boundary, as a signal would."""
        self.requested = True
        self.signal_name = self.signal_name or reason

    # ----------------------------------------------------------------- steps

    @property
    def skipped_updates(self) -> int:
        """Optimizer updates skipped for non-finite gradients so far."""
        return sum(g.skipped for g in self._guards)

    def begin_step(self) -> None:
        """Remember the protected objects' states and the skip counters."""
        self._snapshot = [obj.state_dict() for obj in self.protect]
        self._skipped_before = self.skipped_updates
        self._trip.tripped, self._trip.in_step = False, True

    def end_step(self, metrics: dict[str, Any], step: Optional[int] = None) -> StepOutcome:
        """Agree with the other ranks on this step (collective) and account for it.

        Adds ``training/bad_step`` (0 / 1) and ``training/bad_steps_total`` to ``metrics``.
        """
        if self.requested and not self._announced:
            self._announced = True
            again = " (Ctrl-C again to abort without saving)" if self.signal_name == "SIGINT" else ""
            print(f"[hyflow] rank {os.environ.get('RANK', '?')}: received {self.signal_name}; saving a "
                  f"checkpoint after this step, then exiting{again}", file=sys.stderr, flush=True)
        skipped = self.skipped_updates > self._skipped_before
        self.bad_reasons = _not_finite_losses(metrics) + (["gradients (update skipped)"] if skipped else [])
        bad_local = bool(self.bad_reasons)
        self._trip.tripped, self._trip.in_step = False, False
        flags = torch.tensor([float(self.requested), float(bad_local)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        preempted, bad = bool(flags[0].item() > 0), bool(flags[1].item() > 0)
        if bad:
            for obj, state in zip(self.protect, self._snapshot):
                obj.load_state_dict(state)
            self.bad_steps_total += 1
            self.consecutive_bad += 1
            if step is not None:
                self.bad_step_numbers.append(step)
        else:
            self.consecutive_bad = 0
            self.bad_step_numbers = []
        metrics["training/bad_step"] = float(bad)
        metrics["training/bad_steps_total"] = float(self.bad_steps_total)
        return StepOutcome(bad=bad, preempted=preempted, diverged=self.consecutive_bad >= self.max_bad_steps)

    def bad_step_line(self, step: int) -> str:
        """The console line of a bad step: what was not finite (as this rank saw it) and the count."""
        seen = ", ".join(self.bad_reasons[:6]) + (", ..." if len(self.bad_reasons) > 6 else "") \
            if self.bad_reasons else "values on another rank"
        return (f"[hyflow] step {step} is bad: non-finite {seen}; its updates were skipped ("
                f"{self.consecutive_bad} of trainer.max_bad_steps={self.max_bad_steps} consecutive)")

    def divergence_error(self, checkpoint: Optional[str] = None) -> DivergenceError:
        """The error that ends a diverged run, naming the steps and the checkpoint."""
        steps = ", ".join(str(s) for s in self.bad_step_numbers) or "?"
        where = f"; the weights, without the skipped updates, are saved in {checkpoint}" if checkpoint else ""
        return DivergenceError(
            f"stopping: {self.consecutive_bad} consecutive steps ({steps}) had a NaN/inf loss or gradient "
            f"(trainer.max_bad_steps={self.max_bad_steps}); their non-finite updates were skipped{where}. "
            "Lower the learning rate, check the rewards and data, or raise trainer.max_bad_steps.")

    def state_dict(self) -> dict[str, Any]:
        return {"bad_steps_total": self.bad_steps_total, "consecutive_bad": self.consecutive_bad,
                "bad_step_numbers": list(self.bad_step_numbers)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.bad_steps_total = int(state.get("bad_steps_total", 0))
        self.consecutive_bad = int(state.get("consecutive_bad", 0))
        self.bad_step_numbers = [int(s) for s in state.get("bad_step_numbers", [])]
