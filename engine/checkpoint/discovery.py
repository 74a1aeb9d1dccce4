"""Finding a run's step checkpoints: which are complete, which to resume from, which to prune,
and setting damaged ones aside (renamed, never deleted).

Layout under ``<trainer.output_dir>/checkpoints``::

    step_000006/                  one step checkpoint (see :mod:`hyflow.checkpoint.checkpointer`)
        ...
        manifest.json             size and checksum of every file above
        COMPLETE                  written last: only a directory holding it counts
    step_000003.corrupt-checksum/ a checkpoint that failed verification, set aside
    reference/                    frozen weights the config cannot rebuild (saved once per run)
    latest                        name of the newest complete checkpoint; moved after COMPLETE
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Optional

from hyflow.checkpoint.errors import CheckpointError

LOG = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MARKER_FILE = "COMPLETE"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.resolved.yaml"
CORRUPT_SUFFIX = ".corrupt-"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``step_000042``: zero-padded so the names sort by step."""
    return f"step_{step:06d}"


def checkpoints_root(output_dir: str) -> str:
    """Where a run keeps its checkpoints."""
    return os.path.join(output_dir, CHECKPOINTS_DIR)


def is_step_dir(path: str) -> bool:
    """Whether ``path`` is named like a step checkpoint (``step_000042``)."""
    return bool(_STEP_DIR.match(os.path.basename(os.path.normpath(path))))


@dataclass
class CheckpointEntry:
    """One ``step_*`` directory: its step, path, and whether its save finished."""

    step: int
    path: str
    complete: bool
    problem: str = ""


def checkpoint_status(path: str) -> tuple[bool, str]:
    """(complete, why not): a checkpoint is complete when its marker names its step."""
    marker = os.path.join(path, MARKER_FILE)
    if not os.path.exists(marker):
        return False, f"no {MARKER_FILE} marker (its save was interrupted)"
    try:
        with open(marker) as f:
            data = json.load(f)
        int(data["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"its {MARKER_FILE} marker is unreadable ({type(e).__name__})"
    if not os.path.exists(os.path.join(path, STATE_FILE)):
        return False, f"{STATE_FILE} is missing"
    return True, ""


def list_checkpoints(root: str) -> list[CheckpointEntry]:
    """The ``step_*`` directories under ``root``, oldest first (none when it does not exist)."""
    if not os.path.isdir(root):
        return []
    entries = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path):
            complete, problem = checkpoint_status(path)
            entries.append(CheckpointEntry(int(match.group(1)), path, complete, problem))
    return sorted(entries, key=lambda e: e.step)


def complete_checkpoints(root: str, warn: Callable[[str], None] = LOG.warning) -> list[CheckpointEntry]:
    """Complete checkpoints under ``root``, newest first; ``warn`` names each incomplete one
    newer than the newest complete one (an interrupted save)."""
    out: list[CheckpointEntry] = []
    for entry in reversed(list_checkpoints(root)):
        if entry.complete:
            out.append(entry)
        elif not out:
            warn(f"skipping incomplete checkpoint {entry.path}: {entry.problem}")
    return out


def latest_checkpoint(root: str, warn: Callable[[str], None] = LOG.warning) -> Optional[CheckpointEntry]:
    """The newest complete checkpoint under ``root``; ``warn`` names each newer incomplete one."""
    entries = complete_checkpoints(root, warn)
    return entries[0] if entries else None


def resolve_checkpoint(path: str, warn: Callable[[str], None] = LOG.warning) -> str:
    """A complete step checkpoint from ``path``: a step directory, a checkpoints root, or a run
    directory (its newest complete checkpoint). Raises :class:`CheckpointError` otherwise."""
    candidates, _ = checkpoint_candidates(path, warn)
    return candidates[0]


def checkpoint_candidates(path: str, warn: Callable[[str], None] = LOG.warning) -> tuple[list[str], bool]:
    """The complete step checkpoints ``path`` can mean, newest first, and whether ``path``
    named one exactly (a step directory: no other may replace it). Raises
    :class:`CheckpointError` when there is none."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if is_step_dir(path):
        complete, problem = checkpoint_status(path)
        if not complete:
            raise CheckpointError(f"checkpoint {path} is incomplete: {problem}")
        return [path], True
    for root in (path, checkpoints_root(path)):
        entries = complete_checkpoints(root, warn)
        if entries:
            return [e.path for e in entries], False
    raise CheckpointError(f"no complete checkpoint in {path} (looked for {CHECKPOINTS_DIR}/step_*/{MARKER_FILE})")


def resume_candidates(resume: str, output_dir: str,
                      warn: Callable[[str], None] = LOG.warning) -> tuple[list[str], bool]:
    """``trainer.resume`` as (checkpoints to try, newest first; whether only the first may be
    used): ``never`` -> none; ``auto`` -> the complete checkpoints of ``output_dir`` (none for a
    fresh run); anything else a checkpoint path that must exist (see :func:`checkpoint_candidates`)."""
    if resume == "never":
        return [], True
    if resume == "auto":
        root = checkpoints_root(output_dir)
        found = [e.path for e in complete_checkpoints(root, warn)]
        aside = set_aside_checkpoints(root)
        if not found and aside:  # a run that would silently start over beside its damaged checkpoints
            raise CheckpointError(
                f"{output_dir} holds no usable checkpoint, only set-aside ones ({', '.join(aside)} in {root}): "
                "to start this run over there, set trainer.resume=never; to continue, repair one and rename "
                "it back to step_<N>, or name it with trainer.resume=<path> and --no-verify")
        return found, False
    return checkpoint_candidates(resume, warn)


def set_aside_checkpoints(root: str) -> list[str]:
    """Names of the checkpoints under ``root`` that :func:`set_aside` renamed, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root) if CORRUPT_SUFFIX in name and _STEP_DIR.match(
        name.split(CORRUPT_SUFFIX)[0]))


def resume_path(resume: str, output_dir: str, warn: Callable[[str], None] = LOG.warning) -> Optional[str]:
    """``trainer.resume``: ``never`` -> None; ``auto`` -> the newest complete checkpoint of
    ``output_dir`` (None for a fresh run); anything else is a checkpoint path that must exist.
    (No verification: :meth:`hyflow.checkpoint.checkpointer.Checkpointer.find_resume` verifies
    and falls back.)"""
    candidates, _ = resume_candidates(resume, output_dir, warn)
    return candidates[0] if candidates else None


def set_aside(path: str, reason: str) -> str:
    """Rename a damaged checkpoint to ``<path>.corrupt-<reason>`` (never delete it: the user
    may want to inspect or repair it); discovery and pruning ignore the new name. Returns it."""
    base = f"{os.path.normpath(path)}{CORRUPT_SUFFIX}{re.sub(r'[^A-Za-z0-9_-]', '-', reason) or 'damaged'}"
    target, n = base, 1
    while os.path.exists(target):
        n += 1
        target = f"{base}-{n}"
    os.rename(path, target)
    return target


def prune_checkpoints(root: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and incomplete ones older
    than the newest complete one. Returns the removed paths. (Damaged checkpoints set aside by
    :func:`set_aside` are not ``step_*`` directories any more and are never removed.)"""
    entries = list_checkpoints(root)
    complete = [e for e in entries if e.complete]
    if not complete:
        return []
    keep = {e.path for e in complete[-keep_last:]}
    newest = complete[-1].step
    removed = [e.path for e in entries if e.path not in keep and (e.complete or e.step < newest)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def model_checkpoint_dir(path: str, role: str = "actor", warn: Callable[[str], None] = LOG.warning) -> str:
    """The model checkpoint directory ``path`` points at: ``path`` itself when it is one (it
    holds ``hyflow_checkpoint.json``), else ``role``'s model in the step checkpoint that ``path``
    names (a step directory, a checkpoints directory or a run directory: its newest complete
    checkpoint; ``warn`` names skipped incomplete ones). Raises :class:`CheckpointError`."""
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from hyflow.checkpoint.model import CHECKPOINT_INFO_FILE

    if os.path.exists(os.path.join(path, CHECKPOINT_INFO_FILE)):
        return path
    step_dir = resolve_checkpoint(path, warn)
    model_dir = os.path.join(step_dir, role)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint {step_dir} has no {role} model")
    return model_dir
