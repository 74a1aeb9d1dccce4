"""The end-of-run PNG: reward and KL curves over steps, one panel per metric.

Uses matplotlib when it is installed; otherwise (or with ``backend="builtin"``) a small
pure-Python renderer (:mod:`hyflow.monitor._png`) writes the PNG, so the file always exists.
Rows whose value is missing or ``null`` leave a gap in the curve. Per-step RL rewards are noisy
(a handful of prompts per step), so with 20 or more points each curve is drawn faint and a
trailing mean over ``smooth`` steps is drawn over it in full colour.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Sequence, Union

from hyflow.monitor._png import Canvas, Color
from hyflow.monitor.metrics import read_metrics

__all__ = ["plot_metrics", "trailing_mean", "auto_smooth_window", "DEFAULT_PLOT_KEYS", "PLOT_FILENAME"]

_LOG = logging.getLogger(__name__)
DEFAULT_PLOT_KEYS = ("critic/score/mean", "actor/reward_kl_penalty")
PLOT_FILENAME = "reward_kl.png"
_COLORS: tuple[Color, ...] = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189))


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, Optional[float]]]:
    out = []
    for i, row in enumerate(rows):
        step = row.get("step", i + 1)
        value = row.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        out.append((float(step), float(value) if ok else None))
    return out


def trailing_mean(points: Sequence[tuple[float, Optional[float]]], window: int
                  ) -> list[tuple[float, Optional[float]]]:
    """Mean of the values present among each point and the ``window - 1`` points before it;
    a missing value stays a gap."""
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {window}")
    out = []
    for i, (x, y) in enumerate(points):
        recent = [v for _, v in points[max(0, i - window + 1):i + 1] if v is not None]
        out.append((x, None if y is None else sum(recent) / len(recent)))
    return out


def auto_smooth_window(num_points: int) -> int:
    """1 (no smoothing) below 20 points, else 5, growing to 1/20 of the run for long runs."""
    return 1 if num_points < 20 else max(5, num_points // 20)


def _tint(color: Color, amount: float = 0.65) -> Color:
    return tuple(round(c + (255 - c) * amount) for c in color)  # type: ignore[return-value]


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def _plot_builtin(series: dict[str, list], out_path: str, title: str, window: int = 1,
                  width: int = 800, height: int = 300) -> None:
    panels = max(1, len(series))
    canvas = Canvas(width, height * panels + 30)
    canvas.text(10, 8, title, (0, 0, 0), scale=2)
    left, right, top, bottom = 80, 20, 30, 30
    for p, (key, points) in enumerate(series.items()):
        y0 = 30 + p * height
        box = (left, y0 + top, width - right, y0 + height - bottom)
        canvas.rect(*box, (120, 120, 120))
        label = key if window == 1 else f"{key}: mean of last {window} steps (faint: per step)"
        canvas.text(left, y0 + 10, label, _COLORS[p % len(_COLORS)], scale=2)
        vals = [v for _, v in points if v is not None]
        if not vals:
            canvas.text(left + 10, y0 + top + 10, "NO DATA", (150, 150, 150), scale=2)
            continue
        xs = [s for s, _ in points]
        xmin, xmax = min(xs), max(xs)
        ymin, ymax = min(vals), max(vals)
        if ymax == ymin:
            pad = abs(ymax) * 0.1 or 0.5
            ymin, ymax = ymin - pad, ymax + pad
        if xmax == xmin:
            xmin, xmax = xmin - 1, xmax + 1
        bx0, by0, bx1, by1 = box
        ymid = (box[1] + box[3]) // 2
        for gy in (ymid,):
            for gx in range(bx0 + 1, bx1, 4):
                canvas.set(gx, gy, (210, 210, 210))

        def to_px(x: float, y: float) -> tuple[int, int]:
            px = bx0 + 4 + round((x - xmin) / (xmax - xmin) * (bx1 - bx0 - 8))
            py = by1 - 4 - round((y - ymin) / (ymax - ymin) * (by1 - by0 - 8))
            return px, py

        for label, yy in ((_fmt(ymax), by0), (_fmt((ymin + ymax) / 2), ymid - 5), (_fmt(ymin), by1 - 10)):
            canvas.text(bx0 - 6 - Canvas.text_width(label), yy, label, (60, 60, 60))
        canvas.text(bx0, by1 + 8, _fmt(xmin), (60, 60, 60))
        last = f"STEP {_fmt(xmax)}"
        canvas.text(bx1 - Canvas.text_width(last), by1 + 8, last, (60, 60, 60))
        color = _COLORS[p % len(_COLORS)]
        curves = [(points, color)] if window == 1 else \
            [(points, _tint(color)), (trailing_mean(points, window), color)]
        for curve, curve_color in curves:
            run: list[tuple[int, int]] = []
            for x, y in curve + [(0.0, None)]:
                if y is None:
                    canvas.polyline(run, curve_color, thickness=2)
                    run = []
                else:
                    run.append(to_px(x, y))
    with open(out_path, "wb") as f:
        f.write(canvas.to_png())


def _plot_matplotlib(series: dict[str, list], out_path: str, title: str, window: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.6 * len(series)), sharex=True, squeeze=False)
    for p, (key, points) in enumerate(series.items()):
        ax = axes[p][0]
        xs = [x for x, _ in points]
        ys = [float("nan") if y is None else y for _, y in points]
        color = tuple(c / 255 for c in _COLORS[p % len(_COLORS)])
        if window == 1:
            ax.plot(xs, ys, color=color, marker="o" if len(xs) < 30 else None, markersize=3)
        else:
            ax.plot(xs, ys, color=color, alpha=0.35, label="per step")
            smooth = [float("nan") if y is None else y for _, y in trailing_mean(points, window)]
            ax.plot(xs, smooth, color=color, label=f"trailing mean of {window}")
            ax.legend(loc="best", fontsize="small")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if all(y is None for _, y in points):
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="gray")
    axes[-1][0].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def plot_metrics(source: Union[str, Sequence[Mapping[str, Any]]], out_path: Optional[str] = None,
                 keys: Sequence[str] = DEFAULT_PLOT_KEYS, title: str = "hyflow run",
                 backend: str = "auto", smooth: Optional[int] = None) -> str:
    """Write a PNG of ``keys`` against ``step``; returns its path.

    ``source`` is a list of metric rows, a ``metrics.jsonl`` path or a run directory;
    ``out_path`` defaults to ``reward_kl.png`` next to the metrics. ``backend``: ``auto``
    (matplotlib when importable), ``matplotlib`` or ``builtin``. ``smooth``: trailing-mean
    window in steps (1 draws the raw curve only; ``None`` picks :func:`auto_smooth_window`).
    """
    if isinstance(source, str):
        base = source if os.path.isdir(source) else os.path.dirname(source)
        rows = read_metrics(source)
        out_path = out_path or os.path.join(base, PLOT_FILENAME)
    else:
        rows = list(source)
        if out_path is None:
            raise ValueError("plot_metrics: out_path is required when rows are given")
    if backend not in ("auto", "matplotlib", "builtin"):
        raise ValueError(f"unknown plot backend {backend!r}")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    series = {key: _series(rows, key) for key in keys}
    window = auto_smooth_window(len(rows)) if smooth is None else int(smooth)
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {smooth}")
    if backend in ("auto", "matplotlib"):
        try:
            _plot_matplotlib(series, out_path, title, window)
            return out_path
        except ImportError:
            if backend == "matplotlib":
                raise
            _LOG.info("matplotlib not installed; drawing %s with the built-in PNG writer", out_path)
    _plot_builtin(series, out_path, title, window)
    return out_path
