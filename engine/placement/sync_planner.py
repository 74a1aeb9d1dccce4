"""Weight-sync planner: a model's shards in one layout on one pool -> another layout on another pool.

Pure arithmetic (no torch, no process groups), in the hybrid engine's plan -> execute style: the
executor (:mod:`hyflow.placement.weight_sync`) runs the :class:`SyncPlan`; tests run the plan on
numpy arrays.

Layouts are :class:`~hyflow.parallel.layout.Layout` values starting at their pool's first rank
(``Layout.start``; Megatron's rank order inside the pool, ``Layout.rank_of``). Per parameter
(:class:`~hyflow.hybrid.param_specs.ParamSpec`, global shape, how TP shards it, which stage holds
it) every destination rank needs the slice of its (tp, pp) coordinates; the planner cuts that slice into the runs held by the source layout's
shards and names one source rank for each run:

* **which source replica**: destination data-parallel replica ``j`` reads from source replica
  ``j mod DP_src`` (the load spreads over the source replicas);
* **which source shard**: along the shard dimension a TP shard ``k`` of ``K`` holds the contiguous
  run ``[k*D/K, (k+1)*D/K)``; a GLU ``linear_fc1`` shard holds two runs (its gate rows and its up
  rows, Megatron's ``[gate_k; up_k]``), so a destination shard of another TP is assembled from the
  gate runs and the up runs of the source shards that overlap it. Row-parallel weights run along
  dim 1, column / vocabulary ones along dim 0, grouped QKV whole query groups along dim 0;
* **which source stage**: the stage holding the layer (a tied embedding is read from the first
  stage, also for the destination's last-stage copy); replicated parameters (norms) whole, from the
  source rank at tp ``t_dst mod TP_src``.

Routed experts (:class:`~hyflow.hybrid.param_specs.ExpertSpec`) live on the source layout's expert
grid (``Layout.ep`` / ``etp``: expert ``e`` on the EP rank ``e // (E / EP)``, its FFN width split
over ETP); the destination holds every expert split over its TP (EP_g = 1). A destination rank's
columns of each expert come from the ETP shards that overlap them, on the source replica
``j mod EDP_src`` of the expert data-parallel ranks (``linear_fc1``: its gate rows and its up rows;
``linear_fc2``: columns).

Every element of every destination shard comes from exactly one piece, so the model crosses the
wire once per destination replica and each destination rank receives exactly its slice
(``bytes_recv[r] == shard_bytes[r]``; no rank receives or assembles a full copy). Pieces between
the same two ranks are packed into buckets of at most ``bucket_bytes`` (a larger piece travels
alone); bucket ``i`` of every rank pair runs in round ``i``, which bounds the staging memory of a
rank to one bucket per peer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

from hyflow.hybrid.param_specs import (ExpertSpec, ParamSpec, ReshardPlanError, expert_param_specs, gpt_param_specs,
                                       megatron_local_name, model_param_specs, stage_of_layer, stage_split)
from hyflow.parallel.layout import Layout, pad_vocab_size

DEFAULT_BUCKET_BYTES = 64 << 20


class SyncPlanError(ReshardPlanError):
    """A source / destination layout pair the weight sync cannot map."""


@dataclass(frozen=True)
class SyncPiece:
    """A run along ``dim`` of one parameter from ``src_rank``'s shard into ``dst_rank``'s shard."""

    name: str  # global name (spec name, global layer index)
    src_rank: int
    dst_rank: int
    src_name: str  # state-dict name on the source rank's stage
    dst_name: str  # ... on the destination rank's stage
    dim: int
    src_offset: int
    dst_offset: int
    length: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """Pieces from one rank to another, sent as one flat message."""

    src_rank: int
    dst_rank: int
    index: int  # its position among the pair's buckets = the round it runs in
    pieces: tuple[SyncPiece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class SyncPlan:
    """Who sends what to whom, and the bytes: the whole world's plan, or (``rank`` set) only the
    buckets ``rank`` sends or receives, the same buckets the whole plan has for it."""

    src: Layout
    dst: Layout
    buckets: tuple[Bucket, ...]
    model_bytes: int
    shard_bytes: dict = field(default_factory=dict)  # destination rank -> bytes of its slice
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    rank: Optional[int] = None
    _by_rank: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict = defaultdict(lambda: ([], [], []))  # rank -> (sends, receives, local)
        for b in self.buckets:
            if b.is_local:
                index[b.src_rank][2].append(b)
            else:
                index[b.src_rank][0].append(b)
                index[b.dst_rank][1].append(b)
        self._by_rank.update(index)

    @property
    def rounds(self) -> int:
        return 1 + max((b.index for b in self.buckets), default=-1)

    def sends(self, rank: int) -> list[Bucket]:
        return self._by_rank.get(rank, ([], [], []))[0]

    def recvs(self, rank: int) -> list[Bucket]:
        return self._by_rank.get(rank, ([], [], []))[1]

    def local(self, rank: int) -> list[Bucket]:
        return self._by_rank.get(rank, ([], [], []))[2]

    def bytes_recv(self, rank: int) -> int:
        """Bytes ``rank`` receives from other ranks (local copies excluded)."""
        return sum(b.nbytes for b in self.recvs(rank))

    def bytes_sent(self, rank: int) -> int:
        return sum(b.nbytes for b in self.sends(rank))

    @property
    def total_bytes(self) -> int:
        """Bytes over the wire, all ranks together."""
        return sum(b.nbytes for b in self.buckets if not b.is_local)

    @property
    def max_recv(self) -> int:
        return max((self.bytes_recv(r) for r in self.dst.ranks), default=0)

    @property
    def max_sent(self) -> int:
        return max((self.bytes_sent(r) for r in self.src.ranks), default=0)

    def summary(self) -> str:
        mib = 1 << 20
        return (f"weight sync {_describe(self.src)} -> {_describe(self.dst)}: {self.total_bytes / mib:.1f} MiB in "
                f"{len(self.buckets)} buckets over {self.rounds} rounds; per destination rank {self.max_recv / mib:.1f} "
                f"MiB (its slice), per source rank at most {self.max_sent / mib:.1f} MiB; model "
                f"{self.model_bytes / mib:.1f} MiB")


def _describe(layout: Layout) -> str:
    return f"tp={layout.tp} pp={layout.pp} dp={layout.dp} (ranks {layout.ranks[0]}-{layout.ranks[-1]})"


# ---- planning ----------------------------------------------------------------------------


def _segments(spec: ParamSpec, parts: int, index: int) -> list[tuple[int, int, int]]:
    """(global start, local start, length) runs along the shard dim held by shard ``index`` of ``parts``."""
    dim = spec.shard_dim
    size = spec.global_shape[dim]
    if spec.fixup == "gate_up":  # [gate_k; up_k]: two runs of the logical [gate; up]
        half = size // 2
        per = half // parts
        return [(index * per, 0, per), (half + index * per, per, per)]
    per = size // parts
    return [(index * per, 0, per)]


def _check(spec: ParamSpec, layout: Layout, who: str, num_layers: int) -> None:
    if layout.stage_layers is not None:
        if len(layout.stage_layers) != layout.pp or sum(layout.stage_layers) != num_layers:
            raise SyncPlanError(f"{who} stage split {list(layout.stage_layers)} does not fill pp={layout.pp} "
                                f"stages with num_layers={num_layers}")
    elif num_layers % layout.pp:
        raise SyncPlanError(f"{who} pp={layout.pp} does not divide num_layers={num_layers}")
    dim = spec.shard_dim
    if dim is None:
        return
    size = spec.global_shape[dim]
    units = spec.shard_units if spec.shard_units is not None else (size // 2 if spec.fixup == "gate_up" else size)
    if units % layout.tp or size % (2 * layout.tp if spec.fixup == "gate_up" else layout.tp):
        raise SyncPlanError(f"{spec.name}: {spec.unit_name or 'dim'} = {units} is not divisible by the {who} "
                            f"tp={layout.tp}")


def _row_bytes(spec: ParamSpec, dim: int) -> int:
    return spec.nbytes // spec.global_shape[dim]


def _expert_pieces(x: ExpertSpec, src: Layout, dst: Layout, num_layers: int, num_experts: int,
                   j: int) -> list[SyncPiece]:
    """Destination replica ``j``'s pieces of routed-expert weight ``x`` (see the module docstring)."""
    if num_experts % src.ep or x.ffn % src.expert_tp or x.ffn % dst.tp:
        raise SyncPlanError(f"{x.name}: {num_experts} experts of width {x.ffn} do not split over the source "
                            f"ep={src.ep} x etp={src.expert_tp} or the destination tp={dst.tp}")
    if dst.ep != 1 or dst.expert_tp != dst.tp:
        raise SyncPlanError("the weight sync's destination holds every expert (ep=1, etp=tp)")
    per = num_experts // src.ep
    q, qd = (stage_of_layer(x.layer, lay.pp, num_layers, lay.stage_layers) for lay in (src, dst))
    first_src = sum(stage_split(src.pp, num_layers, src.stage_layers)[:q])
    first_dst = sum(stage_split(dst.pp, num_layers, dst.stage_layers)[:qd])
    local = f"mlp.experts.local_experts.{{}}.linear_{x.kind}.weight"
    src_name = f"decoder.layers.{x.layer - first_src}." + local.format(x.expert % per)
    dst_name = f"decoder.layers.{x.layer - first_dst}." + local.format(x.expert)
    sw, dw = x.ffn // src.expert_tp, x.ffn // dst.tp
    row = x.hidden * x.dtype_bytes  # bytes per FFN index (a row of fc1's halves, a column of fc2)
    out = []
    for t in range(dst.tp):
        drank = dst.rank_of(tp=t, pp=qd, dp=j)
        for a in range(src.expert_tp):
            lo, hi = max(t * dw, a * sw), min((t + 1) * dw, (a + 1) * sw)
            if lo >= hi:
                continue
            srank = src.expert_rank_of(etp=a, ep=x.expert // per, edp=j % src.expert_dp, pp=q)
            halves = ((0, 0), (sw, dw)) if x.kind == "fc1" else ((0, 0),)
            for s0, d0 in halves:
                out.append(SyncPiece(x.name, srank, drank, src_name, dst_name, 0 if x.kind == "fc1" else 1,
                                     s0 + lo - a * sw, d0 + lo - t * dw, hi - lo, (hi - lo) * row))
    return out


def plan_weight_sync(specs: Iterable[ParamSpec], src: Layout, dst: Layout, num_layers: int,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, rank: Optional[int] = None,
                     experts: Iterable[ExpertSpec] = (), num_experts: int = 0) -> SyncPlan:
    """Plan the copy of a model from ``src`` (every replica holds it) into every replica of ``dst``.

    ``specs``: the model's parameters (:func:`hyflow.hybrid.param_specs.gpt_param_specs`, global
    layer indices, the same padded vocabulary on both sides); ``experts``: a mixture-of-experts
    model's routed experts (:func:`hyflow.hybrid.param_specs.expert_param_specs`, ``num_experts`` per
    layer). ``rank``: plan only what that rank sends and receives (its destination replica; as a
    source, the replicas it serves), the same pieces and buckets as the whole plan's for it: per-rank
    work bounded by the layout, not the world (the whole plan of the 1024-rank preset is 576K
    pieces). Raises :class:`SyncPlanError` for a layout that does not divide the model.
    """
    specs, experts = tuple(specs), tuple(experts)
    if bucket_bytes < 1:
        raise SyncPlanError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    for spec in specs:
        _check(spec, src, "source", num_layers)
        _check(spec, dst, "destination", num_layers)
    replicas: Iterable[int] = range(dst.dp)
    want = None
    if rank is not None:
        mine = set()
        if rank in dst.ranks:
            mine.add(dst.coords(rank)["dp"])
        if rank in src.ranks:
            mine.update(range(src.coords(rank)["dp"], dst.dp, src.dp))  # destination j reads source j mod DP_src
        replicas = sorted(mine)
        want = lambda s, d: rank in (s, d)  # noqa: E731
    pieces, shard_bytes = _pieces(specs, src, dst, num_layers, replicas, want, experts, num_experts)
    if rank is not None:
        shard_bytes = {d: n for d, n in shard_bytes.items() if d == rank}
    return SyncPlan(src=src, dst=dst, buckets=_buckets(pieces, bucket_bytes),
                    model_bytes=sum(sp.nbytes for sp in specs) + sum(x.nbytes for x in experts),
                    shard_bytes=shard_bytes, bucket_bytes=bucket_bytes, rank=rank)


def _pieces(specs: tuple[ParamSpec, ...], src: Layout, dst: Layout, num_layers: int,
            replicas: Iterable[int], want=None, experts: tuple[ExpertSpec, ...] = (),
            num_experts: int = 0) -> tuple[dict[tuple[int, int], list[SyncPiece]], dict[int, int]]:
    """The pieces of destination replicas ``replicas`` (in order) between rank pairs ``want(src, dst)``
    accepts (all when None), listed in one order (replica, parameter, stage, tp, run; then the routed
    experts) for every caller, so a pair's pieces and buckets do not depend on what else is planned."""
    pieces: dict[tuple[int, int], list[SyncPiece]] = defaultdict(list)
    shard_bytes: dict[int, int] = defaultdict(int)
    for j in replicas:
        sdp = j % src.dp
        for spec in specs:
            src_stage = spec.stages(src.pp, num_layers, src.stage_layers)[0]
            src_name = megatron_local_name(spec, src.pp, num_layers, src_stage, src.stage_layers)
            for q in spec.stages(dst.pp, num_layers, dst.stage_layers):
                dst_name = megatron_local_name(spec, dst.pp, num_layers, q, dst.stage_layers)
                for t in range(dst.tp):
                    drank = dst.rank_of(tp=t, pp=q, dp=j)
                    if spec.shard_dim is None:  # replicated: whole, from the source tp t mod TP_src
                        srank = src.rank_of(tp=t % src.tp, pp=src_stage, dp=sdp)
                        if want is None or want(srank, drank):
                            n = spec.global_shape[0] if spec.global_shape else 1
                            pieces[(srank, drank)].append(SyncPiece(spec.name, srank, drank, src_name, dst_name, 0,
                                                                    0, 0, n, spec.nbytes))
                            shard_bytes[drank] += spec.nbytes
                        continue
                    dim = spec.shard_dim
                    row = _row_bytes(spec, dim)
                    for g0, l0, n in _segments(spec, dst.tp, t):
                        for k in range(src.tp):
                            srank = src.rank_of(tp=k, pp=src_stage, dp=sdp)
                            if want is not None and not want(srank, drank):
                                continue
                            for h0, m0, m in _segments(spec, src.tp, k):
                                lo, hi = max(g0, h0), min(g0 + n, h0 + m)
                                if lo >= hi:
                                    continue
                                pieces[(srank, drank)].append(SyncPiece(
                                    spec.name, srank, drank, src_name, dst_name, dim, m0 + lo - h0, l0 + lo - g0,
                                    hi - lo, (hi - lo) * row))
                                shard_bytes[drank] += (hi - lo) * row
        for x in experts:
            for piece in _expert_pieces(x, src, dst, num_layers, num_experts, j):
                if want is None or want(piece.src_rank, piece.dst_rank):
                    pieces[(piece.src_rank, piece.dst_rank)].append(piece)
                    shard_bytes[piece.dst_rank] += piece.nbytes
    return pieces, dict(shard_bytes)


def _buckets(pieces: dict[tuple[int, int], list[SyncPiece]], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Each rank pair's pieces packed in order into buckets of at most ``bucket_bytes`` (a larger
    piece alone); bucket ``i`` of a pair runs in round ``i``."""
    buckets = []
    for (s, d), plist in sorted(pieces.items()):
        current: list[SyncPiece] = []
        size = index = 0
        for piece in plist:
            if current and size + piece.nbytes > bucket_bytes:
                buckets.append(Bucket(s, d, index, tuple(current)))
                current, size, index = [], 0, index + 1
            current.append(piece)
            size += piece.nbytes
        if current:
            buckets.append(Bucket(s, d, index, tuple(current)))
    buckets.sort(key=lambda b: (b.index, b.src_rank, b.dst_rank))
    return tuple(buckets)


@dataclass(frozen=True)
class SyncSummary:
    """The whole sync's numbers for ``hyflow plan`` and the run's first line, from one destination
    replica's plan (every replica receives the same slices; the source replica ``j mod DP_src``
    serves replica ``j``, so source replica 0 serves the most): exact for pools that do not overlap."""

    total_bytes: int
    buckets: int
    rounds: int
    max_recv: int
    max_sent: int
    max_shard_bytes: int
    max_peers: int  # sending peers of one destination rank
    model_bytes: int
    bucket_bytes: int
    src: Layout
    dst: Layout

    def summary(self) -> str:
        mib = 1 << 20
        return (f"weight sync {_describe(self.src)} -> {_describe(self.dst)}: {self.total_bytes / mib:.1f} MiB in {self.buckets} buckets over {self.rounds} rounds; per destination "
                f"rank {self.max_recv / mib:.1f} MiB (its slice), per source rank at most {self.max_sent / mib:.1f} "
                f"MiB; model {self.model_bytes / mib:.1f} MiB")


def summarize_weight_sync(specs: Iterable[ParamSpec], src: Layout, dst: Layout, num_layers: int,
                          bucket_bytes: int = DEFAULT_BUCKET_BYTES, experts: Iterable[ExpertSpec] = (),
                          num_experts: int = 0) -> SyncSummary:
    """:class:`SyncSummary` of :func:`plan_weight_sync` (pools that do not overlap), at the cost of
    planning one destination replica."""
    specs, experts = tuple(specs), tuple(experts)
    if set(src.ranks) & set(dst.ranks):
        raise SyncPlanError("summarize_weight_sync needs pools that do not overlap; plan the whole sync")
    for spec in specs:
        _check(spec, src, "source", num_layers)
        _check(spec, dst, "destination", num_layers)
    pieces, shard_bytes = _pieces(specs, src, dst, num_layers, [0], None, experts, num_experts)
    one = SyncPlan(src=src, dst=dst, buckets=_buckets(pieces, bucket_bytes),
                   model_bytes=sum(sp.nbytes for sp in specs) + sum(x.nbytes for x in experts),
                   shard_bytes=shard_bytes, bucket_bytes=bucket_bytes)
    served = -(-dst.dp // src.dp)  # replicas source replica 0 serves
    return SyncSummary(total_bytes=dst.dp * one.total_bytes, buckets=dst.dp * len(one.buckets), rounds=one.rounds,
                       max_recv=one.max_recv, max_sent=served * one.max_sent,
                       max_shard_bytes=max(shard_bytes.values(), default=0),
                       max_peers=max((len({b.src_rank for b in one.recvs(r)}) for r in dst.ranks), default=0),
                       model_bytes=one.model_bytes, bucket_bytes=bucket_bytes, src=src, dst=dst)


def model_experts(desc, dtype_bytes: int) -> dict:
    """``plan_weight_sync``'s ``experts`` / ``num_experts`` arguments for ``desc`` (none if dense)."""
    moe = getattr(desc, "moe", None)
    return {"experts": expert_param_specs(desc, dtype_bytes), "num_experts": moe.num_experts if moe else 0}


def model_specs(desc, padded_vocab: int, dtype_bytes: int, value_head: bool = False) -> list[ParamSpec]:
    """The parameters of ``desc``'s GPTModel (what the weight sync moves)."""
    specs = gpt_param_specs(desc.num_layers, desc.hidden_size, desc.num_attention_heads, desc.num_query_groups,
                            desc.head_dim, desc.ffn_hidden_size, padded_vocab,
                            tied_embeddings=desc.tied_embeddings, qkv_bias=desc.qkv_bias, dtype_bytes=dtype_bytes,
                            qk_layernorm=getattr(desc, "qk_layernorm", False), moe=getattr(desc, "moe", None))
    if value_head:
        raise SyncPlanError("the weight sync moves language models (no value head)")
    return specs




def bucket_rounds(plan: SyncPlan, rank: int) -> list[tuple[list[Bucket], list[Bucket]]]:
    """Per round, the buckets ``rank`` sends and receives (remote ones)."""
    out: list[tuple[list[Bucket], list[Bucket]]] = [([], []) for _ in range(plan.rounds)]
    for b in plan.sends(rank):
        out[b.index][0].append(b)
    for b in plan.recvs(rank):
        out[b.index][1].append(b)
    return out



def plan_actor_sync(placement, desc, dtype_bytes: int, *, fused_norms: bool = False,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, rank: Optional[int] = None) -> SyncPlan:
    """The plan of a pooled run (:class:`~hyflow.placement.config.Placement`): the actor's
    training pool -> the generation pool, vocabulary padded for the actor's tp on both sides;
    ``rank``: that rank's part only (what a job's rank plans)."""
    return plan_weight_sync(*_actor_sync(placement, desc, dtype_bytes, fused_norms), bucket_bytes=bucket_bytes,
                            rank=rank, **model_experts(desc, dtype_bytes))


def summarize_actor_sync(placement, desc, dtype_bytes: int, *, fused_norms: bool = False,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncSummary:
    """:func:`summarize_weight_sync` of :func:`plan_actor_sync`."""
    return summarize_weight_sync(*_actor_sync(placement, desc, dtype_bytes, fused_norms), bucket_bytes=bucket_bytes,
                                 **model_experts(desc, dtype_bytes))


def _actor_sync(placement, desc, dtype_bytes: int, fused_norms: bool):
    actor, gen = placement.roles["actor"], placement.roles["rollout"]
    specs = model_param_specs(desc, pad_vocab_size(desc.vocab_size, actor.layout.tp), dtype_bytes,
                              fused_norms=fused_norms)
    return specs, actor.layout, gen.layout, desc.num_layers
