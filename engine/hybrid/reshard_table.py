"""One rank's view of a :class:`~hyflow.hybrid.reshard_plan.ReshardPlan`.

* :func:`rank_table` -> :class:`RankTable`, what the executor (:mod:`hyflow.hybrid.executor`)
  runs: one :class:`Route` per parameter of the rank's generation stage, saying where it sits in
  the flat generation buffer, which training stage supplies it and under which name in that
  stage's model, and how it arrives (a local copy, the TP merge's all-gather with its layout
  fix-up, or the PP merge from another stage), plus the PP merge's publish and receive lists.
  The executor does what the table says and nothing else (it never parses a parameter name), so
  a permuted table moves the bytes accordingly. Pure data: unit-tested without process groups.
* :func:`rank_plan` -> :class:`RankPlan`: the same transition as slice moves between global
  ranks (the bit-exact simulation in the tests, reports).

Megatron-Core's ``resharding`` package is built the same way (a planner emits per-rank
operations; the execution only runs them), for any layout pair but through per-tensor
point-to-point copies; here the two merges keep their collective structure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hyflow.hybrid.param_specs import ReshardPlanError, megatron_local_name
from hyflow.hybrid.reshard_plan import ReshardPlan, source_stage

__all__ = ["Route", "RankTable", "rank_table", "Move", "RankPlan", "rank_plan", "send_moves",
           "VIA_COPY", "VIA_TP_MERGE", "VIA_PP_MERGE"]

#: How a route's bytes arrive: copied from this rank's own training parameter; all-gathered
#: from the ``s`` ranks of the TP-merge group and laid out by the fix-up; or received whole
#: (already TP-merged) from the rank of another training stage in the PP-merge group.
VIA_COPY, VIA_TP_MERGE, VIA_PP_MERGE = "copy", "tp_merge", "pp_merge"


@dataclass(frozen=True)
class Route:
    """One generation parameter of one rank: a row of its reshard table."""

    gen_name: str  # name in this rank's generation-stage model
    offset: int  # elements into the flat generation buffer
    shape: tuple[int, ...]  # the generation shard
    src_stage: int  # training stage whose parameter supplies it
    train_name: str  # that parameter's name in the source stage's training model
    via: str  # VIA_COPY | VIA_TP_MERGE | VIA_PP_MERGE
    fixup: str  # "none" (replicated) | "column_concat" | "row_concat" | "gate_up"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class RankTable:
    """Everything one rank's executor does in a transition, and nothing it must work out."""

    rank: int
    train_stage: int
    tp_slot: int  # position of this rank's training shard among the s of its generation shard
    tp_merge_ranks: tuple[int, ...]  # the s ranks of the TP merge, in shard order
    pp_merge_ranks: tuple[int, ...]  # the p ranks of the PP merge, in stage order
    routes: tuple[Route, ...]  # in buffer order
    numel: int  # elements of the flat generation buffer
    #: (generation name, indices into ``pp_merge_ranks`` of the ranks that take it from here),
    #: in the order this rank publishes them.
    pp_publish: tuple[tuple[str, tuple[int, ...]], ...]
    #: (index into ``pp_merge_ranks``, that rank's published stream as (generation name this
    #: rank writes, or None to skip; elements)) for every peer this rank takes something from.
    pp_receive: tuple[tuple[int, tuple[tuple[Optional[str], int], ...]], ...]

    @property
    def tp_merge_size(self) -> int:
        return len(self.tp_merge_ranks)

    @property
    def pp_merge_size(self) -> int:
        return len(self.pp_merge_ranks)

    @property
    def own_routes(self) -> tuple[Route, ...]:
        """Routes this rank's own training parameters supply (restored from the buffer)."""
        return tuple(r for r in self.routes if r.src_stage == self.train_stage)


def _fixup(spec_fixup: Optional[str], tp_kind: str) -> str:
    if tp_kind == "replicated":
        return "none"
    return spec_fixup if spec_fixup in ("gate_up", "row_concat") else "column_concat"


def rank_table(plan: ReshardPlan, rank: int) -> RankTable:
    """The reshard table of ``rank`` (see the module docstring)."""
    if not 0 <= rank < plan.world_size:
        raise ReshardPlanError(f"rank {rank} outside world of {plan.world_size}")
    c = plan.train.coords(rank)
    tp, pp = c["tp"], c["pp"]
    pg = plan.gen_coord(rank)[1]
    s, p, L = plan.tp_ratio, plan.pp_ratio, plan.num_layers
    block = [pg * p + l for l in range(p)]  # training stages of this generation stage
    me = block.index(pp)
    routes, offset = [], 0
    publish: list[tuple[str, tuple[int, ...]]] = []
    streams: dict[int, list[tuple[str, bool]]] = {j: [] for j in range(p) if j != me}
    for pr in plan.params:
        if pg not in pr.gen_stages:
            continue
        spec = pr.spec
        gen_name = megatron_local_name(spec, plan.gen.pp, L, pg, plan.gen_split)
        sources = [source_stage(pr.train_stages, q, p) for q in block]
        src = sources[me]
        fixup = _fixup(spec.fixup, spec.tp_kind)
        via = (VIA_PP_MERGE if src != pp else
               VIA_TP_MERGE if fixup != "none" and s > 1 else VIA_COPY)
        routes.append(Route(gen_name, offset, pr.gen_shard_shape, src,
                            megatron_local_name(spec, plan.train.pp, L, src, plan.train_split), via, fixup))
        offset += math.prod(pr.gen_shard_shape)
        takers = tuple(j for j, q in enumerate(sources) if q == pp and j != me)
        if takers:
            publish.append((gen_name, takers))
        for j in streams:  # what peer j publishes, and whether this rank takes it
            if any(q == block[j] and k != j for k, q in enumerate(sources)):
                streams[j].append((gen_name, src == block[j]))
    numel = {r.gen_name: r.numel for r in routes}
    receive = tuple((j, tuple((n if taken else None, numel[n]) for n, taken in stream))
                    for j, stream in sorted(streams.items()) if any(t for _, t in stream))
    return RankTable(rank=rank, train_stage=pp, tp_slot=tp % s, tp_merge_ranks=plan.tp_merge_ranks(rank),
                     pp_merge_ranks=plan.pp_merge_ranks(rank), routes=tuple(routes), numel=offset,
                     pp_publish=tuple(publish), pp_receive=receive)


# ---- slice moves ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Move:
    """One slice landing in ``dst_rank``'s generation buffer (local copy when src == dst)."""

    param: str
    src_rank: int
    dst_rank: int
    dim: int
    src_offset: int
    dst_offset: int
    length: int
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class RankPlan:
    """One rank's train -> generation transition as slice moves between global ranks."""

    rank: int
    train_coord: tuple[int, int, int]  # (tp, pp, dp)
    gen_coord: tuple[int, int, int]  # (tp_g, pp_g, dp_g)
    micro_dp_rank: int
    micro_dp_group: tuple[int, ...]
    gen_tp_group: tuple[int, ...]
    gen_pp_group: tuple[int, ...]
    gen_offsets: dict[str, int]  # parameter -> byte offset in the flat generation buffer
    moves: tuple[Move, ...]  # every slice of the generation buffer, local ones included
    bytes_recv: int
    bytes_sent: int
    train_bytes: int
    gen_bytes: int
    scratch_bytes: int

    @property
    def extra_bytes(self) -> int:
        return self.gen_bytes - self.train_bytes


def rank_plan(plan: ReshardPlan, rank: int) -> RankPlan:
    """``rank``'s slice moves: every piece of every generation shard, and where it comes from."""
    if not 0 <= rank < plan.world_size:
        raise ReshardPlanError(f"rank {rank} outside world of {plan.world_size}")
    c = plan.train.coords(rank)
    tp, pp, dp = c["tp"], c["pp"], c["dp"]
    tg, pg, dg = plan.gen_coord(rank)
    s, p = plan.tp_ratio, plan.pp_ratio
    t, l = tp % s, pp % p
    offsets, moves, off = {}, [], 0
    for pr in plan.params:
        if pg not in pr.gen_stages:
            continue
        offsets[pr.name] = off
        off += pr.gen_shard_bytes
        src_stage = source_stage(pr.train_stages, pp, p)
        for pc in pr.pieces:
            src_tp = tp if pc.src_slot is None else tg * s + pc.src_slot
            moves.append(Move(pr.name, plan.train.rank_of(tp=src_tp, pp=src_stage, dp=dp), rank, pr.dim,
                              pc.src_offset, pc.dst_offset, pc.length, pc.nbytes))
    return RankPlan(
        rank=rank, train_coord=(tp, pp, dp), gen_coord=(tg, pg, dg), micro_dp_rank=l * s + t,
        micro_dp_group=plan.micro_dp_groups[(dp * plan.gen.pp + pg) * plan.gen.tp + tg],
        gen_tp_group=plan.gen_tp_groups[(dp * plan.train.pp + pp) * s + t],
        gen_pp_group=plan.gen_pp_groups[(dp * plan.train.tp + tp) * p + l],
        gen_offsets=offsets, moves=tuple(moves), bytes_recv=plan.bytes_recv[rank],
        bytes_sent=plan.bytes_sent[rank], train_bytes=plan.train_bytes[rank],
        gen_bytes=plan.gen_bytes[rank], scratch_bytes=plan.scratch_bytes[rank])


def send_moves(plan: ReshardPlan, rank: int) -> list[Move]:
    """Remote moves whose source is ``rank`` (all inside its micro-DP group)."""
    group = rank_plan(plan, rank).micro_dp_group
    return [mv for r in group if r != rank for mv in rank_plan(plan, r).moves
            if mv.src_rank == rank]
