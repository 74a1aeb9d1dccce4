"""A progress display that works both in a terminal and in CI logs.

On a TTY a tqdm bar is redrawn in place (a terminal that reports 0 columns gets lines instead); while it is up, ``print`` output and log records go
through ``tqdm.write``, so every later message starts on a line of its own and the bar is
redrawn below it, and :meth:`Progress.close` ends the bar's line. Elsewhere (CI, files, pipes)
or without tqdm, a full line is printed every ``every`` steps, on the first step and on the
last, so logs stay short and readable. Each line shows step / total, the chosen metrics,
the step's communication (:mod:`hyflow.monitor.comm`), the rate and the ETA::

    [hyflow] step  40/100 ( 40%) | reward 0.613 | kl 0.0021 | comm 0.41s 24.6MB | 1.52 s/step | eta 1m31s
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence, TextIO

__all__ = ["Progress", "format_duration", "DEFAULT_SHOWN"]

#: (metric key, label) pairs shown by default.
DEFAULT_SHOWN: tuple[tuple[str, str], ...] = (("critic/score/mean", "reward"), ("actor/reward_kl_penalty", "kl"),
                                               ("actor/kl_loss", "kl_loss"),
                                               ("response_length/mean", "len"))


def _columns(stream: Any) -> Optional[int]:
    """The width the terminal behind ``stream`` reports (0 on some CI and IDE consoles, where a bar
    would draw nothing), or None when it cannot tell."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


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


def _format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.3g}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1000
    return f"{n:.3g}GB"  # pragma: no cover


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
        if self.tty and tty is None and _columns(self.stream) == 0:  # a terminal that reports no width: lines
            self.tty = False
        self.enabled, self.width, self.clock = enabled, width, clock
        self.initial = self.step = int(initial)
        self._start = clock()
        self._bar: Any = None
        self._redirect: Optional[contextlib.ExitStack] = None
        self.last_line = ""
        if self.tty:
            try:
                import tqdm  # noqa: F401 - the logging extra; without it: plain lines
            except ImportError:
                self.tty = False

    @classmethod
    def from_config(cls, trainer: Any, initial: int = 0, **kwargs: Any) -> "Progress":
        """From a ``TrainerConfig``: ``total_steps`` steps, a CI line every ``log_every``; off
        unless ``console`` is among ``trainer.loggers``."""
        kwargs["enabled"] = kwargs.get("enabled", True) and "console" in getattr(trainer, "loggers", ["console"])
        return cls(total=trainer.total_steps, initial=initial, every=trainer.log_every, **kwargs)

    def rate(self) -> float:
        """Seconds per step since the display started (NaN before the first step)."""
        done = self.step - self.initial
        return (self.clock() - self._start) / done if done > 0 else math.nan

    def _metric_parts(self, metrics: Optional[Mapping[str, Any]]) -> list[str]:
        parts = []
        for key, label in self.shown:
            if metrics is not None and key in metrics:
                parts.append(f"{label} {_format_value(metrics[key])}")
        if metrics is not None and metrics.get("comm/seconds") is not None:
            parts.append(f"comm {float(metrics['comm/seconds']):.3g}s "
                         f"{_format_bytes(float(metrics.get('comm/bytes') or 0))}")
        return parts

    def format_line(self, metrics: Optional[Mapping[str, Any]] = None) -> str:
        """The status line for the current step (the CI / log form)."""
        width = len(str(self.total))
        pct = 100.0 * self.step / self.total if self.total else 100.0
        parts = [f"{self.desc} step {self.step:{width}d}/{self.total} ({pct:3.0f}%)"]
        parts += self._metric_parts(metrics)
        rate = self.rate()
        if math.isfinite(rate) and rate > 0:
            parts.append(f"{rate:.3g} s/step" if rate >= 1 else f"{1 / rate:.3g} step/s")
            parts.append(f"eta {format_duration(rate * max(self.total - self.step, 0))}")
        return " | ".join(parts)

    def _open_bar(self) -> None:
        # optional dependency: tqdm (the logging extra)
        from tqdm import tqdm
        from tqdm.contrib import DummyTqdmFile
        from tqdm.contrib.logging import logging_redirect_tqdm

        # the metrics go in tqdm's "desc" field, placed after the bar
        self._bar = tqdm(total=self.total, initial=self.initial, file=self.stream, dynamic_ncols=True,
                         unit="step", leave=True,
                         bar_format=self.desc + " step {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar:" + str(self.width)
                         + "}| {desc} [{elapsed}<{remaining}, {rate_fmt}]")
        stack = contextlib.ExitStack()
        # print() and log records while the bar is up: cleared bar, the message, the bar again
        stack.enter_context(contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)))
        stack.enter_context(contextlib.redirect_stderr(DummyTqdmFile(sys.stderr)))
        stack.enter_context(logging_redirect_tqdm([logging.getLogger()]))
        self._redirect = stack

    def update(self, step: int, metrics: Optional[Mapping[str, Any]] = None) -> None:
        """Record that ``step`` finished and show it (subject to the non-TTY ``every``)."""
        previous, self.step = self.step, int(step)
        if not self.enabled:
            return
        if self.tty:
            if self._bar is None:
                self._open_bar()
            self._bar.set_description_str(" | ".join(self._metric_parts(metrics)), refresh=False)
            self._bar.update(self.step - previous)
            self.last_line = str(self._bar)
            return
        first = self.step == self.initial + 1
        if not (first or self.step >= self.total or self.step % self.every == 0):
            return
        self.last_line = self.format_line(metrics)
        self.stream.write(self.last_line + "\n")
        self.stream.flush()

    def write(self, message: str) -> None:
        """Print a message line without garbling the bar."""
        if self._bar is not None:
            self._bar.write(message.rstrip("\n"), file=self.stream)
            return
        self.stream.write(message.rstrip("\n") + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (TTY) so later output starts on a fresh line."""
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
