"""How long a stopping run needs: the preemption grace period, from measured save times.

When a run is asked to stop (SIGTERM, Slurm's SIGUSR1 before the time limit), every rank
finishes its current step, saves a checkpoint and exits. The launcher must wait that long before
it kills anything: torchrun's ``--shutdown-timeout`` (after which it SIGKILLs the ranks) and
Slurm's ``--signal=USR1@<seconds>`` are both sized here as::

    grace = 1.5 * (step time + save time) + 30 s,   at least 60 s

The save time is the longest ``save_seconds`` recorded in the run's checkpoint markers (every
save measures itself) and the step time the longest ``time/step`` of the last logged steps. A
run with no checkpoint yet estimates the save from the model size (weights plus Adam state) at
a conservative write bandwidth, and says it did.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from hyflow.checkpoint.discovery import MARKER_FILE, checkpoints_root, list_checkpoints

MIN_GRACE_S = 60
MARGIN_S = 30
#: Write bandwidth assumed for an unmeasured save: per rank, and for the whole job (a shared
#: file system's aggregate), in bytes / s; plus a fixed cost (planning, metadata, manifest).
_PER_RANK_BPS = 200e6
_JOB_BPS = 20e9
_FIXED_S = 10.0
#: Bytes a checkpoint holds per parameter: weights plus fp32 Adam moments (and master copy).
_BYTES_PER_PARAM = {"fp32": 4 + 8, "bf16": 2 + 12, "fp16": 2 + 12}


@dataclass
class Grace:
    """A grace period and how it was derived (for the launcher's log line)."""

    seconds: int
    save_s: float
    step_s: Optional[float]
    measured: bool

    def describe(self) -> str:
        save = f"{'measured' if self.measured else 'estimated'} save {self.save_s:.0f} s"
        step = f", step {self.step_s:.0f} s" if self.step_s is not None else ""
        return f"{self.seconds} s ({save}{step})"


def measured_save_seconds(output_dir: str) -> Optional[float]:
    """The longest ``save_seconds`` among the run's complete checkpoints, or None."""
    times = []
    for entry in list_checkpoints(checkpoints_root(output_dir)):
        if not entry.complete:
            continue
        try:
            with open(os.path.join(entry.path, MARKER_FILE)) as f:
                times.append(float(json.load(f)["save_seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(times) if times else None


def measured_step_seconds(output_dir: str, last: int = 20) -> Optional[float]:
    """The longest ``time/step`` of the last ``last`` rows of the run's ``metrics.jsonl``, or None."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    steps = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                value = json.loads(line).get("time/step")
            except ValueError:
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                steps.append(float(value))
    return max(steps[-last:]) if steps else None


def estimated_save_seconds(cfg: Any, world_size: int) -> float:
    """A conservative save time for a run that has not saved yet, from the model size."""
    model = getattr(cfg, "model", None)
    if model is None:
        return _FIXED_S
    params = model.num_parameters()
    trained = 2 if getattr(getattr(cfg, "critic", None), "enable", False) else 1
    dtype = getattr(getattr(cfg, "actor", None), "dtype", "fp32")
    size = params * _BYTES_PER_PARAM.get(dtype, 14) * trained
    return _FIXED_S + size / min(world_size * _PER_RANK_BPS, _JOB_BPS)


def preemption_grace(cfg: Any, world_size: int) -> Grace:
    """The grace period of ``cfg``'s run on ``world_size`` ranks (see the module docstring)."""
    output_dir = cfg.trainer.output_dir
    save = measured_save_seconds(output_dir)
    measured = save is not None
    if save is None:
        save = estimated_save_seconds(cfg, world_size)
    step = measured_step_seconds(output_dir)
    seconds = max(MIN_GRACE_S, math.ceil(1.5 * (save + (step or 0.0)) + MARGIN_S))
    return Grace(seconds, save, step, measured)
