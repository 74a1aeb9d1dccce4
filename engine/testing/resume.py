"""Helpers for tests that kill and resume runs: a process tree, a checkpoint's tensors."""

from __future__ import annotations

import os


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


def checkpoint_tensors(model_dir: str, tmp: str) -> dict:
    """The tensors of a torch.distributed.checkpoint directory (a test's own checkpoint, so its
    non-tensor entries may be unpickled), by name."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tmp, "weights.pt")
    dcp_to_torch_save(model_dir, out)
    state = torch.load(out, weights_only=False)
    os.remove(out)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
