"""Weight sync executor: runs a :class:`~hyflow.placement.sync_planner.SyncPlan` on this rank.

The planner (pure arithmetic, unit-tested on arrays) names, for every piece of every destination
shard, the source rank, parameter, dimension and offsets, and packs the pieces of each rank pair
into buckets; bucket ``i`` of every pair runs in round ``i``. The executor follows the plan and
decides nothing itself:

* a source rank packs each bucket it sends into one flat buffer (its pieces in plan order) and
  posts it; a destination rank posts one receive per bucket and copies each piece into its slice
  of its own parameter. One ``batch_isend_irecv`` per round over the sync group (NCCL on GPU,
  gloo elsewhere): no pickling, and a rank stages at most one bucket per peer;
* buckets whose two ends are the same rank (a pool that both trains and generates) are copies.

Each destination rank receives exactly its slice (``plan.bytes_recv(rank)``), once; the bytes
are counted here and by :mod:`hyflow.monitor.comm` (``p2p`` over the ``reshard`` group).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyflow.placement.sync_planner import Bucket, SyncPiece, SyncPlan, SyncPlanError, bucket_rounds


@dataclass
class SyncStats:
    """What one sync did on this rank."""

    seconds: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0
    buckets: int = 0


class WeightSync:
    """Moves ``plan``'s pieces between this rank's ``model`` and its peers.

    ``model``: this rank's shard of the model (the training model on a source rank, the
    generation model on a destination rank; ``None`` on a rank the plan does not touch).
    ``group``: the process group over both pools (:func:`hyflow.placement.groups.build_sync_group`).
    """

    def __init__(self, plan: SyncPlan, model: torch.nn.Module | None, group=None) -> None:
        self.plan, self.group, self.rank = plan, group, dist.get_rank()
        self.params = dict(model.named_parameters()) if model is not None else {}
        self.rounds = bucket_rounds(plan, self.rank)
        self.local = plan.local(self.rank)
        self._check()

    def _check(self) -> None:
        """Every piece names a parameter of this rank's model with room for it (one clear error)."""
        for sends, recvs in self.rounds:
            for b in sends:
                for p in b.pieces:
                    self._slice(p.src_name, p, p.src_offset, "source")
            for b in recvs:
                for p in b.pieces:
                    self._slice(p.dst_name, p, p.dst_offset, "destination")
        for b in self.local:
            for p in b.pieces:
                self._slice(p.src_name, p, p.src_offset, "source")
                self._slice(p.dst_name, p, p.dst_offset, "destination")

    def _slice(self, name: str, piece: SyncPiece, offset: int, side: str) -> torch.Tensor:
        param = self.params.get(name)
        if param is None:
            raise SyncPlanError(f"rank {self.rank}: the weight-sync plan's {side} parameter {name!r} "
                                f"({piece.name}) is not in this rank's model")
        if param.dim() == 0 or offset + piece.length > param.shape[piece.dim]:
            raise SyncPlanError(f"rank {self.rank}: {name} {tuple(param.shape)} has no [{offset}, "
                                f"{offset + piece.length}) along dim {piece.dim} ({side} of {piece.name})")
        return param.detach().narrow(piece.dim, offset, piece.length)

    def _pack(self, bucket: Bucket) -> torch.Tensor:
        parts = [self._slice(p.src_name, p, p.src_offset, "source").reshape(-1) for p in bucket.pieces]
        return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()

    def _unpack(self, bucket: Bucket, flat: torch.Tensor) -> None:
        at = 0
        for p in bucket.pieces:
            dst = self._slice(p.dst_name, p, p.dst_offset, "destination")
            n = dst.numel()
            dst.copy_(flat[at:at + n].view(dst.shape))
            at += n

    def _inbox(self, bucket: Bucket) -> torch.Tensor:
        first = self._slice(bucket.pieces[0].dst_name, bucket.pieces[0], bucket.pieces[0].dst_offset, "destination")
        numel = sum(self._slice(p.dst_name, p, p.dst_offset, "destination").numel() for p in bucket.pieces)
        return torch.empty(numel, dtype=first.dtype, device=first.device)

    @torch.no_grad()
    def run(self) -> SyncStats:
        """One sync: every round's buckets sent / received, then the local copies."""
        stats = SyncStats()
        start = time.perf_counter()
        for sends, recvs in self.rounds:
            ops, inbox = [], []
            for b in sends:
                buf = self._pack(b)
                ops.append(dist.P2POp(dist.isend, buf, b.dst_rank, group=self.group))
                stats.bytes_sent += buf.numel() * buf.element_size()
            for b in recvs:
                buf = self._inbox(b)
                ops.append(dist.P2POp(dist.irecv, buf, b.src_rank, group=self.group))
                inbox.append((b, buf))
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            for b, buf in inbox:
                self._unpack(b, buf)
                stats.bytes_received += buf.numel() * buf.element_size()
            stats.buckets += len(sends) + len(recvs)
        for b in self.local:
            for p in b.pieces:
                self._slice(p.dst_name, p, p.dst_offset, "destination").copy_(
                    self._slice(p.src_name, p, p.src_offset, "source"))
        stats.seconds = time.perf_counter() - start
        return stats
