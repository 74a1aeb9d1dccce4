"""Rank 0's decisions, shared as tensors (no pickling collective: nothing is unpickled, and NCCL
moves plain bytes): a JSON value broadcast as UTF-8 bytes, a flag reduced over the ranks."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def broadcast_json(value: Any, device: Any, src: int = 0, group: Any = None) -> Any:
    """``value`` (JSON-serialisable, read on rank ``src`` only) on every rank: two broadcasts,
    its length and its bytes."""
    data = json.dumps(value).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if int(size.item()):
        dist.broadcast(buf, src=src, group=group)
    return json.loads(buf.cpu().numpy().tobytes().decode()) if int(size.item()) else None


def any_rank(flag: bool, device: Any, group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on some rank (one scalar all-reduce)."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
