"""A rank that makes no progress says so, naming where it is.

A rank stopped by SIGSTOP, a hung NFS read or a user function that never returns leaves the other
ranks waiting in a collective with nothing on the console. Code marks its progress with
:func:`beat` (each phase of a step, the end of a step, checkpoint saves and loads: a few calls per
step); a :class:`Watchdog` thread per rank prints one line to stderr when no beat came for
``trainer.watchdog_s`` seconds, naming the phase the rank is in (for a rank waiting on a stuck
peer: the phase whose collective it waits in), and again at twice, four times ... that long. It
only reports; stopping is the supervisor's and the launcher's business.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional, TextIO

_active: Optional["Watchdog"] = None


def beat(phase: str) -> None:
    """Progress: this rank entered ``phase`` (no-op without a running watchdog)."""
    if _active is not None:
        _active.beat(phase)


class Watchdog:
    """Reports stalls of this rank (see the module docstring); :meth:`start` / :meth:`stop`."""

    def __init__(self, timeout_s: float, rank: int, out: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.rank, self.clock = float(timeout_s), rank, clock
        self.out = out
        self.phase, self.since = "start-up", clock()
        self.reports = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def beat(self, phase: str) -> None:
        self.phase, self.since, self.reports = phase, self.clock(), 0

    def check(self) -> Optional[str]:
        """The report due now, if any (the thread calls this; tests call it directly)."""
        idle = self.clock() - self.since
        if idle < self.timeout_s * (2 ** self.reports):
            return None
        self.reports += 1
        return (f"[hyflow] rank {self.rank}: no progress for {idle / 60:.1f} min in {self.phase} (a stopped or hung "
                "rank, a hung file system or user code; ranks waiting on it report the phase they wait in)")

    def _run(self) -> None:
        while not self._stop.wait(min(30.0, max(self.timeout_s / 4, 0.05))):
            line = self.check()
            if line:
                try:
                    print(line, file=self.out or sys.stderr, flush=True)
                except (OSError, ValueError):
                    pass

    def start(self) -> "Watchdog":
        global _active
        _active = self
        self._thread = threading.Thread(target=self._run, name="hyflow-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None
        self._stop.set()
