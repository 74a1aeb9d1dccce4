"""Checks of a job config that need the file system, run by the launchers before any rank
starts (``hyflow train``, ``hyflow launch local``, ``hyflow launch slurm``): one
:class:`~hyflow.config.ConfigError` naming the key and the path, in seconds."""

from __future__ import annotations

import importlib
from typing import Any

#: job name -> module with ``preflight(cfg)``; jobs without one have nothing to check.
PREFLIGHT = {"rl": "hyflow.jobs.rl_preflight"}


def preflight(cfg: Any) -> None:
    """Run the job's pre-flight checks; raises :class:`~hyflow.config.ConfigError`."""
    from hyflow.jobs.run_config import check_run_reuse

    check_run_reuse(cfg)  # the run directory's own run is not continued with another config
    module = PREFLIGHT.get(getattr(cfg, "job", ""))
    if module:
        importlib.import_module(module).preflight(cfg)
