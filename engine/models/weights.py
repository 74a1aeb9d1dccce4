"""Full (unsharded) Megatron state dicts and their per-rank shards.

A *full state dict* uses Megatron-Core parameter names with **global** layer
indices (``decoder.layers.{i}`` counts over the whole model) and unsharded,
unpadded tensors in Megatron's layout (QKV grouped per query group, ``linear_fc1``
as ``[gate; up]``). It is the neutral exchange format between layouts:

* :func:`load_full_state_dict` slices it into this rank's shard for any layout;
* :func:`gather_full_state_dict` rebuilds it from a sharded model (collective);
* :func:`random_full_state_dict` draws a layout-independent initial model, so a
  model built at TP=2 x PP=2 starts from exactly the weights of the 1-rank model.

How a tensor is sharded is read from the attributes Megatron sets on each
parameter (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``), so
this module follows Megatron rather than restating its layer list.

Routed experts (``...mlp.experts.local_experts.{e}...``) carry their *global* index ``e`` in a
full state dict; an EP rank holds experts ``ep_rank * E/EP ..`` under local indices, each split
over the expert tensor-parallel group (``etp``) instead of the TP group.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.distributed as dist

from hyflow.models.description import ModelDescription

if TYPE_CHECKING:  # annotations only: groups imports Megatron, and the converters' pre-flight
    # (hf_mapping.hf_parameter_shapes -> full_parameter_shapes) runs in the launching process, which
    # must not load it (+230 MiB resident there, counted in every conversion's peak)
    from hyflow.parallel.groups import ParallelGroups

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def is_expert_param(name: str) -> bool:
    """Whether ``name`` is a routed expert's parameter (split over EP and expert TP)."""
    return _EXPERT.search(name) is not None


def expert_offset(desc: ModelDescription, groups: ParallelGroups) -> int:
    """Global index of this rank's first routed expert (0 for a dense model)."""
    if getattr(desc, "moe", None) is None:
        return 0
    return groups.ep_rank * (desc.moe.num_experts // groups.layout.ep)


def layer_offset(desc: ModelDescription, groups: ParallelGroups, vp_stage: Optional[int] = None) -> int:
    """Global index of this rank's (chunk's) first layer (Megatron-Core's numbering, also for an
    uneven ``layout.stage_layers`` split: test_stage_layers checks it against the built layers)."""
    layout = groups.layout
    if not layout.vpp:
        return layout.first_layer(groups.pp_rank, desc.num_layers)
    per_chunk = desc.num_layers // (layout.pp * layout.vpp)
    chunk = (vp_stage or 0) * layout.pp + groups.pp_rank
    return chunk * per_chunk


def global_name(local_name: str, offset: int, experts: int = 0) -> str:
    """``decoder.layers.<local>.x`` -> ``decoder.layers.<local+offset>.x``, and a routed expert's
    local index ``j`` -> ``j + experts`` (this rank's first expert)."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    name = f"decoder.layers.{int(m.group(1)) + offset}." + local_name[m.end():]
    if experts:
        name = _EXPERT.sub(lambda e: f".mlp.experts.local_experts.{int(e.group(1)) + experts}.", name, count=1)
    return name


def split_of(name: str, groups: ParallelGroups) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split of parameter ``name``: expert TP for routed
    experts, TP otherwise."""
    if is_expert_param(name):
        return groups.etp_rank, groups.layout.expert_tp
    return groups.tp_rank, groups.layout.tp


def _tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's slice of ``full`` for ``param`` (same rules as Megatron's CPU init)."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, tp * stride, dim=dim)
    return torch.cat([chunks[tp_rank + i * tp] for i in range(stride)], dim=dim)


def _tp_unslice(shards: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_tp_slice` given every TP rank's shard in rank order."""
    tp = len(shards)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return shards[0]
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][i] for i in range(stride) for r in range(tp)], dim=dim)


def _is_vocab(name: str) -> bool:
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


#: Transformer Engine fuses the pre-attention and pre-MLP norms into the next linear layer and
#: names their weights there; the full state dict uses the local spec's names.
TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def canonical_name(name: str) -> str:
    """A parameter's name in the full state dict: Transformer Engine's fused norm names
    (``...linear_qkv.layer_norm_weight``) become the local spec's (``...input_layernorm.weight``)."""
    for te, local in TE_NORM_NAMES.items():
        if name.endswith(te):
            return name[:-len(te)] + local
    return name


def canonical_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical name, parameter)`` of a (DDP-wrapped) model, whatever its layer spec."""
    module = getattr(model, "module", model)  # unwrap Megatron DDP
    for name, param in module.named_parameters():
        yield canonical_name(name), param


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor], desc: ModelDescription,
                         groups: ParallelGroups, vp_stage: Optional[int] = None,
                         skip_missing: tuple[str, ...] = ()) -> None:
    """Copy this rank's shard of ``full`` into ``model`` (any layout).

    ``skip_missing`` names parameters the model has but ``full`` may lack (a critic's
    value head when its trunk comes from a language model).
    """
    offset = layer_offset(desc, groups, vp_stage)
    experts = expert_offset(desc, groups)
    tp = groups.layout.tp
    missing = []
    for name, param in canonical_parameters(model):
        key = global_name(name, offset, experts)
        if key == "output_layer.weight" and key not in full and desc.tied_embeddings:
            key = "embedding.word_embeddings.weight"
        if key not in full:
            if key not in skip_missing:
                missing.append(key)
            continue
        tensor = full[key]
        if _is_vocab(key) and param.dim() == 2:
            padded_rows = param.shape[0] * tp
            if tensor.shape[0] > padded_rows:
                raise ValueError(f"{key}: {tensor.shape[0]} vocabulary rows > padded size {padded_rows}")
            pad = tensor.new_zeros(padded_rows - tensor.shape[0], tensor.shape[1])
            tensor = torch.cat([tensor, pad])
        shard = _tp_slice(tensor, param, *split_of(name, groups))
        if shard.shape != param.shape:
            raise ValueError(
                f"{key}: shard shape {tuple(shard.shape)} does not match the model's "
                f"{tuple(param.shape)} (full tensor {tuple(tensor.shape)})"
            )
        param.copy_(shard.to(param.dtype))
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} tensors the model needs, e.g. {missing[:4]}")


@torch.no_grad()
def gather_full_state_dict(model: torch.nn.Module, desc: ModelDescription, groups: ParallelGroups,
                           vp_stage: Optional[int] = None, dst_all: bool = True) -> dict[str, torch.Tensor]:
    """Rebuild the full state dict from every rank's shard (collective over TP, PP and, for
    mixture-of-experts models, the expert TP and EP groups).

    Every rank returns the complete dict (small models; for export of large
    models use the streaming converter). Vocabulary padding is stripped.
    """
    offset = layer_offset(desc, groups, vp_stage)
    experts = expert_offset(desc, groups)
    pp_group = groups.pgs.pp
    local: dict[str, torch.Tensor] = {}
    for name, param in canonical_parameters(model):
        group = groups.pgs.expt_tp if is_expert_param(name) else groups.pgs.tp
        shards = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, param.detach().contiguous(), group=group)
        full = _tp_unslice(shards, param)
        key = global_name(name, offset, experts)
        if _is_vocab(key) and full.dim() == 2:
            full = full[: desc.vocab_size]
        local[key] = full.clone()
    if getattr(desc, "moe", None) is not None and groups.layout.ep > 1:  # every EP rank's experts
        parts: list = [None] * groups.layout.ep
        dist.all_gather_object(parts, {k: v for k, v in local.items() if is_expert_param(k)}, group=groups.pgs.ep)
        for part in parts:
            local.update(part)
    if dist.get_world_size(pp_group) == 1:
        return local
    parts = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, local, group=pp_group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key == "embedding.word_embeddings.weight" and key in merged:
                continue  # tied copy on the last stage
            merged[key] = value
    if desc.tied_embeddings:
        merged.pop("output_layer.weight", None)
    return merged


def full_parameter_shapes(desc: ModelDescription) -> dict[str, tuple[int, ...]]:
    """Names and unsharded shapes of every parameter (global layer indices)."""
    h, d = desc.hidden_size, desc.head_dim
    qkv_rows = (desc.num_attention_heads + 2 * desc.num_query_groups) * d
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (desc.vocab_size, h)}
    for i in range(desc.num_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
        if desc.qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        if desc.qk_layernorm:
            shapes[p + "self_attention.q_layernorm.weight"] = (d,)
            shapes[p + "self_attention.k_layernorm.weight"] = (d,)
        shapes[p + "self_attention.linear_proj.weight"] = (h, desc.num_attention_heads * d)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        shapes.update(_mlp_shapes(p, desc))
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not desc.tied_embeddings:
        shapes["output_layer.weight"] = (desc.vocab_size, h)
    return shapes


def _mlp_shapes(prefix: str, desc: ModelDescription) -> dict[str, tuple[int, ...]]:
    """The MLP parameters of one layer: dense SwiGLU, or router, routed experts, shared expert."""
    h, moe = desc.hidden_size, desc.moe
    if moe is None:
        f = desc.ffn_hidden_size
        return {prefix + "mlp.linear_fc1.weight": (2 * f, h), prefix + "mlp.linear_fc2.weight": (h, f)}
    out = {prefix + "mlp.router.weight": (moe.num_experts, h)}
    for e in range(moe.num_experts):
        out[prefix + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * moe.ffn_hidden_size, h)
        out[prefix + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, moe.ffn_hidden_size)
    shared = moe.shared_expert_ffn_hidden_size
    if shared:
        out[prefix + "mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
        out[prefix + "mlp.shared_experts.linear_fc2.weight"] = (h, shared)
        if moe.shared_expert_gate:
            out[prefix + "mlp.shared_experts.gate_weight"] = (1, h)
    return out


def random_full_state_dict(desc: ModelDescription, seed: int,
                           dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Layout-independent random init in Megatron's scheme.

    Matrices ~ N(0, std), output projections (``linear_proj``, ``linear_fc2``)
    ~ N(0, std / sqrt(2 L)), norms = 1, biases = 0. Each tensor has its own
    generator seeded from ``seed`` and its name, so the result does not depend on
    iteration order or layout.
    """
    std = desc.init_method_std
    out_std = std / math.sqrt(2.0 * desc.num_layers)
    sd = {}
    for name, shape in full_parameter_shapes(desc).items():
        if name.endswith("layernorm.weight"):
            sd[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            sd[name] = torch.zeros(shape, dtype=dtype)
        else:
            g = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % (2**63))
            s = out_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            sd[name] = (torch.randn(shape, generator=g, dtype=torch.float32) * s).to(dtype)
    return sd


def _stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` is salted)."""
    value = 1469598103934665603
    for byte in text.encode():
        value = ((value ^ byte) * 1099511628211) % (2**64)
    return value
