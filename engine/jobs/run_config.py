"""A run directory's config: written when the run trains, never continued silently with another.

:func:`record_config` writes ``config.resolved.yaml`` only when the run has steps to train (a command
that trains nothing leaves the directory's config as it was) and prints what the config changes from
the defaults (the whole of it is in the file).

``trainer.resume=auto`` continues the newest checkpoint in ``trainer.output_dir``. When the command's
config differs from the one that checkpoint was saved with in anything but ``trainer.total_steps``
(raising it is how a finished run is extended), the command refuses before any rank starts, naming
every difference and the two ways out: ``trainer.resume=never`` (start over in that directory) or
another ``trainer.output_dir``. Keys one side does not know (a config written by another hyflow
version) are not differences.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from hyflow.checkpoint.discovery import CONFIG_FILE, checkpoints_root, latest_checkpoint
from hyflow.config import ConfigError, dump_yaml, format_changes
from hyflow.config.core import to_dict, yaml_load

#: keys a resumed run may change: its step budget, and how it watches itself (checkpoint verification,
#: the stall watchdog, the reward function's time limits and worker count)
MAY_CHANGE = ("trainer.total_steps", "trainer.verify_checkpoints", "trainer.watchdog_s", "reward.timeout_s",
              "reward.batch_timeout_s", "reward.workers")
_SHOWN = 8


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def config_differences(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for every key both configs have with different values."""
    a, b = _flat(saved), _flat(current)
    return [f"{key}: {a[key]!r} -> {b[key]!r}" for key in a
            if key in b and key not in MAY_CHANGE and a[key] != b[key]]


def resumed_config(output_dir: str) -> Optional[tuple[int, str]]:
    """``(step, path of its saved config)`` of the checkpoint ``trainer.resume=auto`` would continue,
    or None when there is none (a fresh run)."""
    root = checkpoints_root(output_dir)
    if not os.path.isdir(root):
        return None
    entry = latest_checkpoint(root, warn=lambda _: None)
    if entry is None:
        return None
    for path in (os.path.join(entry.path, CONFIG_FILE), os.path.join(output_dir, CONFIG_FILE)):
        if os.path.isfile(path):
            return entry.step, path
    return None


def check_run_reuse(cfg: Any) -> None:
    """Refuse to continue the run in ``cfg.trainer.output_dir`` with a config that differs from its
    own (see the module docstring); raises :class:`ConfigError`."""
    if getattr(cfg.trainer, "resume", "auto") != "auto":
        return
    found = resumed_config(cfg.trainer.output_dir)
    if found is None:
        return
    step, path = found
    with open(path, encoding="utf-8") as f:
        saved = yaml_load(f.read()) or {}
    diffs = config_differences(saved, to_dict(cfg))
    if not diffs:
        return
    listed = "; ".join(diffs[:_SHOWN]) + (f"; and {len(diffs) - _SHOWN} more" if len(diffs) > _SHOWN else "")
    raise ConfigError(
        f"trainer.output_dir={cfg.trainer.output_dir} holds a run (checkpoint at step {step}) saved with another "
        f"config, and trainer.resume=auto would continue it with this one: {listed}. Start over in it with "
        "trainer.resume=never, or give this run its own trainer.output_dir", key="trainer.output_dir")


def record_config(cfg: Any, start: int) -> None:
    """Rank 0 of a run resumed at step ``start`` (0: fresh): ``config.resolved.yaml`` when it trains,
    and on stdout what the config changes from the defaults."""
    path = os.path.join(cfg.trainer.output_dir, CONFIG_FILE)
    os.makedirs(cfg.trainer.output_dir, exist_ok=True)
    if start < cfg.trainer.total_steps:
        dump_yaml(cfg, path)
    print(f"[hyflow] config (what differs from the defaults; all of it in {path}):\n{format_changes(cfg)}",
          end="", flush=True)
