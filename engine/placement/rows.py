"""Rollout rows from the generation pool to the training ranks that own them, as tensors.

Who sends what is arithmetic on the two layouts (:func:`row_routes`, no process group):
generation replica ``j`` of ``R`` generates prompts ``[j*P/R, (j+1)*P/R)``; training
data-parallel rank ``d`` of ``D`` owns prompts ``[d*P/D, (d+1)*P/D)`` (the same split as the
colocated data plane, :mod:`hyflow.rl.dispatch`), and each of its TP x PP ranks needs those rows.
The first rank of a replica sends each owner the rows of the prompts they share (all ``n``
samples of a prompt travel together); nothing crosses to a rank that does not own the rows, and
no rank ever holds the whole batch unless it owns it.

One message per (sender, receiver) pair: an int64 header (rows, tokens, log-probs, weight
version, generation microseconds), then the three tensors of
:class:`~hyflow.rollout.dp.SampleTensors`; both rounds are one ``batch_isend_irecv`` on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyflow.rl.dispatch import shard_range
from hyflow.rollout.dp import META, SampleTensors

HEADER = 5  # rows, tokens, logprobs, weight version, generation microseconds


@dataclass(frozen=True)
class RowRoute:
    """Prompts ``[first, stop)`` go from ``src`` (a replica's first rank) to ``dst`` (a training rank)."""

    src: int
    dst: int
    first: int
    stop: int


def row_routes(prompts: int, gen, train) -> list[RowRoute]:
    """Every route of a step of ``prompts`` prompts from the generation role to the training role
    (:class:`~hyflow.placement.config.RolePlacement` each), in (dst, first) order."""
    R, D = gen.layout.dp, train.layout.dp
    out = []
    for d in range(D):
        a, b = shard_range(prompts, D, d)
        owners = [train.layout.rank_of(tp=t, pp=p, dp=d) for p in range(train.layout.pp) for t in range(train.layout.tp)]
        for j in range(R):
            c, e = shard_range(prompts, R, j)
            lo, hi = max(a, c), min(b, e)
            if lo < hi:
                out += [RowRoute(gen.layout.rank_of(dp=j), dst, lo, hi) for dst in owners]
    return sorted(out, key=lambda r: (r.dst, r.first))


def _exchange(ops: list) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def send_rows(samples: SampleTensors, routes: list[RowRoute], rank: int, version: int, gen_seconds: float,
              group=None) -> int:
    """Send this replica's ``samples`` (sorted, global request indices) along its routes; returns bytes sent."""
    mine = [r for r in routes if r.src == rank]
    request = samples.column("request")
    parts = []
    for r in mine:
        index = torch.nonzero((request >= r.first) & (request < r.stop)).flatten()
        parts.append(samples.select(index))
    device = samples.meta.device
    headers = [torch.tensor([len(p), p.tokens.numel(), p.logprobs.numel(), version, int(gen_seconds * 1e6)],
                            dtype=torch.long, device=device) for p in parts]
    _exchange([dist.P2POp(dist.isend, h, r.dst, group=group) for h, r in zip(headers, mine)])
    ops, sent = [], 0
    for p, r in zip(parts, mine):
        for t in (p.meta.contiguous(), p.tokens, p.logprobs):
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, r.dst, group=group))
                sent += t.numel() * t.element_size()
    _exchange(ops)
    return sent


@dataclass
class ReceivedRows:
    samples: SampleTensors
    version: int  # the weight version that generated them (updates applied before sampling)
    gen_seconds: float  # generation time of the slowest sending replica
    nbytes: int


def recv_rows(routes: list[RowRoute], rank: int, device: torch.device, group=None) -> ReceivedRows:
    """This training rank's rows of the step, in (prompt, sample) order."""
    mine = [r for r in routes if r.dst == rank]
    headers = [torch.empty(HEADER, dtype=torch.long, device=device) for _ in mine]
    _exchange([dist.P2POp(dist.irecv, h, r.src, group=group) for h, r in zip(headers, mine)])
    ops, parts, nbytes = [], [], 0
    for h, r in zip(headers, mine):
        n, t, l_ = (int(x) for x in h[:3].tolist())
        part = SampleTensors(meta=torch.empty(n, len(META), dtype=torch.long, device=device),
                             tokens=torch.empty(t, dtype=torch.long, device=device),
                             logprobs=torch.empty(l_, dtype=torch.float32, device=device))
        for x in (part.meta, part.tokens, part.logprobs):
            if x.numel():
                ops.append(dist.P2POp(dist.irecv, x, r.src, group=group))
                nbytes += x.numel() * x.element_size()
        parts.append(part)
    _exchange(ops)
    versions = {int(h[3]) for h in headers}
    if len(versions) > 1:
        raise RuntimeError(f"rank {rank}: rows of one step from different weight versions {sorted(versions)}")
    samples = SampleTensors(meta=torch.cat([p.meta for p in parts]), tokens=torch.cat([p.tokens for p in parts]),
                            logprobs=torch.cat([p.logprobs for p in parts]))
    return ReceivedRows(samples=samples, version=versions.pop() if versions else 0,
                        gen_seconds=max((int(h[4]) for h in headers), default=0) / 1e6, nbytes=nbytes)
