"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step) and the experiment trackers
(:mod:`hyflow.monitor.trackers`: TensorBoard, Weights & Biases, MLflow).

Values may be Python numbers, numpy scalars or 0-d tensors; non-finite floats are written as
``null`` (valid JSON), counted in ``bad_values`` and left out of the trackers. TensorBoard needs
the ``tensorboard`` package; without it only the jsonl is written, after a one-line warning.

On resume, pass ``resume_step``: the file is kept and rewritten atomically with one row per step
up to it, in order (the last row written for a step wins; rows after it were written by the
interrupted run after its last checkpoint and are re-run). A fresh run never truncates an earlier
run's file: it is renamed ``metrics.<time>.jsonl`` first.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Mapping, Optional, Sequence

from hyflow.monitor.trackers import TensorBoardTracker, open_trackers

__all__ = ["REQUIRED_KEYS", "PHASE_KEYS", "MetricsWriter", "read_metrics", "to_float"]

_LOG = logging.getLogger(__name__)

#: Phases timed by :class:`hyflow.monitor.PhaseTimers` (``timing_s/<phase>`` keys, verl's names).
PHASE_KEYS = ("gen", "reshard", "reward", "old_log_prob", "ref", "values", "adv", "update_actor", "update_critic")
#: Keys every RL step row should carry; missing ones are warned about once.
REQUIRED_KEYS = ("step", "critic/score/mean", "actor/pg_clipfrac", "actor/entropy",
                 "actor/grad_norm", "response_length/mean", "perf/throughput") + tuple(
                     f"timing_s/{p}" for p in ("gen", "reshard", "reward", "update_actor"))


def to_float(value: Any) -> Optional[float]:
    """A float from a number / numpy scalar / 0-d tensor; ``None`` for NaN and infinities."""
    if hasattr(value, "item"):
        value = value.item()
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: str) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file (a directory means its ``metrics.jsonl``)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


class MetricsWriter:
    """Writes one row per step to ``<output_dir>/metrics.jsonl`` and, optionally, TensorBoard.

    Only the rank that logs (rank 0) should build one. ``required_keys`` are checked on every
    row and a warning names the missing ones the first time each goes missing.
    """

    def __init__(self, output_dir: str, tensorboard: bool = True, resume_step: Optional[int] = None,
                 required_keys: Sequence[str] = REQUIRED_KEYS, filename: str = "metrics.jsonl",
                 loggers: Optional[Sequence[str]] = None, config_text: Optional[str] = None,
                 project: str = "hyflow", experiment: Optional[str] = None) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, filename)
        self.required_keys = tuple(required_keys)
        self.bad_values = 0
        self.last_step: Optional[int] = None
        self._warned_missing: set[str] = set()
        self._prepare_file(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if loggers is None:
            loggers = ["tensorboard"] if tensorboard else []
        self.trackers = open_trackers(loggers, output_dir, resume_step, config_text, project, experiment)

    @classmethod
    def from_config(cls, trainer: Any, resume_step: Optional[int] = None) -> "MetricsWriter":
        """From a ``TrainerConfig`` (``output_dir``, ``loggers``, ``project_name``,
        ``experiment_name``); the trackers get ``<output_dir>/config.resolved.yaml`` when the
        job wrote it."""
        path = os.path.join(trainer.output_dir, "config.resolved.yaml")
        config_text = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                config_text = f.read()
        loggers = getattr(trainer, "loggers", None)
        return cls(trainer.output_dir, resume_step=resume_step, tensorboard=getattr(trainer, "tensorboard", True),
                   loggers=loggers, config_text=config_text, project=getattr(trainer, "project_name", "hyflow"),
                   experiment=getattr(trainer, "experiment_name", None))

    def _prepare_file(self, resume_step: Optional[int]) -> None:
        if not os.path.exists(self.path):
            return
        if resume_step is None:  # a fresh run: the earlier run's rows are kept under another name
            if os.path.getsize(self.path):
                stem, ext = os.path.splitext(self.path)
                stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(self.path)))
                target, n = f"{stem}.{stamp}{ext}", 1
                while os.path.exists(target):
                    n += 1
                    target = f"{stem}.{stamp}-{n}{ext}"
                os.rename(self.path, target)
                _LOG.warning("%s held an earlier run's metrics: moved to %s", self.path, target)
            return
        rows: dict[int, str] = {}
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn line from a crash
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= resume_step:
                    rows[row["step"]] = line if line.endswith("\n") else line + "\n"  # the last one wins
        kept = [rows[step] for step in sorted(rows)]
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)  # never a moment without the rows
        if kept:
            self.last_step = max(rows)

    @property
    def tensorboard_enabled(self) -> bool:
        return any(isinstance(t, TensorBoardTracker) for t in self.trackers)

    def log(self, step: int, metrics: Mapping[str, Any], check_required: bool = True) -> dict:
        """Write the row for ``step`` (``step`` first, then the metrics in order); returns it.
        ``check_required=False``: a row of other metrics (validation before training, step 0)."""
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"metrics step {step} is not after the last logged step {self.last_step}")
        row: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            if key == "step":
                continue
            if isinstance(value, str) or value is None:
                row[key] = value
                continue
            try:
                row[key] = to_float(value)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"metric {key!r} = {value!r} is not a number") from exc
            if row[key] is None:
                self.bad_values += 1
        missing = [k for k in self.required_keys if check_required and k not in row and k not in self._warned_missing]
        if missing:
            self._warned_missing.update(missing)
            _LOG.warning("metrics row for step %d lacks %s", step, ", ".join(missing))
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, float)}
        for tracker in self.trackers:
            tracker.log(step, numbers)
        self.last_step = step
        return row

    def close(self) -> None:
        """Flush and close the jsonl file and the trackers (idempotent)."""
        if not self._file.closed:
            self._file.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
