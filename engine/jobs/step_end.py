"""The end of a training step, the same for every job (RL, DPO, KTO): record the step's metrics
(the run's history, metrics.jsonl / TensorBoard on rank 0, the progress line), checkpoint when one
is due, and act on what the ranks agreed at the step boundary
(:meth:`~hyflow.training.supervisor.StepSupervisor.end_step`): after ``max_bad_steps`` bad steps
raise the divergence error (naming the checkpoint just written), on a stop signal tell the loop to
leave.

A job's loop::

    ends = StepEnd(cfg.trainer, ckpt, supervisor, writer, progress)
    for step in ...:
        ...
        outcome = supervisor.end_step(metrics, step)
        if ends.finish(step, metrics, outcome, save=lambda s: ckpt.save(s, ...)):
            break
    ckpt.wait()
    return ends.history
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hyflow.monitor import watchdog
from hyflow.training.supervisor import StepOutcome, StepSupervisor


def save_due(trainer: Any, step: int, outcome: StepOutcome) -> bool:
    """Whether ``step`` checkpoints: every ``trainer.save_every`` steps, at the last step, and before stopping."""
    every = trainer.save_every
    return outcome.stop or step == trainer.total_steps or bool(every and step % every == 0)


@dataclass
class StepEnd:
    """What a job's loop does after each step; ``history`` holds every step's metrics of this run.

    Attributes:
        trainer: the job's trainer section (``total_steps``, ``save_every``).
        ckpt: the run's :class:`~hyflow.checkpoint.checkpointer.Checkpointer`.
        supervisor: the step supervisor whose ``end_step`` gave the outcome.
        writer: the metrics writer (rank 0), None on the other ranks.
        progress: the progress line (disabled off rank 0).
    """

    trainer: Any
    ckpt: Any
    supervisor: StepSupervisor
    writer: Optional[Any]
    progress: Any
    history: list[dict] = field(default_factory=list)

    def finish(self, step: int, metrics: dict, outcome: StepOutcome, save: Callable[[int], Optional[str]]) -> bool:
        """Record ``metrics`` of ``step``; when a checkpoint is due call ``save(step)`` (it writes
        the checkpoint and returns its directory); True when the run must stop after this step (a stop signal).
        Raises the supervisor's divergence error when the run diverged."""
        watchdog.beat(f"the end of step {step} (metrics, checkpoint)")
        metrics["step"] = step
        self.history.append(metrics)
        if self.writer is not None:
            self.writer.log(step, metrics)
        self.progress.update(step, metrics)
        if outcome.bad and self.writer is not None:  # the logging rank
            print(self.supervisor.bad_step_line(step), flush=True)
        self.ckpt.poll()  # finalize background saves that finished (collective)
        saved = save(step) if save_due(self.trainer, step, outcome) else None
        if outcome.diverged:
            self.ckpt.wait()
            raise self.supervisor.divergence_error(saved)
        if outcome.preempted:
            self.ckpt.log(f"[hyflow] stopped after step {step} on a stop signal; resume with the same command "
                          "(trainer.resume=auto)")
            return True
        return False
