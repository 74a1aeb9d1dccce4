"""Peak resident memory of a conversion, per process, and the report that sums it.

:class:`PeakMemory` measures one process: the resident set at entry (the
baseline: interpreter, torch, Megatron) and the peak inside the block. On Linux
the kernel's high-water mark (``VmHWM``) is reset at entry through
``/proc/self/clear_refs`` so the peak is exact; where that is not allowed a
sampling thread (5 ms) estimates it.

:class:`MemoryReport` adds the processes of one conversion. ``above_baseline`` (the
sum of every process's peak minus its baseline) bounds the memory the conversion
itself needed at any moment; the tool compares it with the model's size.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import psutil


def _status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    """Resident bytes of this process."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024

    return int(psutil.Process().memory_info().rss)


@dataclass
class ProcessMemory:
    """One process: resident bytes at the start of the work and at its peak."""

    baseline: int = 0
    peak: int = 0
    exact: bool = False

    @property
    def above_baseline(self) -> int:
        return max(self.peak - self.baseline, 0)


class PeakMemory:
    """Context manager measuring this process's peak resident memory inside the block."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.result = ProcessMemory()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sampled = 0

    def _reset_hwm(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status_kib("VmHWM") is not None
        except OSError:
            return False

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sampled = max(self._sampled, current_rss())

    def __enter__(self) -> "PeakMemory":
        self.result.baseline = current_rss()
        self._sampled = self.result.baseline
        self.result.exact = self._reset_hwm()
        if not self.result.exact:
            self._thread = threading.Thread(target=self._sample, daemon=True, name="peak-memory")
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        now = current_rss()
        hwm = _status_kib("VmHWM") if self.result.exact else None
        self.result.peak = max(now, self._sampled, (hwm or 0) * 1024)


@dataclass
class MemoryReport:
    """Memory and time of one conversion.

    Attributes:
        direction: ``hf2mcore`` or ``mcore2hf``.
        model_bytes: parameters in the output dtype (unpadded).
        processes: per-process baseline / peak (ranks in order).
        seconds: wall time of the conversion.
        details: free-form facts (source, layout, dtype...).
        names: what each process is (``launcher``, ``rank 0``...; default ``process i``).
    """

    direction: str
    model_bytes: int
    processes: list[ProcessMemory] = field(default_factory=list)
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)

    @property
    def above_baseline(self) -> int:
        return sum(p.above_baseline for p in self.processes)

    @property
    def ratio(self) -> float:
        """Peak memory the conversion needed, in units of the model size."""
        return self.above_baseline / max(self.model_bytes, 1)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(above_baseline=self.above_baseline, ratio=round(self.ratio, 4))
        return data

    def format(self) -> str:
        """Human-readable multi-line report."""
        mib = 1024 * 1024
        lines = [f"{self.direction}: {self.seconds:.1f}s, model {self.model_bytes / mib:.1f} MiB"]
        lines += [f"  {k}: {v}" for k, v in self.details.items()]
        for i, p in enumerate(self.processes):
            how = "exact" if p.exact else "sampled"
            name = self.names[i] if i < len(self.names) else f"process {i}"
            lines.append(f"  {name}: baseline {p.baseline / mib:.1f} MiB, peak {p.peak / mib:.1f} "
                         f"MiB ({how}), conversion {p.above_baseline / mib:.1f} MiB")
        lines.append(f"  peak memory for the conversion (sum over processes, above baseline): "
                     f"{self.above_baseline / mib:.1f} MiB = {self.ratio:.2f} x model size")
        return "\n".join(lines)


class Stopwatch:
    """``with Stopwatch() as t: ...; t.seconds``."""

    def __enter__(self) -> "Stopwatch":
        self._start = time.monotonic()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.monotonic() - self._start
