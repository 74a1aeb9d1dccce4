"""The reshard plan: training layout (TP, PP, DP) -> generation layout (TP_g, PP_g, DP * d_g).

Pure arithmetic: no ``torch.distributed``, no process groups, no tensors. From a
:class:`ReshardPlan`, :func:`hyflow.hybrid.reshard_table.rank_table` derives the per-parameter
source/destination table one rank's executor runs (:mod:`hyflow.hybrid.executor`);
:mod:`hyflow.hybrid.generation_groups` the process groups; the tests run the plan in a simulation.

Rank mapping (CP = EP = 1)
--------------------------
Both layouts are :class:`~hyflow.parallel.layout.Layout` values (``ReshardPlan.train`` /
``.gen``). Training ranks are Megatron-ordered, tp fastest, then dp, then pp
(``train.rank_of`` / ``train.coords``, the one rank <-> coordinate mapping)::

    rank = pp * (DP * TP) + dp * TP + tp

The generation layout's ranks are the same ranks regrouped (not Megatron-ordered over the
world; its groups are listed by the plan), from the training coordinates:

Let ``s = TP / TP_g`` (training shards merged per generation shard) and ``p = PP / PP_g``
(training stages merged per generation stage). Inside one training model-parallel group
(the TP * PP ranks that share ``dp``) write ``tp = tp_g * s + t`` and ``pp = pp_g * p + l``
with ``0 <= t < s`` and ``0 <= l < p``. Then

* generation tp rank ``tp_g = tp // s``, generation pp rank ``pp_g = pp // p``;
* micro-DP rank ``m = l * s + t`` (tp fastest), micro-DP size ``d_g = s * p = TP*PP / (TP_g*PP_g)``;
* generation dp rank ``dp * d_g + m``, generation DP size ``DP * d_g``.

Groups, each a partition of all ranks:

* generation TP group: fixed (dp, pp, t), ``tp = g * s + t`` for ``g < TP_g`` -> stride ``s``;
* generation PP group: fixed (dp, tp, l), ``pp = k * p + l`` for ``k < PP_g`` -> stride ``p``;
* micro-DP group: fixed (dp, tp_g, pp_g): the ``s`` consecutive tp ranks x ``p`` consecutive stages.

Why one all-gather inside the micro-DP group is enough: the rank (pp, tp) must end up with the
generation shard ``tp_g`` of every parameter of generation stage ``pp_g``, i.e. of training
stages ``pp_g*p .. pp_g*p + p - 1``. Megatron's TP sharding of dim ``k`` into TP equal
contiguous chunks means generation chunk ``tp_g`` (TP_g chunks) is exactly training chunks
``tp_g*s .. tp_g*s + s - 1`` back to back. All those (stage, chunk) pairs are held by the
members of the micro-DP group, and the rank's own chunk ``tp`` sits at position ``t`` inside
its generation chunk, so its training shard is a slice of its generation shard (zero
redundancy). Two layouts need a fix-up after the gather:

* ``gate_up`` (GLU ``linear_fc1``, [2f, h]): training shard k is ``[gate_k; up_k]``, so the
  s gathered shards read ``[g0; u0; g1; u1; ..]`` and are de-interleaved into
  ``[g0; g1; ..; u0; u1; ..]``;
* ``row_concat`` (row-parallel, shard dim 1): the gather buffer is ``[s, h, k]`` and the
  generation shard is ``[h, s*k]``.

``qkv_grouped`` is Megatron's per-query-group ``[q_g; k_g; v_g]`` layout: TP shards whole groups,
so concatenation *is* the generation shard; the tag only tells the executor that an inference
engine wanting ``[q; k; v]`` must run ``qkv_regroup`` (see ``hyflow.kernels``).

The plan
--------
Per parameter (:class:`ParamReshard`, computed once) the planner lists :class:`SlicePiece` s:
training slot ``j`` of the tp block contributes rows ``[src_offset, +length)`` of its shard along
the shard dim, landing at ``[dst_offset, +length)`` of the generation shard (two pieces per slot
for ``gate_up``). A receiver takes every piece from its own training stage when that stage holds
the parameter, otherwise from the first holding stage of its generation stage; a replicated
parameter is copied whole from the source stage's rank at the receiver's own tp. Per rank
(:meth:`ReshardPlan.rank_plan`) the pieces become :class:`Move` s between global ranks, and the
generation buffer is the rank's generation-stage parameters in spec order, each shard contiguous.

Bytes and memory
----------------
For a fully TP-sharded model whose layers split evenly over stages, a rank needs
``M / (TP_g*PP_g)`` bytes and already holds ``M / (TP*PP)``, so it receives

    (TP*PP - TP_g*PP_g) / (TP_g*PP_g*TP*PP) * M        (``ReshardPlan.formula_bytes``)

and holds no more than ``M / (TP_g*PP_g)`` of actor weights. Summed over all ranks the formula is
exact for every TP-sharded parameter held on one stage; per rank, the stage-pinned embedding and
output layer and the replicated norms (a rank needs a full copy of another stage's norm) make the
exact numbers (``bytes_recv``/``bytes_sent``) deviate slightly, and the plan reports those. Extra
memory per rank is ``gen_bytes - train_bytes`` (the training shard lives inside the generation
buffer) plus ``scratch_bytes``: one generation shard of the largest ``gate_up``/``row_concat``
parameter, the gather buffer those out-of-place fix-ups need (only when TP_g < TP).

A tied embedding is held on the first and the last training stage (Megatron names the last
stage's copy ``output_layer.weight``) and needed on the first and last generation stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Optional, Sequence

from hyflow.hybrid.param_specs import (  # the model side of the plan, re-exported here
    ParamSpec, ReshardPlanError, gpt_param_specs, megatron_local_name, stage_split,
)
from hyflow.parallel.layout import Layout, LayoutError, merge_stage_layers

__all__ = [
    "ReshardPlanError", "ParamSpec", "SlicePiece",
    "ParamReshard", "ReshardPlan", "gpt_param_specs", "plan_reshard",
    "reshard_formula_bytes", "megatron_local_name", "source_stage", "staging_slot_bytes",
    "staging_bytes_per_rank", "TP_STAGING_SLOT", "PP_STAGING_SLOT", "STAGING_SLACK",
]

#: Slot size of the TP merge's staging (a bucket of this rank's shards per collective or per
#: shared-memory round).
TP_STAGING_SLOT = 64 << 20
#: Slot size of the PP merge's shared-memory exchange (two per rank, mapped by its peers too).
PP_STAGING_SLOT = 16 << 20
#: Room for the 64-byte alignment of pieces in a staging slot sized to a group's whole gather.
STAGING_SLACK = 64 * 1024
# Divisibility checks run in this order, so the message names the most fundamental unit.
_UNIT_ORDER = ("attention heads", "query groups", "ffn hidden size", "padded vocab size")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def source_stage(holders: Sequence[int], stage: int, p: int) -> int:
    """The training stage a rank of ``stage`` takes a parameter held by ``holders`` from: its
    own when it holds it, else the first holder among the ``p`` stages merged into its
    generation stage. The one place this rule is written."""
    if stage in holders:
        return stage
    return next(q for q in holders if q // p == stage // p)


def staging_slot_bytes(gather_bytes: int, slot_bytes: int) -> int:
    """Size of one staging slot for a rank that moves ``gather_bytes`` of its own: ``slot_bytes``,
    or less when everything fits (tiny models map tiny slots); 64-byte aligned, >= 4 KiB."""
    return max(min(slot_bytes, gather_bytes + STAGING_SLACK), 4096) // 64 * 64


def staging_bytes_per_rank(shard_bytes: int, s: int, slot_bytes: int = TP_STAGING_SLOT) -> int:
    """Shared-memory staging a CPU rank maps (its two slots and its ``s - 1`` peers'),
    when it moves ``shard_bytes`` of its own in a merge group of ``s``."""
    return 0 if s <= 1 else 2 * s * staging_slot_bytes(shard_bytes, slot_bytes)


@dataclass(frozen=True)
class SlicePiece:
    """A contiguous run along the shard dim: training slot ``src_slot`` -> generation shard.

    ``src_slot`` j is the position inside the tp block (training tp = tp_g * s + j); None for a
    replicated parameter (copied from the source stage's rank at the receiver's own tp).
    """

    src_slot: Optional[int]
    src_offset: int
    dst_offset: int
    length: int
    nbytes: int


@dataclass(frozen=True)
class ParamReshard:
    """Per-parameter plan, computed once and shared by every rank."""

    spec: ParamSpec
    dim: int  # dim the pieces run along (0 for replicated params)
    train_shard_shape: tuple[int, ...]
    gen_shard_shape: tuple[int, ...]
    train_stages: tuple[int, ...]
    gen_stages: tuple[int, ...]
    pieces: tuple[SlicePiece, ...]
    train_shard_bytes: int
    gen_shard_bytes: int

    @property
    def name(self) -> str:
        return self.spec.name


def reshard_formula_bytes(model_bytes: int, train: Any, gen: Any) -> Fraction:
    """Closed-form bytes received per rank: (TP*PP - TP_g*PP_g)/(TP_g*PP_g*TP*PP) * M."""
    t, g = train.tp * train.pp, gen.tp * gen.pp
    return Fraction((t - g) * model_bytes, g * t)


@dataclass(frozen=True)
class ReshardPlan:
    """The whole train -> generation reshard; per-rank lists are indexed by global rank.

    ``train``: the training layout (CP folded into DP, from rank 0); ``gen``: the generation
    layout's sizes (``dp`` = DP * micro-DP, ``stage_layers`` the merged training stages when they
    are uneven); its ranks are :meth:`gen_coord`'s regrouping, listed in the ``gen_*_groups``."""

    train: Layout
    gen: Layout
    num_layers: int
    params: tuple[ParamReshard, ...]
    gen_tp_groups: tuple[tuple[int, ...], ...]
    gen_pp_groups: tuple[tuple[int, ...], ...]
    micro_dp_groups: tuple[tuple[int, ...], ...]
    gen_dp_groups: tuple[tuple[int, ...], ...]
    bytes_recv: tuple[int, ...]
    bytes_sent: tuple[int, ...]
    train_bytes: tuple[int, ...]
    gen_bytes: tuple[int, ...]
    scratch_bytes: tuple[int, ...]
    model_bytes: int
    formula_bytes: Fraction
    _by_name: dict = field(default=None, repr=False, compare=False)
    #: of ``bytes_recv``, what comes from another training stage (the PP merge; the rest is the
    #: TP merge inside the stage)
    bytes_recv_pp: tuple[int, ...] = ()

    # ---- sizes -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.train.world_size

    @property
    def tp_ratio(self) -> int:
        return self.train.tp // self.gen.tp

    @property
    def pp_ratio(self) -> int:
        return self.train.pp // self.gen.pp

    @property
    def train_split(self) -> tuple[int, ...]:
        """Decoder layers per training stage."""
        return stage_split(self.train.pp, self.num_layers, self.train.stage_layers)

    @property
    def gen_split(self) -> tuple[int, ...]:
        """Decoder layers per generation stage: each merges ``pp_ratio`` consecutive training stages."""
        return merge_stage_layers(self.train_split, self.gen.pp)

    @property
    def micro_dp_size(self) -> int:
        return self.tp_ratio * self.pp_ratio

    @property
    def gen_dp_size(self) -> int:
        return self.gen.dp

    @property
    def extra_bytes(self) -> tuple[int, ...]:
        """Generation buffer minus the rank's own training shard (which lives inside it)."""
        return tuple(g - t for g, t in zip(self.gen_bytes, self.train_bytes))

    @property
    def peak_extra_bytes(self) -> int:
        """Largest per-rank extra memory, fix-up scratch included."""
        return max(e + s for e, s in zip(self.extra_bytes, self.scratch_bytes))

    @property
    def total_bytes_moved(self) -> int:
        return sum(self.bytes_recv)

    def param(self, name: str) -> ParamReshard:
        return self._by_name[name]

    # ---- coordinates -------------------------------------------------------------------
    def gen_coord(self, rank: int) -> tuple[int, int, int]:
        """(tp_g, pp_g, dp_g) of a global rank: its training coordinates regrouped (module docstring)."""
        c = self.train.coords(rank)
        (tg, t), (pg, l) = divmod(c["tp"], self.tp_ratio), divmod(c["pp"], self.pp_ratio)
        return tg, pg, c["dp"] * self.micro_dp_size + l * self.tp_ratio + t

    def tp_merge_ranks(self, rank: int) -> tuple[int, ...]:
        """The ``s`` ranks whose training shards form ``rank``'s generation shards, in shard order."""
        c = self.train.coords(rank)
        first = c["tp"] - c["tp"] % self.tp_ratio
        return tuple(self.train.rank_of(tp=first + t, pp=c["pp"], dp=c["dp"]) for t in range(self.tp_ratio))

    def pp_merge_ranks(self, rank: int) -> tuple[int, ...]:
        """The ``p`` ranks (same tp and dp) of the training stages merged into ``rank``'s
        generation stage, in stage order."""
        c = self.train.coords(rank)
        first = c["pp"] - c["pp"] % self.pp_ratio
        return tuple(self.train.rank_of(tp=c["tp"], pp=first + l, dp=c["dp"]) for l in range(self.pp_ratio))

    def summary(self) -> str:
        mib = 1 << 20
        return "\n".join([
            f"reshard TP={self.train.tp} PP={self.train.pp} DP={self.train.dp} -> "
            f"TP_g={self.gen.tp} PP_g={self.gen.pp} DP_g={self.gen_dp_size} "
            f"(micro-DP {self.micro_dp_size}, {self.world_size} ranks, {len(self.params)} params)",
            f"  model {self.model_bytes / mib:.1f} MiB; recv/rank max "
            f"{max(self.bytes_recv) / mib:.1f} MiB (formula {float(self.formula_bytes) / mib:.1f})",
            f"  total moved {self.total_bytes_moved / mib:.1f} MiB; peak extra/rank "
            f"{self.peak_extra_bytes / mib:.1f} MiB",
        ])


# ---- planning ----------------------------------------------------------------------------

def _sizes(x: Any) -> tuple[tuple[int, ...], Optional[tuple[int, ...]]]:
    """(tp, pp, dp) and the stage split (None: even) of a tuple or anything with ``.tp/.pp/.dp``."""
    split = None
    if isinstance(x, (tuple, list)):
        vals = tuple(int(v) for v in x) + (1,) * (3 - len(x))
    else:
        split = getattr(x, "stage_layers", None)
        vals = (int(x.tp), int(getattr(x, "pp", 1)), int(getattr(x, "dp", 1)))
        # The dense parameters do not depend on the expert grid (EP / ETP: routed experts reshard
        # through hyflow.hybrid.expert_exchange); CP folds into DP (the executor passes dp * cp).
        if getattr(x, "cp", 1) != 1:
            raise ReshardPlanError(f"cp={x.cp}: the reshard planner takes CP folded into DP; pass dp * cp as dp")
        if (getattr(x, "vpp", None) or 1) > 1:
            raise ReshardPlanError(f"vpp={x.vpp}: an interleaved pipeline puts non-consecutive "
                                   "layers on a stage; the planner needs consecutive stages")
    if any(v < 1 for v in vals):
        raise ReshardPlanError(f"parallel sizes must be >= 1, got {vals}")
    if split is not None and len(set(split)) == 1:
        split = None  # the even split
    return vals, tuple(split) if split else None


def _layout(tp: int, pp: int, dp: int, split: Optional[tuple[int, ...]]) -> Layout:
    try:
        return Layout(tp=tp, pp=pp, dp=dp, stage_layers=split)
    except LayoutError as e:
        raise ReshardPlanError(str(e)) from None


def _validate(params: Sequence[ParamSpec], train: Layout, TPg: int, PPg: int,
              world_size: int, num_layers: int) -> None:
    TP, PP, DP = train.tp, train.pp, train.dp
    if world_size != train.world_size:
        hint = (f"DP would be {world_size // (TP * PP)}" if world_size % (TP * PP) == 0
                else f"{world_size} is not a multiple of TP*PP={TP * PP}")
        raise ReshardPlanError(
            f"world_size={world_size} but training layout TP={TP} x PP={PP} x DP={DP} = "
            f"{train.world_size} ranks; pass the real world size or fix DP ({hint})")
    if TPg > TP:
        raise ReshardPlanError(
            f"generation TP_g={TPg} is larger than training TP={TP}: the hybrid engine only "
            f"merges training TP shards; pick TP_g from {_divisors(TP)}")
    if TP % TPg:
        raise ReshardPlanError(f"generation TP_g={TPg} does not divide training TP={TP}; "
                               f"pick TP_g from {_divisors(TP)}")
    if PPg > PP:
        raise ReshardPlanError(
            f"generation PP_g={PPg} is larger than training PP={PP}: the hybrid engine only "
            f"merges training stages; pick PP_g from {_divisors(PP)}")
    if PP % PPg:
        raise ReshardPlanError(f"generation PP_g={PPg} does not divide training PP={PP}; "
                               f"pick PP_g from {_divisors(PP)}")
    if num_layers and train.stage_layers is not None:
        stage_split(PP, num_layers, train.stage_layers)  # generation stages merge training stages
    elif num_layers:
        for what, n in (("generation PP_g", PPg), ("training PP", PP)):
            if num_layers % n:
                raise ReshardPlanError(
                    f"num_layers={num_layers} is not divisible by {what}={n}; stages must hold "
                    f"equal layer counts, pick a divisor of {num_layers} ({_divisors(num_layers)})")
    names = set()
    for spec in params:
        if spec.name in names:
            raise ReshardPlanError(f"duplicate parameter name {spec.name!r}")
        names.add(spec.name)
        if spec.layer is not None and not 0 <= spec.layer < num_layers:
            raise ReshardPlanError(f"{spec.name}: layer {spec.layer} outside 0..{num_layers - 1}")
    order = {u: i for i, u in enumerate(_UNIT_ORDER)}
    sharded = sorted((sp for sp in params if sp.shard_dim is not None),
                     key=lambda sp: order.get(sp.unit_name, len(order)))
    for spec in sharded:
        size = spec.global_shape[spec.shard_dim]
        units = spec.shard_units if spec.shard_units is not None else (
            size // 2 if spec.fixup == "gate_up" else size)
        what = spec.unit_name or f"rows along dim {spec.shard_dim}"
        for who, n in (("generation TP_g", TPg), ("training TP", TP)):
            if units % n:
                raise ReshardPlanError(
                    f"{spec.name}: {what} = {units} is not divisible by {who}={n}; choose a "
                    f"TP that divides {units} (or pad the model dimension)")
        if size % (2 * TP if spec.fixup == "gate_up" else TP):
            raise ReshardPlanError(f"{spec.name}: dim {spec.shard_dim} of size {size} cannot be "
                                   f"split into TP={TP} equal shards")


def _plan_param(spec: ParamSpec, train: Layout, gen: Layout,
                num_layers: int) -> ParamReshard:
    shape, dim = spec.global_shape, spec.shard_dim
    row_bytes = spec.nbytes // shape[dim if dim is not None else 0]  # bytes per index along dim
    if dim is None:
        pieces = (SlicePiece(None, 0, 0, shape[0], spec.nbytes),)
        tshape = gshape = shape
    else:
        s = train.tp // gen.tp
        tshape = shape[:dim] + (shape[dim] // train.tp,) + shape[dim + 1:]
        gshape = shape[:dim] + (shape[dim] // gen.tp,) + shape[dim + 1:]
        r = tshape[dim]
        if spec.fixup == "gate_up":  # [g_j; u_j] -> gate rows j*f, up rows s*f + j*f
            f = r // 2
            pieces = tuple(SlicePiece(j, h * f, h * s * f + j * f, f, f * row_bytes)
                           for j in range(s) for h in (0, 1))
        else:
            pieces = tuple(SlicePiece(j, 0, j * r, r, r * row_bytes) for j in range(s))
    tbytes = math.prod(tshape) * spec.dtype_bytes
    gbytes = tbytes * (train.tp // gen.tp if dim is not None else 1)
    tstages = spec.stages(train.pp, num_layers, train.stage_layers)
    gstages = tuple(sorted({q // (train.pp // gen.pp) for q in tstages}))
    return ParamReshard(spec, dim if dim is not None else 0, tshape, gshape, tstages, gstages,
                        pieces, tbytes, gbytes)


def plan_reshard(params: Iterable[ParamSpec], train: Any, gen: Any,
                 world_size: Optional[int] = None, num_layers: Optional[int] = None) -> ReshardPlan:
    """Plan the train -> generation reshard.

    ``train`` is ``(tp, pp, dp)`` or anything with ``.tp/.pp/.dp``; ``gen`` is ``(tp_g, pp_g)``
    or anything with ``.tp/.pp``. ``world_size`` defaults to ``tp*pp*dp``; ``num_layers`` to
    one more than the largest layer index. Raises :class:`ReshardPlanError` for impossible pairs.
    """
    params = tuple(params)
    (TP, PP, DP), train_split = _sizes(train)
    (TPg, PPg, _), _ = _sizes(gen)  # the generation DP follows from the training one
    train = _layout(TP, PP, DP, train_split)
    world = train.world_size if world_size is None else int(world_size)
    if num_layers is None:
        num_layers = 1 + max((sp.layer for sp in params if sp.layer is not None), default=-1)
    _validate(params, train, TPg, PPg, world, num_layers)
    s, p = TP // TPg, PP // PPg
    gen_split = merge_stage_layers(stage_split(PP, num_layers, train_split), PPg) if train_split else None
    gen = _layout(TPg, PPg, DP * s * p, gen_split)
    plans = tuple(_plan_param(sp, train, gen, num_layers) for sp in params)

    # Per-stage accounting: every number depends on the training stage only (TP shards are equal).
    recv, recv_pp, sent, held, gathered = [0] * PP, [0] * PP, [0] * PP, [0] * PP, [0] * PP
    gen_b = [0] * PPg
    for pr in plans:
        replicated = pr.spec.shard_dim is None
        for q in pr.train_stages:
            held[q] += pr.train_shard_bytes
            gathered[q] += 0 if replicated else pr.train_shard_bytes
        for j in pr.gen_stages:
            gen_b[j] += pr.gen_shard_bytes
            for q in range(j * p, (j + 1) * p):
                src = source_stage(pr.train_stages, q, p)
                if replicated:  # (q, t) gets a full copy from (src, t)
                    n = 0 if src == q else pr.gen_shard_bytes
                else:  # same stage: s-1 peer shards; other stage: all s shards of src
                    n = (s - 1 if src == q else s) * pr.train_shard_bytes
                recv[q] += n
                recv_pp[q] += 0 if src == q else n
                sent[src] += n
    # The bucketed TP-merge all-gather stages s slots of this stage's shards (collective path).
    scratch = [s * staging_slot_bytes(g, TP_STAGING_SLOT) if s > 1 else 0 for g in gathered]
    stage_of = [train.coords(r)["pp"] for r in range(world)]

    def ranks(vals: list[int], by_gen: bool = False) -> tuple[int, ...]:
        return tuple(vals[q // p] if by_gen else vals[q] for q in stage_of)

    rk = lambda tp, pp, dp: train.rank_of(tp=tp, pp=pp, dp=dp)  # noqa: E731
    gen_tp = tuple(tuple(rk(g * s + t, pp, dp) for g in range(TPg))
                   for dp in range(DP) for pp in range(PP) for t in range(s))
    gen_pp = tuple(tuple(rk(tp, k * p + l, dp) for k in range(PPg))
                   for dp in range(DP) for tp in range(TP) for l in range(p))
    micro = tuple(tuple(rk(tg * s + t, pg * p + l, dp) for l in range(p) for t in range(s))
                  for dp in range(DP) for pg in range(PPg) for tg in range(TPg))
    gen_dp = tuple(tuple(r for dp in range(DP) for r in micro[(dp * PPg + pg) * TPg + tg])
                   for pg in range(PPg) for tg in range(TPg))
    model_bytes = sum(sp.nbytes for sp in params)
    return ReshardPlan(
        train=train, gen=gen, num_layers=num_layers, params=plans, gen_tp_groups=gen_tp,
        gen_pp_groups=gen_pp, micro_dp_groups=micro, gen_dp_groups=gen_dp,
        bytes_recv=ranks(recv), bytes_sent=ranks(sent), train_bytes=ranks(held),
        gen_bytes=ranks(gen_b, True), scratch_bytes=ranks(scratch),
        model_bytes=model_bytes, formula_bytes=reshard_formula_bytes(model_bytes, train, gen),
        _by_name={pr.name: pr for pr in plans}, bytes_recv_pp=ranks(recv_pp))
