"""How the TP merge moves training shards inside one group of ``s`` ranks.

The TP merge of :mod:`hyflow.hybrid.executor` is an all-gather of every sharded parameter
inside each TP-merge group, followed by a layout fix-up. Two transports do it:

* :class:`CollectiveGather` — one ``all_gather_into_tensor`` per parameter, then the
  fix-up kernel (:func:`hyflow.kernels.assemble`). The GPU path (NCCL), and any group
  that spans hosts.
* :class:`SharedMemoryGather` — for groups whose ranks share one host, on CPU. gloo
  moves bytes through loopback TCP at 0.4-0.7 GB/s on the dev box, which made it the
  whole cost of a transition; here each rank copies a bucket of its shards into its own
  slot of a small shared-memory staging area (two slots, double buffered), one barrier,
  then every rank copies each peer's shards out of the peer's slot straight into their
  places in the generation buffer (:func:`hyflow.kernels.place_shard`: the fix-up *is*
  that strided copy). Staging is ``2 * slot_bytes`` per rank, fixed for the run.

:func:`make_transport` picks one (``"auto"``: shared memory when it applies).

The PP merge (``PP_g < PP``) moves whole parameters between the stages of a PP-merge group:
point to point through the process group, or on one CPU host through
:class:`SharedMemoryExchange` (:func:`make_pp_exchange`), the same staging idea.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hyflow.kernels import assemble, place_shard

TRANSPORTS = ("auto", "collective", "shared_memory")
_ALIGN = 64


@dataclass
class GatherItem:
    """One sharded parameter: this rank's training shard, its fix-up kind, its destination."""

    shard: torch.Tensor
    kind: str  # "gate_up" | "row_concat" | "column_concat"
    out: torch.Tensor


class CollectiveGather:
    """All-gather per parameter through the process group (NCCL on GPU, gloo elsewhere)."""

    name = "collective"
    staging_bytes = 0

    def __init__(self, group, s: int) -> None:
        self.group, self.s = group, s

    def gather(self, items: list[GatherItem]) -> int:
        received = 0
        for it in items:
            shard = it.shard.detach().contiguous()
            if it.kind == "column_concat":  # the gathered [s, rows, ...] *is* the destination
                dist.all_gather_into_tensor(it.out, shard, group=self.group)
            else:  # gather into scratch, then one strided pass (a Triton kernel on GPU)
                scratch = torch.empty((self.s,) + tuple(shard.shape), dtype=shard.dtype, device=shard.device)
                dist.all_gather_into_tensor(scratch.view(-1, *shard.shape[1:]), shard, group=self.group)
                assemble(it.kind, scratch, out=it.out)
            received += (self.s - 1) * shard.numel() * shard.element_size()
        return received

    def close(self) -> None:
        pass


class SharedMemoryGather:
    """All-gather through a shared-memory staging area; every rank of ``ranks`` on one host.

    Args:
        group: the process group of ``ranks`` (used for barriers and the set-up exchange).
        ranks: global ranks of the group, in shard order.
        slot_bytes: size of each of the two staging slots of this rank.
        directory: where the segments are created (``/dev/shm``: memory, not disk).
    """

    name = "shared_memory"

    def __init__(self, group, ranks: list[int], slot_bytes: int = 64 << 20,
                 directory: str = "/dev/shm") -> None:
        self.group, self.ranks, self.s = group, list(ranks), len(ranks)
        self.index = self.ranks.index(dist.get_rank())
        agreed = torch.tensor([slot_bytes // _ALIGN * _ALIGN])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # bucket boundaries must agree
        self.slot_bytes = int(agreed.item())
        self.staging_bytes = 2 * self.slot_bytes
        self.segments = map_segments(group, self.ranks, self.staging_bytes, directory)

    def _pieces(self, items: list[GatherItem]):
        """Cut items into (item, row0, rows, nbytes) pieces that fit one slot."""
        for it in items:
            rows = it.shard.shape[0]
            row_bytes = it.shard[:1].numel() * it.shard.element_size() if rows else 0
            if row_bytes > self.slot_bytes:
                raise ValueError(f"a row of {row_bytes} bytes does not fit the {self.slot_bytes}-byte "
                                 "staging slot; raise slot_bytes")
            per = max(1, self.slot_bytes // max(row_bytes, 1))
            for r0 in range(0, rows, per):
                n = min(per, rows - r0)
                yield it, r0, n, n * row_bytes

    def _buckets(self, items: list[GatherItem]):
        bucket, used = [], 0
        for it, r0, n, nbytes in self._pieces(items):
            padded = -(-nbytes // _ALIGN) * _ALIGN
            if used + padded > self.slot_bytes and bucket:
                yield bucket
                bucket, used = [], 0
            bucket.append((it, r0, n, used))
            used += padded
        if bucket:
            yield bucket

    @torch.no_grad()
    def gather(self, items: list[GatherItem]) -> int:
        received = 0
        for k, bucket in enumerate(self._buckets(items)):
            base = (k % 2) * self.slot_bytes
            own = self.segments[self.index]
            for it, r0, n, off in bucket:  # publish this rank's pieces, and place them here
                piece = it.shard.detach()[r0:r0 + n]
                nbytes = piece.numel() * piece.element_size()
                own[base + off:base + off + nbytes].view(piece.dtype).view(piece.shape).copy_(piece)
                place_shard(it.kind, piece, self.index, self.s, it.out, row0=r0)
            # One barrier per bucket is enough with two slots: a rank reuses slot k % 2 for
            # bucket k + 2 only after the barrier of bucket k + 1, which every peer reaches
            # after it finished reading bucket k.
            dist.barrier(group=self.group)
            for j in range(self.s):
                if j == self.index:
                    continue
                for it, r0, n, off in bucket:
                    shape = (n,) + tuple(it.shard.shape[1:])
                    nbytes = n * it.shard[:1].numel() * it.shard.element_size()
                    piece = self.segments[j][base + off:base + off + nbytes].view(it.shard.dtype).view(shape)
                    place_shard(it.kind, piece, j, self.s, it.out, row0=r0)
                    received += nbytes
        dist.barrier(group=self.group)  # peers are done reading before the next call writes
        return received

    def close(self) -> None:
        self.segments = []


def map_segments(group, ranks: list[int], nbytes: int, directory: str = "/dev/shm") -> list[torch.Tensor]:
    """Create this rank's ``nbytes`` shared-memory segment and map every peer's (collective over
    ``group``; ``ranks`` in group order). The files are unlinked at once: nothing is left in
    ``directory``, the mappings live as long as the tensors."""
    index = list(ranks).index(dist.get_rank())
    names: list[Optional[tuple]] = [None] * len(ranks)
    mine = os.path.join(directory, f"hyflow-reshard-{uuid.uuid4().hex}-{dist.get_rank()}")
    try:
        segment = torch.from_file(mine, shared=True, size=nbytes, dtype=torch.uint8)
        segment.zero_()  # map every page now, not during the first transition
        error = None
    except (OSError, RuntimeError) as exc:
        segment, error = None, f"{type(exc).__name__}: {exc}"
    dist.all_gather_object(names, (mine, error), group=group)
    failed = [(r, e) for r, (_, e) in zip(ranks, names) if e]
    try:
        if failed:
            raise RuntimeError(f"shared-memory staging could not be created in {directory} on rank "
                               f"{failed[0][0]} ({failed[0][1]}); free space there or use "
                               "transport='collective'")
        segments = [segment if j == index else torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                    for j, (path, _) in enumerate(names)]
        dist.barrier(group=group)  # everyone has mapped every segment
    finally:
        if segment is not None and os.path.exists(mine):
            os.unlink(mine)
    return segments


class SharedMemoryExchange:
    """The PP merge on CPU ranks of one host: every rank publishes one byte stream (the
    parameters of its training stage that any peer takes) and copies from each peer's stream
    what it takes into its own generation buffer, in rounds of one staging slot (two slots,
    double buffered, one barrier a round). gloo's point-to-point sends ran at ~0.33 GB/s on the
    dev box (BENCHMARKS.md); this is a memcpy.

    Args:
        group: the process group of ``ranks`` (the PP-merge group).
        ranks: its global ranks.
        slot_bytes: size of each of the two slots; the largest value over the ranks is used.
    """

    name = "shared_memory"

    def __init__(self, group, ranks: list[int], slot_bytes: int = 16 << 20,
                 directory: str = "/dev/shm") -> None:
        self.group, self.ranks = group, list(ranks)
        self.index = self.ranks.index(dist.get_rank())
        agreed = torch.tensor([max(slot_bytes // _ALIGN * _ALIGN, _ALIGN)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        self.slot_bytes = int(agreed.item())
        self.staging_bytes = 2 * self.slot_bytes
        self.segments = map_segments(group, self.ranks, self.staging_bytes, directory)

    @staticmethod
    def _spans(entries: list, start: int, stop: int):
        """(byte view of a tensor's part, its offset in the stream) over stream bytes [start, stop);
        ``entries`` are tensors, or (tensor or None, nbytes) pairs where None skips nbytes."""
        offset = 0
        for entry in entries:
            t, n = entry if isinstance(entry, tuple) else (entry, entry.numel() * entry.element_size())
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi and t is not None:
                yield t.reshape(-1).view(torch.uint8)[lo - offset:hi - offset], lo
            offset += n
            if offset >= stop:
                return

    @torch.no_grad()
    def exchange(self, publish: list[torch.Tensor], receive: dict[int, list]) -> int:
        """Publish ``publish`` (contiguous tensors, one stream) and copy from the stream of the
        group's ``j``-th rank into ``receive[j]``: that rank's published tensors in order, as
        (destination, nbytes) pairs, destination None for the ones this rank does not take.
        Returns the bytes received."""
        mine = sum(t.numel() * t.element_size() for t in publish)
        rounds = torch.tensor([-(-mine // self.slot_bytes)])
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=self.group)
        received = 0
        for k in range(int(rounds.item())):
            base, start, stop = (k % 2) * self.slot_bytes, k * self.slot_bytes, (k + 1) * self.slot_bytes
            own = self.segments[self.index]
            for piece, at in self._spans(publish, start, stop):
                own[base + at - start:base + at - start + piece.numel()].copy_(piece)
            dist.barrier(group=self.group)  # two slots: see SharedMemoryGather.gather
            for j, targets in receive.items():
                for piece, at in self._spans(targets, start, stop):
                    piece.copy_(self.segments[j][base + at - start:base + at - start + piece.numel()])
                    received += piece.numel()
        dist.barrier(group=self.group)
        return received

    def close(self) -> None:
        self.segments = []


def same_host(group) -> bool:
    """Whether every rank of ``group`` runs on this host (hostname and boot id agree)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    ident = (socket.gethostname(), boot)
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, ident, group=group)
    return all(s == ident for s in seen)


def _use_shared_memory(kind: str, group, ranks: list[int], device: torch.device) -> bool:
    """Whether a merge group moves its bytes through shared memory: ``kind`` asks for it or
    (``"auto"``) every rank is a CPU process on this host with a writable /dev/shm (collective
    over ``group`` then)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")
    if len(ranks) == 1 or kind == "collective":
        return False
    if device.type != "cpu":
        if kind == "shared_memory":
            raise ValueError("transport='shared_memory' moves CPU tensors; GPU weights use 'collective' (NCCL)")
        return False
    if kind == "shared_memory":
        return True
    usable = torch.tensor([int(os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))])
    dist.all_reduce(usable, op=dist.ReduceOp.MIN, group=group)
    return bool(usable.item()) and same_host(group)


def make_transport(kind: str, group, ranks: list[int], device: torch.device,
                   slot_bytes: int = 64 << 20):
    """Build the transport for one TP-merge group (collective calls on all its ranks)."""
    if _use_shared_memory(kind, group, ranks, device):
        try:
            return SharedMemoryGather(group, ranks, slot_bytes)
        except RuntimeError:  # every rank sees the same failure list: all fall back together
            if kind == "shared_memory":
                raise
    return CollectiveGather(group, len(ranks))


def make_pp_exchange(kind: str, group, ranks: list[int], device: torch.device,
                     slot_bytes: int = 16 << 20) -> Optional[SharedMemoryExchange]:
    """The shared-memory exchange for one PP-merge group where it applies (same rules as
    :func:`make_transport`), or None: the executor then sends point to point."""
    if _use_shared_memory(kind, group, ranks, device):
        try:
            return SharedMemoryExchange(group, ranks, slot_bytes)
        except RuntimeError:
            if kind == "shared_memory":
                raise
    return None
