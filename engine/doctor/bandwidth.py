"""Collective bandwidth across the launched ranks (all-reduce and all-gather per group).

Bus bandwidth follows the nccl-tests convention, so numbers compare with theirs: with ``n``
ranks and ``S`` bytes (the all-reduce buffer, or the all-gather *output*), ``algbw = S / t``
and ``busbw = algbw * 2(n-1)/n`` for all-reduce, ``algbw * (n-1)/n`` for all-gather, where
``t`` is the slowest rank's time per call. Every group of a kind runs at once (as in
training), and the reported time is the maximum over all ranks.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

MIB = 1 << 20
GPU_MAX_SIZE = 1 << 30
CPU_MAX_SIZE = 64 * MIB
#: Pass/warn thresholds on bus bandwidth (GB/s = 1e9 B/s) at the largest size measured.
THRESHOLDS_GBPS = {"gpu_intra_node": 100.0, "gpu_inter_node": 10.0, "cpu": 0.05}


@dataclass
class Row:
    """One measurement: ``op`` over the groups of ``group`` with ``size`` bytes."""

    op: str
    group: str
    group_size: int
    groups: int
    size: int
    seconds: float
    algbw_gbps: float
    busbw_gbps: float
    status: str = "-"  # pass / warn at the largest size, "-" below it
    threshold_gbps: Optional[float] = None


def default_sizes(on_gpu: bool, max_size: Optional[int] = None, min_size: int = MIB) -> list[int]:
    """1 MiB, 4 MiB, ... up to ``max_size`` (default 1 GiB on GPU, 64 MiB on CPU)."""
    cap = max_size or (GPU_MAX_SIZE if on_gpu else CPU_MAX_SIZE)
    sizes, s = [], min_size
    while s <= cap:
        sizes.append(s)
        s *= 4
    return sizes or [cap]


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def host_of_ranks() -> list[str]:
    """Hostname of every rank (collective)."""
    import torch.distributed as dist

    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return [str(n) for n in names]


def node_groups(hosts: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
    """``(intra-node groups, inter-node groups)``: ranks per host, and the i-th rank of each
    host (only when every host has the same number of ranks)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    intra = list(by_host.values())
    sizes = {len(g) for g in intra}
    inter = [list(col) for col in zip(*intra)] if len(sizes) == 1 else []
    return intra, inter


def _time_op(op: str, group: Any, n: int, size: int, iters: int, warmup: int, device: Any) -> float:
    import torch
    import torch.distributed as dist

    numel = max(size // 4 // n * n, n)
    if op == "all_reduce":
        buf = torch.ones(numel, dtype=torch.float32, device=device)
        call = lambda: dist.all_reduce(buf, group=group)  # noqa: E731
    else:
        out = torch.empty(numel, dtype=torch.float32, device=device)
        inp = torch.ones(numel // n, dtype=torch.float32, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        call = lambda: gather(out, inp, group=group)  # noqa: E731
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        call()
    sync()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def check_all_reduce(group: Any, n: int, device: Any) -> Optional[str]:
    """A message when a sum all-reduce of ones does not give ``n`` everywhere."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(1024, dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)
    ok = torch.tensor([1.0 if bool((buf == n).all()) else 0.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return None if ok.item() == 1.0 else f"all_reduce over groups of {n} returned wrong sums"


def measure_groups(named: dict[str, list[list[int]]], sizes: Sequence[int], *, iters: int,
                   warmup: int, local: dict[str, bool], on_gpu: bool,
                   warn_below: Optional[float] = None) -> tuple[list[Row], list[str]]:
    """Measure each kind of groups (all of its groups at once). Collective: every rank calls
    it with the same arguments. ``local[kind]`` says whether each group sits on one node."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    rows: list[Row] = []
    errors: list[str] = []
    for kind, groups in named.items():
        n = len(groups[0])
        if n < 2 or any(len(g) != n for g in groups):
            continue
        if len(groups) == 1 and n == dist.get_world_size():
            group = None  # the default group
        else:
            group, _ = dist.new_subgroups_by_enumeration(groups)
        problem = check_all_reduce(group, n, device)
        if problem:
            errors.append(f"{kind}: {problem}")
            continue
        if warn_below is not None:
            threshold = warn_below
        elif on_gpu:
            threshold = THRESHOLDS_GBPS["gpu_intra_node" if local.get(kind) else "gpu_inter_node"]
        else:
            threshold = THRESHOLDS_GBPS["cpu"]
        for op in ("all_reduce", "all_gather"):
            for i, size in enumerate(sizes):
                seconds = _time_op(op, group, n, size, iters, warmup, device)
                numel = max(size // 4 // n * n, n)
                algbw = numel * 4 / seconds / 1e9
                row = Row(op, kind, n, len(groups), numel * 4, seconds, algbw,
                          algbw * bus_factor(op, n))
                if i == len(sizes) - 1:
                    row.threshold_gbps = threshold
                    row.status = "pass" if row.busbw_gbps >= threshold else "warn"
                rows.append(row)
    return rows, errors


def rows_json(rows: Sequence[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
