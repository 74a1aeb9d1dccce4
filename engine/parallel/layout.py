"""Parallel layouts: how a model's work is split over ranks.

A :class:`Layout` is a plain value (tp, pp, dp, cp, ep, etp, sequence parallel,
virtual pipeline stages, and the first global rank it occupies). It validates itself
against a world size and against model dimensions, and it is the one place that maps
ranks to coordinates and back, in Megatron-Core's default order ``tp-cp-ep-dp-pp``
(``RankGenerator``; tensor parallel ranks adjacent, pipeline stages furthest apart)::

    rank = start + tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

``start`` is 0 for a layout over the whole world (colocated roles, the hybrid engine's
training layout); a placement pool's layout starts at the pool's first rank, so the
weight sync's source and destination, the pools' process groups and ``hyflow plan`` read
global ranks off the same type (:meth:`Layout.at`).

Mixture-of-experts layers use a second grid over the same ranks (Megatron-Core's expert
grid): inside each pipeline stage the ``TP * CP * DP`` ranks are regrouped as expert tensor
parallel x expert parallel x expert data parallel::

    rank = start + etp_rank + ETP * (ep_rank + EP * (edp_rank + EDP * pp_rank)),  EDP = TP*CP*DP / (ETP*EP)

so ``ETP * EP`` must divide ``TP * CP * DP``. Attention and dense layers use the first grid,
the experts the second (each EP rank holds ``num_experts / EP`` experts, each split ``ETP`` ways).

Enumerating groups is pure arithmetic, so layouts for 1024 ranks are checked
without any process group; :mod:`hyflow.parallel.groups` turns the enumerations
into real groups. Two layouts over the same ranks (the actor's training and
generation layouts) are just two values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from hyflow.config import ConfigError


class LayoutError(ConfigError):
    """A layout that cannot work; the message names the numbers and the fix."""


class ModelDims(Protocol):
    """What a layout needs to know about a model (``ModelDescription`` has it; a mixture-of-experts
    model also has ``moe`` with ``num_experts`` and ``ffn_hidden_size``)."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int


def pad_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Smallest size >= ``vocab_size`` divisible by ``divisible_by * tp``.

    Megatron shards the embedding and output layer by vocabulary rows, so every
    TP rank must get the same number; padded rows are zero and never sampled.
    """
    if vocab_size <= 0:
        raise LayoutError(f"vocab_size must be positive, got {vocab_size}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class Layout:
    """A parallel layout for one model role.

    Attributes:
        tp: tensor-parallel size (splits heads, FFN and vocabulary).
        pp: pipeline-parallel size (splits layers into consecutive stages).
        dp: data-parallel size (replicas; gradients are reduced over them).
        cp: context-parallel size (splits the sequence inside attention).
        ep: expert-parallel size (mixture-of-experts models): each EP rank holds ``num_experts / ep``
            experts of every MoE layer; tokens travel to their experts by all-to-all.
        etp: expert tensor-parallel size: each expert's weights split ``etp`` ways (null = tp,
            Megatron-Core's default). ``etp * ep`` must divide ``tp * cp * dp``.
        sequence_parallel: shard activations along the sequence inside TP regions.
        vpp: virtual pipeline stages per rank (interleaved 1F1B); None disables.
        stage_layers: decoder layers per pipeline stage, first to last (Megatron-Core's form: any
            first and last count, the middle stages equal). None: the job chooses (the actor: the
            split balanced by ``hyflow plan``'s cost model; code that reads a layout with None
            builds the even split).
        start: the first global rank of the layout's ranks ``[start, start + world_size)``; 0 in
            configs (a placement pool's layout starts at the pool's first rank).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = field(default=None, metadata={
        "help": "expert tensor parallel size (null = tp); etp * ep must divide tp * cp * dp"})
    sequence_parallel: bool = False
    vpp: Optional[int] = None
    stage_layers: Optional[list[int]] = field(default=None, metadata={
        "help": "decoder layers per pipeline stage, e.g. [13, 17]; null = balanced automatically for the actor "
                "(the last stage also carries the output layer; `hyflow plan` shows the split), even elsewhere. "
                "Megatron-Core's form: any first and last stage counts, the middle stages equal"})
    start: int = field(default=0, metadata={
        "help": "first global rank of the layout (leave 0: placement.pools set it to the role's pool)"})

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"layout.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise LayoutError(f"layout.start must be a rank >= 0, got {self.start!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 1):
            raise LayoutError(f"layout.etp must be a positive integer or null (= tp), got {self.etp!r}")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError(
                "layout.sequence_parallel=true needs tp > 1 (it shards activations across "
                "the tensor-parallel group); set sequence_parallel=false or raise tp"
            )
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise LayoutError(f"layout.vpp must be a positive integer or null, got {self.vpp!r}")
            if self.vpp > 1 and self.pp == 1:
                raise LayoutError(
                    f"layout.vpp={self.vpp} (interleaved pipeline) needs pp > 1; "
                    "set vpp=null or raise pp"
                )
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # frozen, hashable
            check_stage_layers(self.stage_layers, self.pp, vpp=self.vpp)

    # ----------------------------------------------------------------- sizes
    @property
    def world_size(self) -> int:
        """Number of ranks the layout occupies."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def ranks(self) -> range:
        """The global ranks the layout occupies, ``[start, start + world_size)``."""
        return range(self.start, self.start + self.world_size)

    def cp_as_dp(self) -> "Layout":
        """The layout as its weights see it: CP ranks hold the same weight shards and, in Megatron's
        order (tp-cp-dp-pp), sit where the ranks of tp x (cp * dp) x pp would, so for the weights CP
        is more data parallelism (the hybrid engine's reshard, ``hyflow plan``'s)."""
        return dataclasses.replace(self, dp=self.dp * self.cp, cp=1)

    def at(self, start: int) -> "Layout":
        """This layout on the ranks from ``start`` on (a placement pool's first rank)."""
        return dataclasses.replace(self, start=start)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one complete copy of the model (tp * pp)."""
        return self.tp * self.pp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (``etp``, or ``tp`` when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: replicas of each expert shard in a pipeline stage."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def has_experts_split(self) -> bool:
        """Whether the expert grid differs from the dense one (ep > 1 or etp != tp)."""
        return self.ep > 1 or self.expert_tp != self.tp

    def with_dp_for(self, world_size: int) -> "Layout":
        """This layout with ``dp`` chosen to fill a world of ``world_size`` ranks (from rank 0)."""
        self._check_starts_at_zero()
        per_replica = self.tp * self.pp * self.cp
        if world_size % per_replica:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {per_replica}; choose a world size that is a "
                f"multiple of {per_replica} or change tp/pp/cp"
            )
        out = dataclasses.replace(self, dp=world_size // per_replica)
        out.check_expert_grid()
        return out

    # ------------------------------------------------------------ validation
    def check_world(self, world_size: int) -> None:
        """Raise unless the layout covers exactly the ``world_size`` ranks of a world."""
        self._check_starts_at_zero()
        if self.world_size != world_size:
            raise LayoutError(
                f"layout tp={self.tp} x cp={self.cp} x dp={self.dp} x pp={self.pp} = "
                f"{self.world_size} ranks, but the job has {world_size}; make the product equal "
                "the number of launched processes"
            )
        self.check_expert_grid()

    def _check_starts_at_zero(self) -> None:
        if self.start:
            raise LayoutError(f"layout.start={self.start}: a layout over the whole world starts at rank 0 (the "
                              "placement sets start for a pool's layout); leave layout.start unset")

    def check_expert_grid(self) -> None:
        """Raise unless ``etp * ep`` divides the ``tp * cp * dp`` ranks of a pipeline stage."""
        block = self.tp * self.cp * self.dp
        if block % (self.expert_tp * self.ep):
            raise LayoutError(
                f"layout.ep={self.ep} x etp={self.expert_tp} = {self.ep * self.expert_tp} ranks per expert replica "
                f"do not divide the tp x cp x dp = {self.tp} x {self.cp} x {self.dp} = {block} ranks of a "
                f"pipeline stage; choose ep * etp dividing {block} (more ranks or a smaller ep)")

    def check_model(self, model: ModelDims, seq_length: Optional[int] = None, training: bool = True) -> None:
        """Raise unless the model's dimensions split evenly under this layout (``training``: also
        what Megatron-Core needs to train it, not only to run it)."""
        m = model
        if m.num_attention_heads % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide num_attention_heads={m.num_attention_heads}; "
                f"use a tp that divides {m.num_attention_heads}"
            )
        if self.cp > 1 and m.num_attention_heads % (self.tp * self.cp):
            raise LayoutError(
                f"cp={self.cp}: context parallelism gives each of the tp x cp = {self.tp} x {self.cp} "
                f"= {self.tp * self.cp} ranks of a model replica a share of the "
                f"num_attention_heads={m.num_attention_heads} heads inside attention; use tp and cp "
                f"whose product divides {m.num_attention_heads}"
            )
        if m.num_query_groups % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide the {m.num_query_groups} key/value groups "
                f"(num_query_groups); with grouped-query attention tp must divide "
                f"{m.num_query_groups}"
            )
        moe = getattr(m, "moe", None)
        if moe is None and self.has_experts_split:
            raise LayoutError(
                f"layout.ep={self.ep} etp={self.etp}: expert parallelism needs a mixture-of-experts model "
                "(model.moe); this model is dense, so set ep=1 and etp=null")
        if moe is None and m.ffn_hidden_size % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide ffn_hidden_size={m.ffn_hidden_size}"
            )
        if moe is not None:
            if moe.num_experts % self.ep:
                raise LayoutError(
                    f"layout.ep={self.ep} does not divide the {moe.num_experts} experts (model.moe.num_experts); "
                    f"every EP rank holds the same number of experts: use an ep dividing {moe.num_experts}")
            if moe.ffn_hidden_size % self.expert_tp:
                raise LayoutError(
                    f"layout.etp={self.expert_tp} does not divide the expert ffn_hidden_size={moe.ffn_hidden_size} "
                    f"(model.moe.ffn_hidden_size); use an etp dividing it")
            shared = moe.shared_expert_ffn_hidden_size
            if shared and shared % self.tp:
                raise LayoutError(f"tp={self.tp} does not divide the shared expert's ffn_hidden_size={shared}")
            if training and self.tp > 1 and not self.sequence_parallel:
                raise LayoutError(
                    f"tp={self.tp} with a mixture-of-experts model needs layout.sequence_parallel=true "
                    "(Megatron-Core's MoE layers train under tensor parallelism only with sequence parallelism)")
        if self.stage_layers is not None:
            check_stage_layers(self.stage_layers, self.pp, m.num_layers, self.vpp)
        elif m.num_layers % (self.pp * (self.vpp or 1)):
            stages = self.pp * (self.vpp or 1)
            what = f"pp={self.pp}" + (f" x vpp={self.vpp}" if self.vpp else "")
            raise LayoutError(
                f"{what} = {stages} pipeline stages do not divide num_layers={m.num_layers}; "
                f"choose pp (x vpp) dividing {m.num_layers}"
                + ("" if self.vpp else " or set layout.stage_layers (e.g. "
                   f"{list(even_stage_layers(m.num_layers, self.pp, strict=False))})")
            )
        if self.cp > 1 and seq_length is not None and seq_length % (2 * self.cp):
            raise LayoutError(
                f"cp={self.cp} needs the sequence length ({seq_length}) divisible by 2*cp = "
                f"{2 * self.cp}"
            )
        if self.sequence_parallel and seq_length is not None and seq_length % self.tp:
            raise LayoutError(
                f"sequence_parallel with tp={self.tp} needs the sequence length ({seq_length}) "
                f"divisible by {self.tp}"
            )

    # --------------------------------------------------------- pipeline stages
    def layers_per_stage(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers of each pipeline stage: ``stage_layers``, else the even split."""
        if self.stage_layers is not None:
            check_stage_layers(self.stage_layers, self.pp, num_layers, self.vpp)
            return self.stage_layers
        return even_stage_layers(num_layers, self.pp)

    def first_layer(self, stage: int, num_layers: int) -> int:
        """Global index of pipeline stage ``stage``'s first decoder layer (no virtual stages)."""
        return sum(self.layers_per_stage(num_layers)[:stage])

    def megatron_stage_kwargs(self, num_layers: int) -> dict[str, int]:
        """``TransformerConfig`` arguments of an uneven split (none for the even one)."""
        split = self.layers_per_stage(num_layers)
        if self.pp == 1 or len(set(split)) == 1:
            return {}
        return {"num_layers_in_first_pipeline_stage": split[0], "num_layers_in_last_pipeline_stage": split[-1]}

    # ---------------------------------------------------------- rank algebra
    # The one rank <-> coordinate mapping of hyflow (tests/test_layout.py fails on a second one).
    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank of the given coordinates."""
        return self.start + tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates ``{tp, cp, dp, pp}`` of a global rank."""
        local = rank - self.start
        if not 0 <= local < self.world_size:
            raise LayoutError(f"rank {rank} outside the layout's ranks {self.start}-{self.start + self.world_size - 1}")
        tp, rest = local % self.tp, local // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def groups(self, kind: str) -> list[list[int]]:
        """Rank groups of one kind (global ranks), each sorted, together covering the layout's ranks.

        ``kind`` is one of ``tp, cp, dp, pp, mp (tp x pp), tp_cp, dp_cp, tp_dp_cp (the ranks of
        one pipeline stage), embd, pos_embd``. ``embd`` holds the first and last pipeline stage of each
        pipeline group (they share tied embeddings); ``pos_embd`` the first.
        """
        axes = {
            "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
            "mp": ("tp", "pp"), "tp_cp": ("tp", "cp"), "dp_cp": ("cp", "dp"), "tp_dp_cp": ("tp", "cp", "dp"),
        }
        if kind in ("embd", "pos_embd"):
            out = []
            for ranks in self.groups("pp"):
                if kind == "pos_embd":
                    out.append([ranks[0]])
                else:
                    out.append(sorted({ranks[0], ranks[-1]}))
            return out
        if kind not in axes:
            raise LayoutError(f"unknown group kind {kind!r}; one of {sorted(axes) + ['embd', 'pos_embd']}")
        varying = axes[kind]
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        fixed = [a for a in ("tp", "cp", "dp", "pp") if a not in varying]
        result: list[list[int]] = []
        for fixed_coords in _product([sizes[a] for a in fixed]):
            base = dict(zip(fixed, fixed_coords))
            members = []
            for var_coords in _product([sizes[a] for a in varying]):
                members.append(self.rank_of(**base, **dict(zip(varying, var_coords))))
            result.append(sorted(members))
        return sorted(result)

    def expert_rank_of(self, etp: int = 0, ep: int = 0, edp: int = 0, pp: int = 0) -> int:
        """Global rank of expert-grid coordinates (etp fastest, then ep, edp, pp)."""
        return self.start + etp + self.expert_tp * (ep + self.ep * edp) + self.tp * self.cp * self.dp * pp

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Coordinates ``{etp, ep, edp, pp}`` of a global rank in the expert grid."""
        pp = self.coords(rank)["pp"]
        within = (rank - self.start) % (self.tp * self.cp * self.dp)
        etp, rest = within % self.expert_tp, within // self.expert_tp
        return {"etp": etp, "ep": rest % self.ep, "edp": rest // self.ep, "pp": pp}

    def expert_groups(self, kind: str) -> list[list[int]]:
        """Rank groups of the expert grid, as Megatron-Core builds them: ``ep``, ``etp``, ``edp``,
        ``tp_ep`` (etp x ep: the ranks holding one copy of a stage's experts), ``tp_ep_pp``."""
        axes = {"ep": ("ep",), "etp": ("etp",), "edp": ("edp",), "tp_ep": ("etp", "ep"),
                "tp_ep_pp": ("etp", "ep", "pp")}
        if kind not in axes:
            raise LayoutError(f"unknown expert group kind {kind!r}; one of {sorted(axes)}")
        sizes = {"etp": self.expert_tp, "ep": self.ep, "edp": self.expert_dp, "pp": self.pp}
        order = ("etp", "ep", "edp", "pp")
        varying = axes[kind]
        fixed = [a for a in order if a not in varying]
        result = []
        for fixed_coords in _product([sizes[a] for a in fixed]):
            base = dict(zip(fixed, fixed_coords))
            result.append(sorted(self.expert_rank_of(**base, **dict(zip(varying, v)))
                                 for v in _product([sizes[a] for a in varying])))
        return sorted(result)

    def describe(self) -> str:
        """One-line human summary, e.g. ``tp=2 pp=2 dp=1 (4 ranks, sp)``."""
        extra = []
        if self.cp > 1:
            extra.append(f"cp={self.cp}")
        if self.ep > 1 or self.etp is not None:
            extra.append(f"ep={self.ep} etp={self.expert_tp}")
        if self.sequence_parallel:
            extra.append("sp")
        if self.vpp:
            extra.append(f"vpp={self.vpp}")
        if self.stage_layers is not None and self.pp > 1:
            extra.append("stages " + "/".join(map(str, self.stage_layers)))
        tail = ", ".join([f"{self.world_size} ranks"] + extra)
        return f"tp={self.tp} pp={self.pp} dp={self.dp} ({tail})"


def even_stage_layers(num_layers: int, pp: int, strict: bool = True) -> tuple[int, ...]:
    """``num_layers`` split evenly over ``pp`` stages (``strict=False``: the nearest split in
    Megatron-Core's form, the remainder on the first stage, for error messages)."""
    if num_layers % pp == 0:
        return (num_layers // pp,) * pp
    if strict:
        raise LayoutError(f"pp={pp} pipeline stages do not divide num_layers={num_layers}; set "
                          "layout.stage_layers or choose a pp dividing the layers")
    per = num_layers // pp
    return (num_layers - per * (pp - 1),) + (per,) * (pp - 1)


def check_stage_layers(split: Sequence[int], pp: int, num_layers: Optional[int] = None,
                       vpp: Optional[int] = None) -> None:
    """Raise unless ``split`` is a stage split Megatron-Core builds: ``pp`` positive counts
    (summing to ``num_layers`` when given), the middle stages equal, no virtual stages."""
    split = list(split)
    shown = f"layout.stage_layers={split}"
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in split):
        raise LayoutError(f"{shown}: every pipeline stage needs a positive whole number of layers")
    if len(split) != pp:
        raise LayoutError(f"{shown} lists {len(split)} stage(s) but pp={pp}; give one count per pipeline stage "
                          "or leave it null (automatic)")
    if num_layers is not None and sum(split) != num_layers:
        raise LayoutError(f"{shown} sums to {sum(split)} layers but the model has num_layers={num_layers}; "
                          "the counts must add up to the model's layers (or leave it null: automatic)")
    if len(set(split[1:-1])) > 1:
        raise LayoutError(f"{shown}: Megatron-Core splits layers as first stage, equal middle stages, last "
                          f"stage; the middle stages {split[1:-1]} differ")
    if vpp and vpp > 1 and len(set(split)) > 1:
        raise LayoutError(f"{shown} with vpp={vpp}: an uneven split is not supported with the interleaved "
                          "pipeline; set stage_layers=null or vpp=null")


def merge_stage_layers(split: Sequence[int], pp: int) -> tuple[int, ...]:
    """The split of ``pp`` stages each merging consecutive stages of ``split`` (the hybrid
    engine's generation stages); a split of Megatron-Core's form stays in that form."""
    if len(split) % pp:
        raise LayoutError(f"pp={pp} does not divide the {len(split)} stages of {list(split)}")
    r = len(split) // pp
    return tuple(sum(split[i * r:(i + 1) * r]) for i in range(pp))


def _product(sizes: list[int]):
    """Cartesian product of ranges, first axis fastest."""
    if not sizes:
        yield ()
        return
    for rest in _product(sizes[1:]):
        for i in range(sizes[0]):
            yield (i,) + rest
