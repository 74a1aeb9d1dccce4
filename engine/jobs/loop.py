"""The loop every training job runs: ``rl``, one_step_off's training pool, ``dpo``/``kto`` and ``lm``.

A job builds its models, data, :class:`~hyflow.checkpoint.checkpointer.Checkpointer` and
:class:`~hyflow.training.supervisor.StepSupervisor` (installed before the long set-up, so no stop
signal is lost), opens the run with :func:`open_run` (resume, the resolved config, the metrics
writer, the progress line), then hands its step to :func:`run_job`::

    run = open_run(cfg, ckpt, supervisor, resume=..., lead=rank == 0)
    return run_job(run, MyJob(...))

Per step :func:`run_job` asks the job for the update (:meth:`Job.step`), agrees with every rank
on stop signals and NaN/inf (:meth:`~hyflow.training.supervisor.StepSupervisor.end_step`), lets
the job add what it reports after that agreement (:meth:`Job.report`: timers, validation, the
pools' control message), then records the metrics, checkpoints when due and stops or raises the
divergence error (:class:`~hyflow.jobs.step_end.StepEnd`). Whatever happens, the supervisor's
handlers are removed and an unfinished background save is aborted; on rank 0 the job's
:meth:`Job.summary` (a plot, a one-line result) closes the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from hyflow.jobs.run_config import record_config
from hyflow.jobs.step_end import StepEnd
from hyflow.monitor.metrics import MetricsWriter
from hyflow.monitor.progress import Progress
from hyflow.training.supervisor import StepOutcome, StepSupervisor


class Job(Protocol):
    """A job's step as :func:`run_job` calls it."""

    def step(self, step: int) -> dict:
        """Take the next batch and update on it; the step's metrics (before the ranks agree)."""

    def report(self, step: int, metrics: dict, outcome: StepOutcome) -> bool:
        """After the ranks agreed on ``outcome``: add to ``metrics`` what the step reports (timers,
        validation, throughput). False ends the run after this step."""

    def save(self, step: int) -> Optional[str]:
        """Checkpoint ``step``; the checkpoint's directory (None: the run writes none)."""

    def summary(self, metrics_path: str) -> None:
        """Rank 0, after the last step: plot the run's metrics and print its result."""


class Uninstall(Protocol):
    def uninstall(self) -> None: ...


@dataclass
class Run:
    """A run opened by :func:`open_run`: where it starts and where its metrics go.

    Attributes:
        trainer: the job's trainer section (:class:`~hyflow.jobs.trainer_config.TrainerConfig`).
        ckpt: the run's checkpointer (or a stand-in with ``poll``/``wait``/``close``/``log``).
        supervisor: the installed step supervisor.
        start: the step the run resumed at (0: fresh).
        writer: the metrics writer (the leading rank), None elsewhere.
        progress: the progress line (disabled off the leading rank).
        hooks: what the loop uninstalls at its end besides the supervisor (e.g. :mod:`hyflow.monitor.comm`).
    """

    trainer: Any
    ckpt: Any
    supervisor: StepSupervisor
    start: int
    writer: Optional[MetricsWriter]
    progress: Progress
    hooks: Sequence[Uninstall] = ()


def open_run(cfg: Any, ckpt: Any, supervisor: StepSupervisor, resume: Callable[[], int], lead: bool, *,
             required_keys: Sequence[str] = (), progress_keys: Sequence[tuple[str, str]] = ()) -> Run:
    """Resume (``resume()`` loads the checkpoint ``trainer.resume`` names and returns its step; it
    restores the random streams, so it runs after the set-up), record the config and open the metrics
    writer and the progress line on the ``lead`` rank. ``required_keys``: the metrics every row must
    have (the writer's defaults: the RL job's); ``progress_keys``: (metric, label) pairs the progress
    line shows (its defaults: the RL job's)."""
    start = resume()
    if lead:
        record_config(cfg, start)
    writer = MetricsWriter.from_config(cfg.trainer, resume_step=start or None) if lead else None
    if writer is not None and required_keys:
        writer.required_keys = tuple(required_keys)
    shown = {"shown": tuple(progress_keys)} if progress_keys else {}
    progress = Progress.from_config(cfg.trainer, initial=start, enabled=lead, **shown)
    return Run(cfg.trainer, ckpt, supervisor, start, writer, progress)


def run_job(run: Run, job: Job) -> list[dict]:
    """Step ``job`` from ``run.start + 1`` to ``trainer.total_steps`` (see the module docstring);
    returns every step's metrics of this run."""
    ends = StepEnd(run.trainer, run.ckpt, run.supervisor, run.writer, run.progress)
    try:
        for step in range(run.start + 1, run.trainer.total_steps + 1):
            run.supervisor.begin_step()
            metrics = job.step(step)
            outcome = run.supervisor.end_step(metrics, step)  # collective: agrees on stop signals and NaN/inf
            go_on = job.report(step, metrics, outcome)
            if ends.finish(step, metrics, outcome, job.save) or not go_on:
                break
        run.ckpt.wait()
    finally:
        for hook in run.hooks:
            hook.uninstall()
        run.supervisor.uninstall()
        run.ckpt.close(abort=True)  # no-op unless an error left a background save unfinished
    run.progress.close()
    if run.writer is not None:
        run.writer.close()
        job.summary(run.writer.path)
    return ends.history
