"""How the two merges of a transition move bytes between the ranks of one group.

The TP merge (inside each group of ``s = TP/TP_g`` ranks, :mod:`hyflow.hybrid.executor`)
all-gathers every sharded parameter and lays the shards out with the fix-up kernels
(:func:`hyflow.kernels.place_shard`). Both transports cut the parameters into the same buckets
of at most one staging slot (:func:`plan_buckets`):

* :class:`CollectiveGather` -- one ``all_gather_into_tensor`` per bucket through the process
  group (NCCL on GPU, gloo elsewhere) into a staging buffer of ``s`` slots on the parameters'
  device, then every shard straight into its place in the generation buffer. Small parameters
  share a collective, large ones are cut to the slot (the Qwen2-72B preset, TP 8 -> 4: 101
  parameters per rank in 85 all-gathers, BENCHMARKS.md).
* :class:`SharedMemoryGather` -- for groups whose ranks are CPU processes on one host. gloo
  moves bytes through loopback TCP at 0.4-0.7 GB/s on the dev box, which made it the whole cost
  of a transition; here each rank copies a bucket into its own slot of a small shared-memory
  staging area (two slots, double buffered), one barrier, then copies each peer's shards out
  of the peer's slot straight into their places. Staging is ``2 * slot_bytes`` per rank.

The PP merge (``PP_g < PP``) moves whole generation shards between the stages of a PP-merge
group; both exchanges take the same call, ``exchange(publish, receive)``:
:class:`PointToPointExchange` (batched send/recv, NCCL on GPU) and, on one CPU host,
:class:`SharedMemoryExchange` (each rank publishes once, every peer copies what it takes).

:func:`make_transport` and :func:`make_pp_exchange` pick one (``"auto"``: shared memory where
it applies).
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hyflow.kernels import place_shard

TRANSPORTS = ("auto", "collective", "shared_memory")
_ALIGN = 64


@dataclass
class GatherItem:
    """One sharded parameter: this rank's training shard, its fix-up kind, its destination."""

    shard: torch.Tensor
    kind: str  # "gate_up" | "row_concat" | "column_concat"
    out: torch.Tensor


def plan_buckets(rows: Sequence[tuple[int, int]], slot_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """Cut shards of ``(rows, bytes per row)`` into buckets of at most ``slot_bytes``: each
    bucket a list of ``(shard index, first row, rows, byte offset in the slot)``, pieces
    64-byte aligned. Pure arithmetic: every rank of a group computes the same buckets."""
    buckets, bucket, used = [], [], 0
    for i, (n_rows, row_bytes) in enumerate(rows):
        if row_bytes > slot_bytes:
            raise ValueError(f"a row of {row_bytes} bytes does not fit the {slot_bytes}-byte "
                             "staging slot; raise slot_bytes")
        per = max(1, slot_bytes // max(row_bytes, 1))
        for r0 in range(0, n_rows, per):
            n = min(per, n_rows - r0)
            padded = -(-n * row_bytes // _ALIGN) * _ALIGN
            if used + padded > slot_bytes and bucket:
                buckets.append(bucket)
                bucket, used = [], 0
            bucket.append((i, r0, n, used))
            used += padded
    if bucket:
        buckets.append(bucket)
    return buckets


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _agree_slot(slot_bytes: int, group, device: torch.device = torch.device("cpu")) -> int:
    """The largest requested slot over the group (bucket boundaries must agree)."""
    agreed = torch.tensor([max(slot_bytes // _ALIGN * _ALIGN, _ALIGN)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return int(agreed.item())


class _BucketedGather:
    """The TP merge's loop over buckets; a subclass moves one bucket between the ranks."""

    name = "?"
    s: int
    index: int
    slot_bytes: int

    def _exchange(self, k: int, own: Iterator[tuple[torch.Tensor, int]], nbytes: int) -> list[torch.Tensor]:
        """Move bucket ``k``: write this rank's pieces ((piece, byte offset) pairs, ``nbytes``
        in all) and return, for every rank of the group, a byte view of its slot."""
        raise NotImplementedError

    @torch.no_grad()
    def gather(self, items: list[GatherItem]) -> int:
        """Fill every item's ``out`` with the ``s`` shards of the group; returns bytes received."""
        received = 0
        shards = [it.shard.detach() for it in items]
        for k, bucket in enumerate(plan_buckets([(t.shape[0], _row_bytes(t)) for t in shards],
                                                self.slot_bytes)):
            end = bucket[-1][3] + bucket[-1][2] * _row_bytes(shards[bucket[-1][0]])
            own = ((shards[i][r0:r0 + n], off) for i, r0, n, off in bucket)
            slots = self._exchange(k, own, end)
            for i, r0, n, off in bucket:
                it, shard = items[i], shards[i]
                place_shard(it.kind, shard[r0:r0 + n], self.index, self.s, it.out, row0=r0)
                nbytes = n * _row_bytes(shard)
                for j, slot in enumerate(slots):
                    if j != self.index:
                        piece = slot[off:off + nbytes].view(shard.dtype).view((n,) + tuple(shard.shape[1:]))
                        place_shard(it.kind, piece, j, self.s, it.out, row0=r0)
                        received += nbytes
        self._done()
        return received

    def _done(self) -> None:
        pass

    def close(self) -> None:
        pass


class CollectiveGather(_BucketedGather):
    """One ``all_gather_into_tensor`` per bucket (NCCL on GPU, gloo elsewhere).

    The staging (``s`` slots on ``device``) lives for one transition: it is allocated when a
    gather starts and dropped when it ends, so it costs nothing while the model trains.
    """

    name = "collective"

    def __init__(self, group, ranks: list[int], device: torch.device, slot_bytes: int = 64 << 20) -> None:
        self.group, self.s, self.device = group, len(ranks), device
        self.index = list(ranks).index(dist.get_rank())
        self.slot_bytes = _agree_slot(slot_bytes, group, device) if self.s > 1 else slot_bytes
        self.staging_bytes = self.s * self.slot_bytes if self.s > 1 else 0
        self._staging: Optional[torch.Tensor] = None

    def _exchange(self, k, own, nbytes):
        if self._staging is None:
            self._staging = torch.empty(self.s * self.slot_bytes, dtype=torch.uint8, device=self.device)
        slots = self._staging[:self.s * nbytes].view(self.s, nbytes)
        mine = slots[self.index]
        for piece, off in own:
            mine[off:off + piece.numel() * piece.element_size()].view(piece.dtype).view(piece.shape).copy_(piece)
        # In place: this rank's slot is its input (NCCL's documented in-place form).
        dist.all_gather_into_tensor(slots.view(-1), mine, group=self.group)
        return list(slots)

    def _done(self) -> None:
        self._staging = None


class SharedMemoryGather(_BucketedGather):
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
        self.slot_bytes = _agree_slot(slot_bytes, group)
        self.staging_bytes = 2 * self.slot_bytes
        self.segments = map_segments(group, self.ranks, self.staging_bytes, directory)

    def _exchange(self, k, own, nbytes):
        base = (k % 2) * self.slot_bytes
        mine = self.segments[self.index]
        for piece, off in own:
            n = piece.numel() * piece.element_size()
            mine[base + off:base + off + n].view(piece.dtype).view(piece.shape).copy_(piece)
        # One barrier per bucket is enough with two slots: a rank reuses slot k % 2 for
        # bucket k + 2 only after the barrier of bucket k + 1, which every peer reaches
        # after it finished reading bucket k.
        dist.barrier(group=self.group)
        return [seg[base:base + nbytes] for seg in self.segments]

    def _done(self) -> None:
        dist.barrier(group=self.group)  # peers are done reading before the next call writes

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
        segment = torch.from_file(mine, shared=True, size=nbytes, dtype=torch.uint8, device="cpu")
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
        segments = [segment if j == index else torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8, device="cpu")
                    for j, (path, _) in enumerate(names)]
        dist.barrier(group=group)  # everyone has mapped every segment
    finally:
        if segment is not None and os.path.exists(mine):
            os.unlink(mine)
    return segments


class PointToPointExchange:
    """The PP merge through the process group (NCCL on GPU, gloo elsewhere): every tensor a peer
    takes is sent straight from this rank's generation buffer, and received straight into the
    peer's, all in one batch; no staging, no concatenated copies. Between two ranks the sends
    and receives pair up in stream order (the order both sides' tables list them).
    """

    name = "p2p"
    staging_bytes = 0

    def __init__(self, group, ranks: list[int]) -> None:
        self.group, self.ranks = group, list(ranks)
        self.index = self.ranks.index(dist.get_rank())

    @torch.no_grad()
    def exchange(self, publish: list[tuple[torch.Tensor, tuple[int, ...]]], receive: dict[int, list]) -> int:
        """See :meth:`SharedMemoryExchange.exchange`; returns the bytes received."""
        ops, received = [], 0
        for j, peer in enumerate(self.ranks):
            if j == self.index:
                continue
            ops += [dist.P2POp(dist.isend, t, peer, group=self.group) for t, takers in publish if j in takers]
            for dest, nbytes in receive.get(j, ()):
                if dest is not None:
                    ops.append(dist.P2POp(dist.irecv, dest, peer, group=self.group))
                    received += nbytes
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return received

    def close(self) -> None:
        pass


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
        self.slot_bytes = _agree_slot(slot_bytes, group)
        self.staging_bytes = 2 * self.slot_bytes
        self.segments = map_segments(group, self.ranks, self.staging_bytes, directory)

    @staticmethod
    def _spans(entries: list, start: int, stop: int):
        """(byte view of a tensor's part, its offset in the stream) over stream bytes [start, stop);
        ``entries`` are (tensor or None, nbytes) pairs, None skipping nbytes."""
        offset = 0
        for t, n in entries:
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi and t is not None:
                yield t.reshape(-1).view(torch.uint8)[lo - offset:hi - offset], lo
            offset += n
            if offset >= stop:
                return

    @torch.no_grad()
    def exchange(self, publish: list[tuple[torch.Tensor, tuple[int, ...]]], receive: dict[int, list]) -> int:
        """Publish ``publish`` ((contiguous tensor, indices of the group's ranks that take it),
        in stream order) and copy from the stream of the group's ``j``-th rank into
        ``receive[j]``: that rank's published tensors in order, as (destination, nbytes) pairs,
        destination None for the ones this rank does not take. Returns the bytes received."""
        stream = [(t, t.numel() * t.element_size()) for t, _ in publish]
        rounds = torch.tensor([-(-sum(n for _, n in stream) // self.slot_bytes)], device="cpu")  # host-side count
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=self.group)
        received = 0
        for k in range(int(rounds.item())):
            base, start, stop = (k % 2) * self.slot_bytes, k * self.slot_bytes, (k + 1) * self.slot_bytes
            own = self.segments[self.index]
            for piece, at in self._spans(stream, start, stop):
                own[base + at - start:base + at - start + piece.numel()].copy_(piece)
            dist.barrier(group=self.group)  # two slots: see SharedMemoryGather._exchange
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
    usable = torch.tensor([int(os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))], device=device)
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
    return CollectiveGather(group, ranks, device, slot_bytes)


def make_pp_exchange(kind: str, group, ranks: list[int], device: torch.device,
                     slot_bytes: int = 16 << 20):
    """The exchange of one PP-merge group: shared memory where it applies (same rules as
    :func:`make_transport`), else point to point (collective calls on all its ranks)."""
    if _use_shared_memory(kind, group, ranks, device):
        try:
            return SharedMemoryExchange(group, ranks, slot_bytes)
        except RuntimeError:
            if kind == "shared_memory":
                raise
    return PointToPointExchange(group, ranks)
