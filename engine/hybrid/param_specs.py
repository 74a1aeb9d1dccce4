"""What the resharding planner knows about a model: one :class:`ParamSpec` per parameter (global
shape, how tensor parallelism shards it, which pipeline stage holds it, which layout fix-up it
needs), and the list of a Megatron-Core ``GPTModel``'s parameters. Pure data, no torch."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["ReshardPlanError", "ParamSpec", "gpt_param_specs", "model_param_specs", "ExpertSpec", "expert_param_specs",
           "megatron_local_name", "stage_split", "stage_of_layer", "TP_KINDS", "FIXUPS", "PP_STAGES"]

TP_KINDS = ("column", "row", "vocab", "replicated")
FIXUPS = (None, "gate_up", "row_concat", "qkv_grouped")
PP_STAGES = ("first", "last", "first_and_last")


class ReshardPlanError(ValueError):
    """A training/generation layout pair the hybrid engine cannot reshard between."""


def stage_split(pp: int, num_layers: int, split: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Layers per pipeline stage: ``split`` (checked), else the even split."""
    if split is None:
        if num_layers % pp:
            raise ReshardPlanError(f"pp={pp} does not divide num_layers={num_layers} and no stage split was given")
        return (num_layers // pp,) * pp
    split = tuple(int(n) for n in split)
    if len(split) != pp or sum(split) != num_layers or min(split) < 1:
        raise ReshardPlanError(f"stage split {list(split)} does not fill pp={pp} stages with {num_layers} layers")
    return split


def stage_of_layer(layer: int, pp: int, num_layers: int, split: Optional[Sequence[int]] = None) -> int:
    """The pipeline stage holding global decoder layer ``layer``."""
    end = 0
    for stage, n in enumerate(stage_split(pp, num_layers, split)):
        end += n
        if layer < end:
            return stage
    raise ReshardPlanError(f"layer {layer} outside 0..{num_layers - 1}")


@dataclass(frozen=True)
class ParamSpec:
    """One model parameter as the planner sees it.

    ``global_shape`` is the unsharded shape. ``layer`` is the GLOBAL layer index for decoder
    parameters; non-layer parameters set ``pp_stage`` instead ("first", "last", or
    "first_and_last" for a tied embedding, which Megatron keeps on both ends when PP > 1).
    ``shard_units`` counts the indivisible units along the shard dim (heads, query groups, ffn
    rows, vocab rows) and ``unit_name`` names them in error messages.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype_bytes: int = 2
    tp_kind: str = "replicated"
    fixup: Optional[str] = None
    layer: Optional[int] = None
    pp_stage: Optional[str] = None
    shard_units: Optional[int] = None
    unit_name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(x) for x in self.global_shape))
        if self.tp_kind not in TP_KINDS:
            raise ReshardPlanError(f"{self.name}: tp_kind {self.tp_kind!r} not in {TP_KINDS}")
        if self.fixup not in FIXUPS:
            raise ReshardPlanError(f"{self.name}: fixup {self.fixup!r} not in {FIXUPS}")
        if (self.layer is None) == (self.pp_stage is None):
            raise ReshardPlanError(f"{self.name}: set exactly one of layer= or pp_stage=")
        if self.pp_stage is not None and self.pp_stage not in PP_STAGES:
            raise ReshardPlanError(f"{self.name}: pp_stage {self.pp_stage!r} not in {PP_STAGES}")
        need = {"gate_up": "column", "qkv_grouped": "column", "row_concat": "row"}.get(self.fixup)
        if need is not None and self.tp_kind != need:
            raise ReshardPlanError(f"{self.name}: fixup {self.fixup!r} needs tp_kind {need!r}")
        shape, dim = self.global_shape, self.shard_dim
        if dim is not None and len(shape) <= dim:
            raise ReshardPlanError(f"{self.name}: shape {shape} has no dim {dim}")
        if self.fixup == "gate_up" and shape[0] % 2:
            raise ReshardPlanError(f"{self.name}: gate_up dim 0 ({shape[0]}) must be even")

    @property
    def shard_dim(self) -> Optional[int]:
        """Dim TP shards along: 0 for column/vocab, 1 for row, None when replicated."""
        return {"column": 0, "vocab": 0, "row": 1}.get(self.tp_kind)

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype_bytes

    def stages(self, pp: int, num_layers: int, split: Optional[Sequence[int]] = None) -> tuple[int, ...]:
        """Pipeline stages (out of ``pp``) that hold this parameter; ``split``: layers per stage
        (default even)."""
        if self.layer is not None:
            return (stage_of_layer(self.layer, pp, num_layers, split),)
        return {"first": (0,), "last": (pp - 1,)}.get(self.pp_stage, tuple(sorted({0, pp - 1})))


def gpt_param_specs(num_layers: int, hidden: int, num_heads: int, num_query_groups: int,
                    head_dim: int, ffn_hidden: int, padded_vocab: int, *,
                    tied_embeddings: bool = False, qkv_bias: bool = False, dtype_bytes: int = 2,
                    gated_mlp: bool = True, qk_layernorm: bool = False,
                    fused_norms: bool = False, moe: Any = None) -> list[ParamSpec]:
    """Megatron-Core ``GPTModel`` parameters (GLOBAL layer indices). Names follow Megatron's local
    layer spec, or with ``fused_norms`` Transformer Engine's, whose layer norms live inside the
    following linear layers (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).

    ``moe`` (a :class:`~hyflow.models.description.MoEDescription`): every layer's MLP is a
    mixture of experts; its router, shared expert and shared-expert gate are listed here (TP-sharded
    like a dense MLP, or replicated), its routed experts are not: they live on the expert grid and
    reshard through :mod:`hyflow.hybrid.expert_exchange` (:func:`expert_param_specs`)."""
    qkv_rows = (num_heads + 2 * num_query_groups) * head_dim
    fc1_rows = 2 * ffn_hidden if gated_mlp else ffn_hidden
    vocab = dict(tp_kind="vocab", shard_units=padded_vocab, unit_name="padded vocab size")
    out = [ParamSpec("embedding.word_embeddings.weight", (padded_vocab, hidden), dtype_bytes,
                     pp_stage="first_and_last" if tied_embeddings else "first", **vocab)]
    qkv = dict(tp_kind="column", fixup="qkv_grouped", shard_units=num_query_groups,
               unit_name="query groups")
    for i in range(num_layers):
        pre = f"decoder.layers.{i}."
        rep = dict(tp_kind="replicated", layer=i)
        norm1, norm2 = (("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
                        if fused_norms else ("input_layernorm.weight", "pre_mlp_layernorm.weight"))
        out.append(ParamSpec(pre + norm1, (hidden,), dtype_bytes, **rep))
        out.append(ParamSpec(pre + "self_attention.linear_qkv.weight", (qkv_rows, hidden),
                             dtype_bytes, layer=i, **qkv))
        if qkv_bias:
            out.append(ParamSpec(pre + "self_attention.linear_qkv.bias", (qkv_rows,),
                                 dtype_bytes, layer=i, **qkv))
        if qk_layernorm:
            for n in ("q_layernorm", "k_layernorm"):
                out.append(ParamSpec(pre + f"self_attention.{n}.weight", (head_dim,),
                                     dtype_bytes, **rep))
        out.append(ParamSpec(pre + "self_attention.linear_proj.weight",
                             (hidden, num_heads * head_dim), dtype_bytes, tp_kind="row",
                             fixup="row_concat", layer=i, shard_units=num_heads,
                             unit_name="attention heads"))
        if moe is not None:  # the norm stays a module of its own before a MoE layer
            out.append(ParamSpec(pre + "pre_mlp_layernorm.weight", (hidden,), dtype_bytes, **rep))
            out.extend(_moe_dense_specs(pre, i, hidden, moe, dtype_bytes))
            continue
        out.append(ParamSpec(pre + norm2, (hidden,), dtype_bytes, **rep))
        out.append(ParamSpec(pre + "mlp.linear_fc1.weight", (fc1_rows, hidden), dtype_bytes,
                             tp_kind="column", fixup="gate_up" if gated_mlp else None, layer=i,
                             shard_units=ffn_hidden, unit_name="ffn hidden size"))
        out.append(ParamSpec(pre + "mlp.linear_fc2.weight", (hidden, ffn_hidden), dtype_bytes,
                             tp_kind="row", fixup="row_concat", layer=i,
                             shard_units=ffn_hidden, unit_name="ffn hidden size"))
    out.append(ParamSpec("decoder.final_layernorm.weight", (hidden,), dtype_bytes,
                         pp_stage="last"))
    if not tied_embeddings:
        out.append(ParamSpec("output_layer.weight", (padded_vocab, hidden), dtype_bytes,
                             pp_stage="last", **vocab))
    return out


def _moe_dense_specs(pre: str, layer: int, hidden: int, moe: Any, dtype_bytes: int) -> list[ParamSpec]:
    """The parameters of a MoE layer that live on the dense grid: the router (replicated), the
    shared expert (a TP-sharded SwiGLU MLP) and its gate (replicated)."""
    rep = dict(tp_kind="replicated", layer=layer)
    out = [ParamSpec(pre + "mlp.router.weight", (moe.num_experts, hidden), dtype_bytes, **rep)]
    shared = moe.shared_expert_ffn_hidden_size
    if shared:
        unit = dict(layer=layer, shard_units=shared, unit_name="shared expert ffn hidden size")
        out.append(ParamSpec(pre + "mlp.shared_experts.linear_fc1.weight", (2 * shared, hidden), dtype_bytes,
                             tp_kind="column", fixup="gate_up", **unit))
        out.append(ParamSpec(pre + "mlp.shared_experts.linear_fc2.weight", (hidden, shared), dtype_bytes,
                             tp_kind="row", fixup="row_concat", **unit))
        if moe.shared_expert_gate:
            out.append(ParamSpec(pre + "mlp.shared_experts.gate_weight", (1, hidden), dtype_bytes, **rep))
    return out


def model_param_specs(desc: Any, padded_vocab: int, dtype_bytes: int, *,
                      fused_norms: bool = False) -> list[ParamSpec]:
    """:func:`gpt_param_specs` of a :class:`~hyflow.models.description.ModelDescription` (the
    GLU decoder the builder makes), vocabulary padded to ``padded_vocab``; a mixture-of-experts
    model's routed experts are :func:`expert_param_specs`."""
    return gpt_param_specs(desc.num_layers, desc.hidden_size, desc.num_attention_heads,
                           desc.num_query_groups, desc.head_dim, desc.ffn_hidden_size, padded_vocab,
                           tied_embeddings=desc.tied_embeddings, qkv_bias=desc.qkv_bias,
                           dtype_bytes=dtype_bytes, fused_norms=fused_norms,
                           qk_layernorm=getattr(desc, "qk_layernorm", False), moe=getattr(desc, "moe", None))


@dataclass(frozen=True)
class ExpertSpec:
    """One routed expert's weight: ``linear_fc1`` (``[2F, h]``, ``[gate; up]``, split along F by
    expert TP with the gate/up halves apart) or ``linear_fc2`` (``[h, F]``, split along F =
    dim 1). ``layer`` and ``expert`` are global indices."""

    layer: int
    expert: int
    kind: str  # "fc1" | "fc2"
    hidden: int
    ffn: int
    dtype_bytes: int = 2

    @property
    def name(self) -> str:
        """Full-state-dict name (global layer and expert indices)."""
        return f"decoder.layers.{self.layer}.mlp.experts.local_experts.{self.expert}.linear_{self.kind}.weight"

    @property
    def global_shape(self) -> tuple[int, int]:
        return (2 * self.ffn, self.hidden) if self.kind == "fc1" else (self.hidden, self.ffn)

    @property
    def nbytes(self) -> int:
        return 2 * self.ffn * self.hidden * self.dtype_bytes if self.kind == "fc1" else \
            self.ffn * self.hidden * self.dtype_bytes


def expert_param_specs(desc: Any, dtype_bytes: int) -> list[ExpertSpec]:
    """Every routed expert weight of a mixture-of-experts description (none for a dense one), in
    (layer, expert, fc1 / fc2) order."""
    moe = getattr(desc, "moe", None)
    if moe is None:
        return []
    return [ExpertSpec(i, e, kind, desc.hidden_size, moe.ffn_hidden_size, dtype_bytes)
            for i in range(desc.num_layers) for e in range(moe.num_experts) for kind in ("fc1", "fc2")]


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def megatron_local_name(spec: ParamSpec, pp: int, num_layers: int, stage: int,
                        split: Optional[Sequence[int]] = None) -> str:
    """State-dict name of ``spec`` on training stage ``stage`` (``split``: layers per stage, default
    even): local layer numbering, and a tied embedding shows up as ``output_layer.weight`` on the
    last stage when PP > 1."""
    if spec.layer is not None:
        local = spec.layer - sum(stage_split(pp, num_layers, split)[:stage])
        return _LAYER_RE.sub(f"decoder.layers.{local}.", spec.name, count=1)
    if spec.pp_stage == "first_and_last" and stage == pp - 1 and pp > 1:
        return "output_layer.weight"
    return spec.name
