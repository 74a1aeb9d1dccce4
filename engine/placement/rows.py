"""Rollout rows from the generation pool to the training ranks that own them, as tensors.

Who sends what is arithmetic on the two layouts (:func:`row_routes`, no process group):
generation replica ``j`` of ``R`` generates prompts ``[j*P/R, (j+1)*P/R)``; training
data-parallel rank ``d`` of ``D`` owns prompts ``[d*P/D, (d+1)*P/D)`` (the same split as the
colocated data plane, :mod:`hyflow.rl.dispatch`), and each of its TP x PP ranks needs those rows.
The first rank of a replica sends each owner the rows of the prompts they share (all ``n``
samples of a prompt travel together); nothing crosses to a rank that does not own the rows, and
no rank ever holds the whole batch unless it owns it.

One message per (sender, receiver) pair: an int64 header (rows, tokens, log-probs, weight
version, generation microseconds, per-token versions, waiting microseconds, origin rows, dropped
samples, mask length, stats columns), then the tensors of :class:`~hyflow.rollout.dp.SampleTensors`
(the per-token weight versions when the sender recorded them, each row's origin when a batch mixes
prompts of several loader batches: ``trainer.mode: async``; a multi-turn trajectory's loss mask over
its observations and its counters, :mod:`hyflow.agent.trajectory`); both rounds are one
``batch_isend_irecv`` on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hyflow.rl.dispatch import shard_range
from hyflow.rollout.dp import META, SampleTensors

#: rows, tokens, logprobs, weight version, generation microseconds, versions, waiting microseconds, origin rows,
#: dropped samples, mask length, stats columns
HEADER = 11
ORIGIN = ("step", "request", "uid")  #: columns of a row's origin: loader step, prompt index there, dataset index


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
              group=None, wait_seconds: float = 0.0, origins: Optional[torch.Tensor] = None, dropped: int = 0) -> int:
    """Send this replica's ``samples`` (sorted, global request indices) along its routes; returns bytes
    sent. ``version``: the oldest weight version that sampled them; ``gen_seconds`` / ``wait_seconds``:
    the replica's time generating them and waiting for the training pool since its previous send;
    ``origins``: None, or ``[rows, 3]`` int64 per row (:data:`ORIGIN`); ``dropped``: samples this replica
    dropped as too stale while forming the batch (told to the owners of its first rows only, so a sum
    over the training data-parallel ranks counts each replica once)."""
    mine = [r for r in routes if r.src == rank]
    request = samples.column("request")
    parts, picked = [], []
    for r in mine:
        index = torch.nonzero((request >= r.first) & (request < r.stop)).flatten()
        parts.append(samples.select(index))
        picked.append(None if origins is None else origins[index].contiguous())
    device = samples.meta.device
    lowest = min((r.first for r in mine), default=0)
    headers = [torch.tensor([len(p), p.tokens.numel(), p.logprobs.numel(), version, int(gen_seconds * 1e6),
                             0 if p.versions is None else p.versions.numel(), int(wait_seconds * 1e6),
                             0 if o is None else o.shape[0], dropped if r.first == lowest else 0,
                             0 if p.mask is None else p.mask.numel(), 0 if p.stats is None else p.stats.shape[1]],
                            dtype=torch.long, device=device) for p, o, r in zip(parts, picked, mine)]
    _exchange([dist.P2POp(dist.isend, h, r.dst, group=group) for h, r in zip(headers, mine)])
    ops, sent = [], 0
    for p, o, r in zip(parts, picked, mine):
        for t in (p.meta.contiguous(), p.tokens, p.logprobs, p.versions, o, p.mask,
                  None if p.stats is None else p.stats.contiguous()):
            if t is not None and t.numel():
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
    wait_seconds: float = 0.0  # the sending replicas' waits for the training pool since their previous send (most)
    origins: Optional[torch.Tensor] = None  # [rows, 3] (ORIGIN) when the senders sent them
    dropped: int = 0  # samples the senders dropped as too stale while forming this batch (see send_rows)


def recv_rows(routes: list[RowRoute], rank: int, device: torch.device, group=None) -> ReceivedRows:
    """This training rank's rows of the step, in (prompt, sample) order."""
    mine = [r for r in routes if r.dst == rank]
    headers = [torch.empty(HEADER, dtype=torch.long, device=device) for _ in mine]
    _exchange([dist.P2POp(dist.irecv, h, r.src, group=group) for h, r in zip(headers, mine)])
    ops, parts, nbytes = [], [], 0
    origins = []
    for h, r in zip(headers, mine):
        n, t, l_, v, o, m, k = (int(h[i]) for i in (0, 1, 2, 5, 7, 9, 10))
        part = SampleTensors(meta=torch.empty(n, len(META), dtype=torch.long, device=device),
                             tokens=torch.empty(t, dtype=torch.long, device=device),
                             logprobs=torch.empty(l_, dtype=torch.float32, device=device),
                             versions=torch.empty(v, dtype=torch.long, device=device) if v else None,
                             mask=torch.empty(m, dtype=torch.float32, device=device) if m else None,
                             stats=torch.empty(n, k, dtype=torch.float64, device=device) if k else None)
        origin = torch.empty(o, len(ORIGIN), dtype=torch.long, device=device) if o else None
        for x in (part.meta, part.tokens, part.logprobs, *([part.versions] if v else []),
                  *([origin] if o else []), *([part.mask] if m else []), *([part.stats] if k else [])):
            if x.numel():
                ops.append(dist.P2POp(dist.irecv, x, r.src, group=group))
                nbytes += x.numel() * x.element_size()
        parts.append(part)
        origins.append(origin)
    _exchange(ops)
    tagged = [p for p in parts if len(p)]
    if any(p.versions is None for p in tagged) or not tagged:  # the versions of a step, one per batch
        versions = {int(h[3]) for h in headers}
        if len(versions) > 1:
            raise RuntimeError(f"rank {rank}: rows of one step from different weight versions {sorted(versions)}")
        per_token = None
    else:  # per-token versions (trainer.mode: async): the oldest token's is the batch's
        versions = {min(int(h[3]) for h, p in zip(headers, parts) if len(p))}
        per_token = torch.cat([p.versions for p in tagged])
    samples = SampleTensors(meta=torch.cat([p.meta for p in parts]), tokens=torch.cat([p.tokens for p in parts]),
                            logprobs=torch.cat([p.logprobs for p in parts]), versions=per_token,
                            mask=_joined(tagged, "mask"), stats=_joined(tagged, "stats"))
    sent = [o for o, p in zip(origins, parts) if len(p)]
    origin = torch.cat(sent) if sent and all(o is not None for o in sent) else None
    return ReceivedRows(samples=samples, version=versions.pop() if versions else 0,
                        gen_seconds=max((int(h[4]) for h in headers), default=0) / 1e6, nbytes=nbytes,
                        wait_seconds=max((int(h[6]) for h in headers), default=0) / 1e6, origins=origin,
                        dropped=sum(int(h[8]) for h in headers))


def _joined(parts: list[SampleTensors], name: str) -> Optional[torch.Tensor]:
    """The parts' ``mask`` or ``stats`` back to back; None unless every part carries it (multi-turn
    rows carry both, single responses neither)."""
    values = [getattr(p, name) for p in parts]
    if not values or any(v is None for v in values):
        return None
    return torch.cat(values)
