"""Run monitoring: metrics (jsonl + optional TensorBoard), phase timers, progress, plots.

* :mod:`.metrics` -- :class:`MetricsWriter` (``metrics.jsonl``, one row per step; resumable);
* :mod:`.timers` -- :class:`PhaseTimers` (``timing_s/<phase>`` per step);
* :mod:`.progress` -- :class:`Progress` (in-place bar on a TTY, periodic lines in CI logs);
* :mod:`.plot` -- :func:`plot_metrics` (PNG of reward and KL, drawn with matplotlib);
* :mod:`.trackers` -- TensorBoard, Weights & Biases, MLflow (``trainer.loggers``);
* :mod:`.comm` -- per-step communication statistics (seconds / bytes per collective and group kind;
  :mod:`.comm_groups` says which kind of traffic each process group carries);
* :mod:`.memory` -- peak memory of the ranks.

Named ``monitor`` rather than ``logging`` so it never shadows the standard library module.
"""
from hyflow.monitor.metrics import PHASE_KEYS, REQUIRED_KEYS, MetricsWriter, read_metrics, to_float
from hyflow.monitor.plot import DEFAULT_PLOT_KEYS, PLOT_FILENAME, auto_smooth_window, plot_metrics, trailing_mean
from hyflow.monitor.progress import DEFAULT_SHOWN, Progress, format_duration
from hyflow.monitor.timers import PhaseTimers

__all__ = [
    "PHASE_KEYS", "REQUIRED_KEYS", "MetricsWriter", "read_metrics", "to_float",
    "DEFAULT_PLOT_KEYS", "PLOT_FILENAME", "plot_metrics", "trailing_mean", "auto_smooth_window",
    "DEFAULT_SHOWN", "Progress", "format_duration", "PhaseTimers",
]
