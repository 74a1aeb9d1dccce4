"""The end-of-run PNG: reward and KL curves over steps, one panel per metric.

Drawn with matplotlib (installed with the ``logging`` extra, which ``make`` installs); without it
the run still ends normally: one warning line, no PNG (``metrics.jsonl`` holds the data).
Rows whose value is missing or ``null`` leave a gap in the curve. Per-step RL rewards are noisy
(a handful of prompts per step), so with 20 or more points each curve is drawn faint and a
trailing mean over ``smooth`` steps is drawn over it in full colour.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any, Mapping, Optional, Sequence, Union

from hyflow.monitor.metrics import read_metrics

__all__ = ["plot_metrics", "rl_plot_keys", "trailing_mean", "auto_smooth_window", "DEFAULT_PLOT_KEYS", "PLOT_FILENAME"]

_LOG = logging.getLogger(__name__)
DEFAULT_PLOT_KEYS = ("critic/score/mean", "actor/reward_kl_penalty")
PLOT_FILENAME = "reward_kl.png"
_COLORS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189))  # RGB per panel


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


def _draw(series: dict[str, list], out_path: str, title: str, window: int = 1) -> None:
    # optional dependency: matplotlib (the logging extra)
    import matplotlib

    matplotlib.use("Agg", force=False)
    # optional dependency: matplotlib (the logging extra)
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
                 smooth: Optional[int] = None) -> Optional[str]:
    """Write a PNG of ``keys`` against ``step``; returns its path (None, after a warning, when
    matplotlib is not installed).

    ``source`` is a list of metric rows, a ``metrics.jsonl`` path or a run directory;
    ``out_path`` defaults to ``reward_kl.png`` next to the metrics. ``smooth``: trailing-mean
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
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    series = {key: _series(rows, key) for key in keys}
    window = auto_smooth_window(len(rows)) if smooth is None else int(smooth)
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {smooth}")
    if importlib.util.find_spec("matplotlib") is None:
        _LOG.warning("matplotlib is not installed (pip install 'hyflow[logging]'): %s not drawn", out_path)
        return None
    _draw(series, out_path, title, window)
    return out_path


def rl_plot_keys(cfg: Any, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The RL job's panels: the reward, the KL term in use (none without one), the validation score
    (the first data source's core ``mean@N`` of ``rows``)."""
    keys = ["critic/score/mean"]
    if cfg.algorithm.use_kl_in_reward:
        keys.append("actor/reward_kl_penalty")
    elif cfg.actor.use_kl_loss:
        keys.append("actor/kl_loss")
    n = cfg.rollout.val_kwargs.n
    val = sorted({k for row in rows for k in row if k.startswith("val-core/") and k.endswith(f"/mean@{n}")})
    return keys + val[:1]
