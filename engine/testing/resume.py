"""Helpers for tests that kill and resume runs: a process tree, a run killed once it saved, a
checkpoint's tensors."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable, Sequence

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def process_descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_9_when(args: Sequence[str], ready: Callable[[], bool], log_path: str, timeout: float) -> None:
    """Start ``args`` (a ``hyflow train`` command line), wait until ``ready()`` (e.g. a checkpoint is
    complete), then SIGKILL the launcher and every process below it. The output goes to
    ``log_path``; the run ending or ``timeout`` seconds passing first fails with its log's tail."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + timeout
            while not ready():
                assert proc.poll() is None, open(log_path).read()[-3000:]
                assert time.time() < deadline, f"not ready after {timeout:g} s: {open(log_path).read()[-3000:]}"
                time.sleep(0.02)
        finally:
            pids = [proc.pid] + process_descendants(proc.pid)
            for pid in pids:  # kill -9, launcher and every rank
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            _wait_gone(pids, timeout=60.0)  # a rank still exiting holds the run directory's lock


def _wait_gone(pids: Sequence[int], timeout: float) -> None:
    """Wait until every process of ``pids`` has exited (gone, or a zombie: its files are closed)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return
        time.sleep(0.05)


def checkpoint_tensors(model_dir: str, tmp: str) -> dict:
    """The tensors of a torch.distributed.checkpoint directory (a test's own checkpoint, so its
    non-tensor entries may be unpickled), by name."""
    out = os.path.join(tmp, "weights.pt")
    dcp_to_torch_save(model_dir, out)
    state = torch.load(out, weights_only=False)
    os.remove(out)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
