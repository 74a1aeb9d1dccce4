"""The ``trainer`` section every job shares (light: validates without importing torch/Megatron).

:class:`TrainerConfig` holds what the shared job loop (:mod:`hyflow.jobs.loop`) reads: the step
budget, the run directory, checkpoints and resume, the NaN/inf guard, the collective timeout and
the metrics' destinations. :class:`ValidatedTrainerConfig` adds the validation schedule of the jobs
that validate (RL, DPO/KTO); the RL job's own keys are in :mod:`hyflow.jobs.rl_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from hyflow.config import ConfigError
from hyflow.config.checks import check_positive
from hyflow.monitor.trackers import check_available


@dataclass
class TrainerConfig:
    """Run-level settings."""

    total_steps: int = field(default=100, metadata={"help": "optimizer steps"})
    output_dir: str = field(default="runs/run", metadata={"help": "metrics, config, TensorBoard, checkpoints"})
    nproc: int = field(default=1, metadata={"help": "ranks to launch on this machine"})
    seed: int = field(default=1234, metadata={"help": "seed of initialisation, sampling and mini-batch order"})
    log_every: int = field(default=1, metadata={"help": "print a progress line every N steps (when not on a terminal)"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    keep_last: int = field(default=2, metadata={"help": "complete checkpoints kept"})
    resume: str = field(default="auto", metadata={"help": "auto | never | path of a checkpoint"})
    max_bad_steps: int = field(default=3, metadata={"help": "consecutive NaN/inf steps before stopping"})
    watchdog_s: float = field(default=600.0, metadata={
        "help": "a rank that makes no progress (enters no phase of a step, finishes no step or save) for this many "
                "seconds prints one line naming its phase (again at 2x, 4x ...); 0 = off"})
    verify_checkpoints: bool = field(default=True, metadata={
        "help": "check a checkpoint's files against its manifest.json (sizes, SHA-256, no unlisted file) before "
                "loading it, and refuse one without a manifest; false (or --no-verify) skips the checksums and "
                "loads checkpoints that have no manifest (paths, sizes and pickles are still checked)"})
    collective_timeout_s: float = field(default=3600.0, metadata={
        "help": "longest wait of one collective or receive (NCCL's watchdog aborts the run after it); placement "
                "pools wait in a receive for the other pool's whole generation or update, so it must exceed the "
                "longest phase"})
    loggers: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["console", "tensorboard"], metadata={
            "help": "where metrics go besides metrics.jsonl: console (progress line), tensorboard "
                    "(output_dir/tensorboard), wandb (WANDB_MODE=offline works), mlflow (MLFLOW_TRACKING_URI, "
                    "else output_dir/mlruns)"})
    project_name: str = field(default="hyflow", metadata={"help": "W&B project and MLflow experiment"})
    experiment_name: Optional[str] = field(default=None, metadata={
        "help": "W&B / MLflow run name (null: the output_dir's name)"})

    def validate(self) -> None:
        check_positive(self, "total_steps", "nproc", "keep_last", "max_bad_steps", "collective_timeout_s")
        if not str(self.output_dir).strip():
            raise ConfigError("is empty: name the run directory (metrics, checkpoints, logs)", key="output_dir")
        if self.watchdog_s < 0:
            raise ConfigError(f"must be >= 0 (0 = off), got {self.watchdog_s}", key="watchdog_s")
        if self.save_every < 0:
            raise ConfigError(f"must be >= 0, got {self.save_every}", key="save_every")
        missing = check_available(self.loggers)
        if missing:
            raise ConfigError(missing, key="loggers")


@dataclass
class ValidatedTrainerConfig(TrainerConfig):
    """Run-level settings, with validation on held-out data."""

    val_every: int = field(default=0, metadata={
        "help": "validate on data.val_files every N steps and after the last step (verl's trainer.test_freq; "
                "0 = only after the last step)"})
    val_before_train: bool = field(default=True, metadata={
        "help": "validate the starting weights before training (logged as step 0, before the RL job's SFT "
                "warm-up; with data.val_files)"})

    def validate(self) -> None:
        super().validate()
        if self.val_every < 0:
            raise ConfigError(f"must be >= 0, got {self.val_every}", key="val_every")
