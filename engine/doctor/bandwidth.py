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

import torch
import torch.distributed as dist

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
    buf = torch.ones(1024, dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)
    ok = torch.tensor([1.0 if bool((buf == n).all()) else 0.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return None if ok.item() == 1.0 else f"all_reduce over groups of {n} returned wrong sums"


def measure_groups(named: dict[str, list[list[int]]], sizes: Sequence[int], *, iters: int,
                   warmup: int, local: dict[str, bool], on_gpu: bool,
                   thresholds: Optional[dict[str, float]] = None) -> tuple[list[Row], list[str]]:
    """Measure each kind of groups (all of its groups at once). Collective: every rank calls
    it with the same arguments. ``local[kind]`` says whether each group sits on one node."""
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
        limits = thresholds or THRESHOLDS_GBPS
        threshold = limits[("gpu_intra_node" if local.get(kind) else "gpu_inter_node") if on_gpu else "cpu"]
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


def ring_pairs(world: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint rank pairs that cover every ring neighbour (r, r + 1 mod world):
    even-odd pairs, then odd-even pairs (and the wrap-around pair when it is new)."""
    if world < 2:
        return []
    rounds = [[(r, r + 1) for r in range(0, world - 1, 2)]]
    second = [(r, r + 1) for r in range(1, world - 1, 2)]
    if world > 2 and world % 2 == 0:
        second.append((0, world - 1))
    if second:
        rounds.append(second)
    if world > 2 and world % 2:  # the odd ring's last edge needs a round of its own
        rounds.append([(0, world - 1)])
    return rounds


def measure_pairs(size: int, *, iters: int, warmup: int, hosts: Sequence[str], on_gpu: bool,
                  thresholds: dict[str, float]) -> list[dict[str, Any]]:
    """Bandwidth of every ring-neighbour rank pair: both ranks send ``size`` bytes to each other
    at once (``batch_isend_irecv``); GB/s = size / time per direction, time = the slower rank's.
    Collective. Each pair is checked against the threshold for its locality."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    numel = max(size // 4, 1)
    out: list[dict[str, Any]] = []
    for pairs in ring_pairs(world):
        peer = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
        seconds = torch.zeros(world, dtype=torch.float64, device=device)
        if peer is not None:
            send = torch.ones(numel, dtype=torch.float32, device=device)
            recv = torch.empty(numel, dtype=torch.float32, device=device)

            def exchange(send=send, recv=recv, peer=peer) -> None:
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()

            for _ in range(warmup):
                exchange()
        sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        sync()
        dist.barrier()
        if peer is not None:
            start = time.perf_counter()
            for _ in range(iters):
                exchange()
            sync()
            seconds[rank] = (time.perf_counter() - start) / iters
        dist.all_reduce(seconds)  # every rank's own time; each slot written by one rank
        for a, b in pairs:
            t = max(float(seconds[a]), float(seconds[b]))
            local = hosts[a] == hosts[b]
            kind = ("gpu_intra_node" if local else "gpu_inter_node") if on_gpu else "cpu"
            gbps = numel * 4 / t / 1e9 if t > 0 else float("inf")
            threshold = thresholds[kind]
            out.append({"ranks": [a, b], "hosts": [hosts[a], hosts[b]], "size": numel * 4, "seconds": t,
                        "gbps": gbps, "threshold_gbps": threshold, "link": kind,
                        "status": "pass" if gbps >= threshold else "warn"})
    return out
