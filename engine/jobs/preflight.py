"""Checks of a job config that need the file system, run by the launchers before any rank
starts (``hyflow train``, ``hyflow launch local``, ``hyflow launch slurm``): one
:class:`~hyflow.config.ConfigError` naming the key and the path, in seconds."""

from __future__ import annotations

import importlib
from typing import Any

from hyflow.checkpoint.discovery import resume_candidates
from hyflow.checkpoint.errors import CheckpointError
from hyflow.checkpoint.run_lock import check_unlocked
from hyflow.config import ConfigError
from hyflow.jobs.run_config import check_run_reuse

#: job name -> module with ``preflight(cfg)``; jobs without one have nothing to check.
PREFLIGHT = {"rl": "hyflow.jobs.rl_preflight"}


def preflight(cfg: Any) -> None:
    """Run the job's pre-flight checks; raises :class:`~hyflow.config.ConfigError`."""
    _check_run_dir(cfg)  # no other run in it, no silent start over beside set-aside checkpoints
    check_run_reuse(cfg)  # the run directory's own run is not continued with another config
    module = PREFLIGHT.get(getattr(cfg, "job", ""))
    if module:
        importlib.import_module(module).preflight(cfg)


def _check_run_dir(cfg: Any) -> None:
    """No other run holds ``trainer.output_dir`` (:mod:`hyflow.checkpoint.run_lock`), and
    ``trainer.resume=auto`` does not silently start over beside set-aside checkpoints."""
    trainer = getattr(cfg, "trainer", None)
    if not getattr(trainer, "output_dir", None):
        return
    for key, check in (("trainer.output_dir", lambda: check_unlocked(trainer.output_dir)),
                       ("trainer.resume", lambda: getattr(trainer, "resume", None) == "auto" and resume_candidates(
                           "auto", trainer.output_dir, lambda _: None))):
        try:
            check()
        except CheckpointError as e:
            raise ConfigError(str(e), key=key) from None
