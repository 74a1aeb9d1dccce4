"""Per-phase wall-clock timers for the RL step (gen, reshard, reward, old_log_prob, ref, values, ...).

    timers = PhaseTimers(sync=torch.cuda.synchronize if torch.cuda.is_available() else None)
    with timers.phase("generate"):
        ...
    metrics.update(timers.step_summary())   # {"timing_s/gen": 1.2, ..., "timing_s/step": 3.4}

A phase entered several times in one step accumulates. ``sync`` (e.g. a CUDA synchronize) runs
at each phase boundary so asynchronous device work is charged to the right phase. Each phase also
records this process's CPU seconds (all its threads), ``cpu_s/<phase>``: on a shared CPU machine
the work a phase did, whatever else ran (what ``hyflow bench rl`` turns into a CPU-time MFU).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

from hyflow.monitor import watchdog
from hyflow.monitor.metrics import PHASE_KEYS

__all__ = ["PhaseTimers"]


class PhaseTimers:
    """Accumulates seconds per phase within a step and over the whole run."""

    def __init__(self, phases: Sequence[str] = PHASE_KEYS, sync: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.phases = list(phases)
        self.sync = sync
        self.clock = clock
        self.step_times: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        self._open: dict[str, float] = {}
        self._cpu_open: dict[str, float] = {}
        self.step_cpu: dict[str, float] = {}
        self._step_start = clock()

    def start(self, name: str) -> None:
        """Start timing ``name`` (an error if it is already running)."""
        if name in self._open:
            raise RuntimeError(f"phase {name!r} is already running")
        watchdog.beat(f"phase {name!r}")
        if self.sync is not None:
            self.sync()
        self._open[name] = self.clock()
        self._cpu_open[name] = time.process_time()

    def stop(self, name: str) -> float:
        """Stop ``name``; returns the seconds of this interval."""
        if name not in self._open:
            raise RuntimeError(f"phase {name!r} was not started")
        if self.sync is not None:
            self.sync()
        watchdog.beat(f"the step, after phase {name!r}")
        seconds = self.clock() - self._open.pop(name)
        cpu = time.process_time() - self._cpu_open.pop(name)
        self.step_cpu[name] = self.step_cpu.get(name, 0.0) + cpu
        self.add(name, seconds)
        return seconds

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` to ``name`` (for time measured elsewhere)."""
        self.step_times[name] = self.step_times.get(name, 0.0) + seconds
        self._totals[name] = self._totals.get(name, 0.0) + seconds

    def totals(self) -> dict[str, float]:
        """Seconds per phase over the timer's whole life (all steps), by phase name."""
        return dict(self._totals)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` (stopped even when the body raises)."""
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def cpu_summary(self) -> dict[str, float]:
        """``cpu_s/<phase>``: this process's CPU seconds in each phase timed this step (call before
        :meth:`step_summary`, which starts the next step)."""
        return {f"cpu_s/{n}": v for n, v in self.step_cpu.items()}

    def step_summary(self, reset: bool = True) -> dict[str, float]:
        """``timing_s/<phase>`` (verl's key names) for every known phase (0.0 when it did not run)
        plus any other phase timed this step, and ``timing_s/step``: wall time since the last reset."""
        if self._open:
            raise RuntimeError(f"phases still running: {', '.join(sorted(self._open))}")
        names = self.phases + [n for n in self.step_times if n not in self.phases]
        out = {f"timing_s/{n}": self.step_times.get(n, 0.0) for n in names}
        now = self.clock()
        out["timing_s/step"] = now - self._step_start
        if reset:
            self.step_times, self.step_cpu = {}, {}
            self._step_start = now
        return out
