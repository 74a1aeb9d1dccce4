"""Peak memory of the ranks, for the step's metrics.

``memory_summary(device)`` returns the largest peak over all ranks (one all-reduce of three
numbers over the default group):

* ``perf/max_memory_allocated_gb`` / ``perf/max_memory_reserved_gb``: the CUDA caching
  allocator's peaks since the start (``torch.cuda.max_memory_allocated`` / ``_reserved``); 0 on
  CPU ranks;
* ``perf/max_rss_gb``: the process's peak resident set (``getrusage`` ``ru_maxrss``): the
  memory a CPU rank needs, and the host side of a GPU rank.

GB = 2**30 bytes, as in verl's ``perf/max_memory_allocated_gb``.
"""
from __future__ import annotations

import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["memory_summary", "peak_rss_bytes"]

GIB = float(1 << 30)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def memory_summary(device: Any, group: Any = None) -> dict[str, float]:
    """Peak memory, maximum over the ranks of ``group`` (default: all); collective."""
    device = torch.device(device)
    alloc = reserved = 0.0
    if device.type == "cuda":
        alloc = float(torch.cuda.max_memory_allocated(device))
        reserved = float(torch.cuda.max_memory_reserved(device))
    values = torch.tensor([alloc, reserved, float(peak_rss_bytes())], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    alloc, reserved, rss = (v / GIB for v in values.tolist())
    return {"perf/max_memory_allocated_gb": alloc, "perf/max_memory_reserved_gb": reserved,
            "perf/max_rss_gb": rss}
