"""A progress display that works both in a terminal and in CI logs.

On a TTY one line is redrawn in place (``\\r``) with a bar; elsewhere (CI, files, pipes) a
full line is printed every ``every`` steps, on the first step and on the last, so logs stay
short and readable. Each line shows step / total, the rate, the ETA and chosen metrics::

    [hyflow] step  40/100 ( 40%) | reward 0.613 | kl 0.0021 | 1.52 s/step | eta 1m31s
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence, TextIO

__all__ = ["Progress", "format_duration", "DEFAULT_SHOWN"]

#: (metric key, label) pairs shown by default.
DEFAULT_SHOWN: tuple[tuple[str, str], ...] = (("critic/score/mean", "reward"), ("actor/reward_kl_penalty", "kl"),
                                               ("response_length/mean", "len"))


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``?`` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _format_value(value: Any) -> str:
    if value is None:
        return "nan"
    value = float(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.4g}"


class Progress:
    """Step progress with ETA; ``update(step, metrics)`` after each step, ``close()`` at the end."""

    def __init__(self, total: int, initial: int = 0, every: int = 1, desc: str = "[hyflow]",
                 shown: Sequence[tuple[str, str]] = DEFAULT_SHOWN, stream: Optional[TextIO] = None,
                 tty: Optional[bool] = None, enabled: bool = True, width: int = 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.every, self.desc = int(total), max(1, int(every)), desc
        self.shown = list(shown)
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty()) if tty is None and callable(isatty) else bool(tty)
        self.enabled, self.width, self.clock = enabled, width, clock
        self.initial = self.step = int(initial)
        self._start = clock()
        self._drawn = False
        self.last_line = ""

    @classmethod
    def from_config(cls, trainer: Any, initial: int = 0, **kwargs: Any) -> "Progress":
        """From a ``TrainerConfig``: ``total_steps`` steps, a CI line every ``log_every``."""
        return cls(total=trainer.total_steps, initial=initial, every=trainer.log_every, **kwargs)

    def rate(self) -> float:
        """Seconds per step since the display started (NaN before the first step)."""
        done = self.step - self.initial
        return (self.clock() - self._start) / done if done > 0 else math.nan

    def format_line(self, metrics: Optional[Mapping[str, Any]] = None) -> str:
        """The status text for the current step."""
        width = len(str(self.total))
        pct = 100.0 * self.step / self.total if self.total else 100.0
        parts = [f"{self.desc} step {self.step:{width}d}/{self.total} ({pct:3.0f}%)"]
        if self.tty:
            filled = int(self.width * min(self.step, self.total) / max(self.total, 1))
            parts[0] += " [" + "#" * filled + "." * (self.width - filled) + "]"
        for key, label in self.shown:
            if metrics is not None and key in metrics:
                parts.append(f"{label} {_format_value(metrics[key])}")
        rate = self.rate()
        if math.isfinite(rate) and rate > 0:
            parts.append(f"{rate:.3g} s/step" if rate >= 1 else f"{1 / rate:.3g} step/s")
            parts.append(f"eta {format_duration(rate * max(self.total - self.step, 0))}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Optional[Mapping[str, Any]] = None) -> None:
        """Record that ``step`` finished and show it (subject to the non-TTY ``every``)."""
        self.step = int(step)
        if not self.enabled:
            return
        first = self.step == self.initial + 1
        if not self.tty and not (first or self.step >= self.total or self.step % self.every == 0):
            return
        self.last_line = self.format_line(metrics)
        if self.tty:
            self.stream.write("\r\033[K" + self.last_line)
            self._drawn = True
        else:
            self.stream.write(self.last_line + "\n")
        self.stream.flush()

    def write(self, message: str) -> None:
        """Print a message line without garbling the in-place bar."""
        if self.tty and self._drawn:
            self.stream.write("\r\033[K")
        self.stream.write(message.rstrip("\n") + "\n")
        if self.tty and self._drawn and self.last_line:
            self.stream.write(self.last_line)
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line (TTY) so later output starts on a fresh line."""
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
