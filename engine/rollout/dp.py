"""Micro-DP: split a rollout batch over generation replicas and gather it back.

In the generation layout the actor's ranks form ``DP_g`` replicas of TP_g x PP_g
ranks. Replica ``r`` generates a contiguous share of the requests (sizes differ by
at most one), every rank of a replica (every TP rank of every stage) runs the same
engine call and gets the replica's full results, and the shares are gathered over
the generation DP group (per TP rank and stage), so every rank ends with all samples in
the original (request, sample) order. Seeds are keyed by the *global* request
index (``request_offset``), so the samples do not depend on the number of replicas.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

from hyflow.rollout.config import SamplingConfig
from hyflow.rollout.request import RolloutResult, RolloutStats, as_requests


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges covering ``range(count)``, sizes within 1."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(count, parts)
    out, start = [], 0
    for r in range(parts):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def generate_data_parallel(engine, requests: Sequence, dp_group=None,
                           sampling: Optional[SamplingConfig] = None) -> RolloutResult:
    """Generate ``requests`` over the replicas of ``dp_group``; every rank gets every sample.

    Args:
        engine: this replica's :class:`~hyflow.rollout.engine.GenerationEngine`.
        requests: the whole batch (identical on every rank).
        dp_group: the generation data-parallel group (one rank per replica, same TP
            rank); None or size 1 runs everything here.
        sampling: sampling settings for requests without their own.

    Returns the gathered samples ordered by (request, sample); ``stats`` sums the
    replicas' counters (wall time: the slowest replica).
    """
    reqs = as_requests(requests)
    size = dp_group.size() if dp_group is not None else 1
    if size == 1:
        return engine.generate(reqs, sampling)
    rank = dp_group.rank()
    start, stop = split_evenly(len(reqs), size)[rank]
    if stop > start:
        local = engine.generate(reqs[start:stop], sampling, request_offset=start)
    else:
        local = RolloutResult(samples=[], stats=RolloutStats())
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (local.samples, local.stats), group=dp_group)
    samples, stats = [], RolloutStats()
    for part_samples, part_stats in gathered:
        samples.extend(part_samples)
        stats = stats.merge(part_stats)
    samples.sort(key=lambda s: (s.request_index, s.sample_index))
    return RolloutResult(samples=samples, stats=stats)
