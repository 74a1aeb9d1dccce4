"""Hugging Face Llama / Qwen2 / Mistral (dense) and Qwen3-MoE / Qwen2-MoE / Mixtral (mixture of
experts) <-> Megatron-Core names, configs and layouts.

Configs:

* :func:`description_from_hf_config` reads an HF ``config.json`` dict (transformers 4
  ``rope_theta`` / ``rope_scaling`` keys and transformers 5 ``rope_parameters`` alike)
  and rejects what the engine cannot run exactly;
* :func:`hf_config_warnings` lists features that convert but the engine ignores
  (sliding-window attention);
* :func:`hf_config_from_description` writes a config back (export).

Tensors: pure functions over *full* state dicts (see :mod:`hyflow.models.weights`):

* :func:`name_map` / :func:`hf_parameter_shapes`: which HF tensors make each Megatron
  tensor, and the shapes an HF checkpoint of a description must have;
* :func:`hf_to_megatron` / :func:`megatron_to_hf` map one full state dict to the
  other. Q/K/V are fused into Megatron's per-query-group order, gate/up into
  ``linear_fc1 = [gate; up]`` (every routed expert's and the shared expert's too); both
  directions are exact (bit-identical round trip).

Experts in a full state dict carry their global index (``mlp.experts.local_experts.{e}``, the
name Megatron gives them at EP=1); :mod:`hyflow.models.weights` maps them to each EP rank's own.

Streaming converters call :func:`hf_to_megatron_tensor` one tensor at a time.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

import torch

from hyflow.kernels.reshard_reference import grouped_to_qkv, qkv_to_grouped
from hyflow.models.description import (ROPE_TYPES, ModelDescription, ModelDescriptionError, MoEDescription,
                                       RopeScaling)
from hyflow.models.weights import full_parameter_shapes  # Megatron-free: the pre-flight imports this module

_ARCH_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
_FAMILY_ARCH = {family: arch for arch, family in _ARCH_FAMILY.items()}
#: HF tensors that are derived buffers, not weights (older Llama checkpoints store them).
IGNORED_HF_TENSORS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def _rope_settings(cfg: Mapping[str, Any]) -> tuple[Optional[float], Optional[Mapping[str, Any]]]:
    """(rope_theta, scaling dict or None) from either config generation."""
    params = cfg.get("rope_parameters")
    params = params if isinstance(params, Mapping) else {}
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return theta, scaling


def _rope_scaling(rs: Optional[Mapping[str, Any]], cfg: Mapping[str, Any]) -> Optional[RopeScaling]:
    """RopeScaling from an HF ``rope_scaling`` / ``rope_parameters`` dict (``type`` or ``rope_type``).

    Defaults follow transformers 5: a missing ``original_max_position_embeddings`` is the
    config's top-level one if present (it wins, as for Phi-3), else ``max_position_embeddings``;
    a missing yarn / longrope ``factor`` is ``max_position_embeddings / original``."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_TYPES:
        raise ModelDescriptionError(
            f"rope_scaling type {kind!r} is not supported; hyflow runs {', '.join(ROPE_TYPES)}")
    if float(rs.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelDescriptionError("partial_rotary_factor != 1 is not supported")
    max_pos = cfg.get("max_position_embeddings") or 4096
    original = cfg.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings") \
        or max_pos
    factor = rs.get("factor")
    if factor is None:
        if kind not in ("yarn", "longrope"):
            raise ModelDescriptionError(f"rope_scaling of type {kind!r} needs a 'factor'")
        factor = max_pos / original

    def opt(key: str) -> Optional[float]:
        value = rs.get(key)
        return None if value is None else float(value)

    return RopeScaling(
        type=kind, factor=float(factor),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"), truncate=bool(rs.get("truncate", True)),
        short_factor=[float(x) for x in rs["short_factor"]] if rs.get("short_factor") else None,
        long_factor=[float(x) for x in rs["long_factor"]] if rs.get("long_factor") else None)


def _hf_rope_scaling(s: RopeScaling) -> dict[str, Any]:
    """HF ``rope_scaling`` dict of ``s``: both ``rope_type`` (transformers >= 4.43) and ``type``
    (older readers, vLLM's legacy path), and only the keys its family uses."""
    out: dict[str, Any] = {"rope_type": s.type, "type": s.type, "factor": s.factor}
    if s.type in ("llama3", "yarn", "longrope"):
        out["original_max_position_embeddings"] = s.original_max_position_embeddings
    if s.type == "llama3":
        out.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    if s.type == "yarn":
        out.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow)
        for key in ("mscale", "mscale_all_dim"):
            if getattr(s, key) is not None:
                out[key] = getattr(s, key)
        if not s.truncate:
            out["truncate"] = False
    if s.type == "longrope":
        out.update(short_factor=list(s.short_factor), long_factor=list(s.long_factor))
    if s.type in ("yarn", "longrope") and s.attention_factor is not None:
        out["attention_factor"] = s.attention_factor
    return out


def _family(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    family = next((_ARCH_FAMILY[a] for a in archs if a in _ARCH_FAMILY), None)
    if family is None and not archs and model_type in _FAMILY_ARCH:
        family = model_type
    if family is None:
        raise ModelDescriptionError(
            f"unsupported architecture {archs or model_type!r}; hyflow converts "
            f"{', '.join(sorted(_ARCH_FAMILY))}")
    return family


def _check_unsupported(cfg: Mapping[str, Any], family: str) -> None:
    """Reject config features the Megatron model cannot reproduce exactly."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelDescriptionError(f"hidden_act={cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise ModelDescriptionError("mlp_bias=true is not supported (Megatron's MLP here has no biases)")
    if family not in ("qwen2", "qwen2_moe") and cfg.get("attention_bias"):
        raise ModelDescriptionError(
            f"attention_bias=true on {family} puts a bias on o_proj too, which is not supported; "
            "only Q/K/V biases (Qwen2) are")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelDescriptionError("partial_rotary_factor != 1 is not supported")
    for key in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size",
                "vocab_size") + _MOE_KEYS.get(family, ()):
        if key == "num_experts" and "num_experts" not in cfg:
            key = "num_local_experts"  # transformers 5 writes Qwen3-MoE's under this name
        if not isinstance(cfg.get(key), int):
            raise ModelDescriptionError(f"config.json lacks the integer {key!r} (got {cfg.get(key)!r})")
    if family in ("qwen3_moe", "qwen2_moe"):
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise ModelDescriptionError(
                f"decoder_sparse_step={cfg.get('decoder_sparse_step', 1)}, mlp_only_layers="
                f"{cfg.get('mlp_only_layers')}: hyflow runs models whose every layer is a mixture of experts "
                "(decoder_sparse_step 1, no mlp_only_layers)")


#: The integer config keys each mixture-of-experts family needs.
_MOE_KEYS = {"qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
             "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "shared_expert_intermediate_size"),
             "mixtral": ("num_local_experts", "num_experts_per_tok")}


def _moe_description(cfg: Mapping[str, Any], family: str) -> Optional[MoEDescription]:
    """The experts of an HF mixture-of-experts config (None for a dense family). Qwen's
    ``norm_topk_prob`` false means probabilities from a softmax over all experts (Megatron's
    pre-softmax); Mixtral always renormalises over the chosen ones."""
    if family not in _MOE_KEYS:
        return None
    qwen = family != "mixtral"
    return MoEDescription(
        num_experts=cfg.get("num_experts", cfg.get("num_local_experts")) if qwen else cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        ffn_hidden_size=cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"],
        pre_softmax=qwen and not cfg.get("norm_topk_prob", False),
        shared_expert_ffn_hidden_size=cfg["shared_expert_intermediate_size"] if family == "qwen2_moe" else None,
        shared_expert_gate=family == "qwen2_moe",
        aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0))


def description_from_hf_config(cfg: Mapping[str, Any]) -> ModelDescription:
    """ModelDescription from an HF config dict; unsupported architectures are rejected."""
    family = _family(cfg)
    _check_unsupported(cfg, family)
    theta, rs = _rope_settings(cfg)
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    desc = ModelDescription(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        ffn_hidden_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings") or 4096,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=_rope_scaling(rs, cfg),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("qkv_bias", True)) if family == "qwen2_moe" else
        bool(cfg.get("attention_bias", family == "qwen2")),
        qk_layernorm=family == "qwen3_moe",
        moe=_moe_description(cfg, family),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
    )
    desc.validate()
    return desc


def hf_config_warnings(cfg: Mapping[str, Any]) -> list[str]:
    """Features of ``cfg`` that convert but that the engine does not reproduce."""
    out = []
    window = cfg.get("sliding_window")
    use_window = cfg.get("use_sliding_window", cfg.get("model_type") != "qwen2")
    if window and use_window and window < (cfg.get("max_position_embeddings") or 0):
        out.append(f"sliding_window={window}: the engine uses full causal attention, so "
                   f"sequences longer than {window} tokens differ from HF")
    if cfg.get("router_jitter_noise"):
        out.append(f"router_jitter_noise={cfg['router_jitter_noise']}: the engine's router adds no jitter "
                   "(HF adds it in training mode only; evaluation and generation are unchanged)")
    return out


def hf_config_from_description(desc: ModelDescription, base: Optional[Mapping[str, Any]] = None,
                               dtype: str = "float32") -> dict[str, Any]:
    """An HF ``config.json`` dict for ``desc``.

    ``base`` (the source checkpoint's config, when known) keeps every key the
    description does not model (token ids, chat settings...); the architecture keys
    are always written from ``desc`` (legacy ``rope_theta`` / ``rope_scaling``, which
    transformers 4 and 5 both read).
    """
    cfg: dict[str, Any] = dict(base or {})
    cfg.pop("rope_parameters", None)
    cfg.pop("torch_dtype", None)
    cfg.update(
        architectures=[_FAMILY_ARCH[desc.family]],
        model_type=desc.family,
        vocab_size=desc.vocab_size,
        hidden_size=desc.hidden_size,
        num_hidden_layers=desc.num_layers,
        num_attention_heads=desc.num_attention_heads,
        num_key_value_heads=desc.num_query_groups,
        intermediate_size=desc.ffn_hidden_size,
        max_position_embeddings=desc.max_position_embeddings,
        head_dim=desc.head_dim,
        hidden_act="silu",
        rms_norm_eps=desc.norm_eps,
        rope_theta=desc.rope_theta,
        rope_scaling=None,
        tie_word_embeddings=desc.tied_embeddings,
        dtype=dtype,
    )
    if desc.rope_scaling is not None:
        cfg["rope_scaling"] = _hf_rope_scaling(desc.rope_scaling)
    if desc.family not in ("qwen2", "qwen2_moe"):
        cfg.update(attention_bias=False, mlp_bias=False)
    moe = desc.moe
    if moe is not None:
        cfg.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coeff,
                   output_router_logits=False)
        if desc.family == "mixtral":
            cfg.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden_size)
        else:
            cfg.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size,
                       norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1, mlp_only_layers=[])
        if desc.family == "qwen2_moe":
            cfg.update(shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size, qkv_bias=desc.qkv_bias)
    if desc.eos_token_ids and "eos_token_id" not in cfg:
        ids = desc.eos_token_ids
        cfg["eos_token_id"] = ids[0] if len(ids) == 1 else list(ids)
    return cfg


#: HF (gate, up, down) projection names of one routed expert, and the MoE block's name.
_EXPERT_PROJ = {"mixtral": ("w1", "w3", "w2")}
_MOE_BLOCK = {"mixtral": "block_sparse_moe"}


def _mlp_names(mc: str, hf: str, desc: ModelDescription) -> dict[str, list[str]]:
    """Megatron MLP names of a layer (prefixes ``mc`` / ``hf``) -> their HF names."""
    moe = desc.moe
    if moe is None:
        return {mc + "mlp.linear_fc1.weight": [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
                mc + "mlp.linear_fc2.weight": [hf + "mlp.down_proj.weight"]}
    block = hf + _MOE_BLOCK.get(desc.family, "mlp") + "."
    gate, up, down = _EXPERT_PROJ.get(desc.family, ("gate_proj", "up_proj", "down_proj"))
    out = {mc + "mlp.router.weight": [block + "gate.weight"]}
    for e in range(moe.num_experts):
        expert, src = mc + f"mlp.experts.local_experts.{e}.", block + f"experts.{e}."
        out[expert + "linear_fc1.weight"] = [src + f"{gate}.weight", src + f"{up}.weight"]
        out[expert + "linear_fc2.weight"] = [src + f"{down}.weight"]
    if moe.shared_expert_ffn_hidden_size:
        out[mc + "mlp.shared_experts.linear_fc1.weight"] = [block + "shared_expert.gate_proj.weight",
                                                            block + "shared_expert.up_proj.weight"]
        out[mc + "mlp.shared_experts.linear_fc2.weight"] = [block + "shared_expert.down_proj.weight"]
        if moe.shared_expert_gate:
            out[mc + "mlp.shared_experts.gate_weight"] = [block + "shared_expert_gate.weight"]
    return out


def _hf_layer_names(i: int, desc: ModelDescription) -> dict[str, list[str]]:
    """Megatron name -> the HF names it is built from, for layer ``i``."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    out = {
        mc + "input_layernorm.weight": [hf + "input_layernorm.weight"],
        mc + "self_attention.linear_qkv.weight": [hf + f"self_attn.{p}_proj.weight" for p in "qkv"],
        mc + "self_attention.linear_proj.weight": [hf + "self_attn.o_proj.weight"],
        mc + "pre_mlp_layernorm.weight": [hf + "post_attention_layernorm.weight"],
    }
    if desc.qkv_bias:
        out[mc + "self_attention.linear_qkv.bias"] = [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
    if desc.qk_layernorm:
        out[mc + "self_attention.q_layernorm.weight"] = [hf + "self_attn.q_norm.weight"]
        out[mc + "self_attention.k_layernorm.weight"] = [hf + "self_attn.k_norm.weight"]
    out.update(_mlp_names(mc, hf, desc))
    return out


def name_map(desc: ModelDescription) -> dict[str, list[str]]:
    """Every Megatron name -> the HF tensor names it is made of (in order)."""
    names = {"embedding.word_embeddings.weight": ["model.embed_tokens.weight"]}
    for i in range(desc.num_layers):
        names.update(_hf_layer_names(i, desc))
    names["decoder.final_layernorm.weight"] = ["model.norm.weight"]
    if not desc.tied_embeddings:
        names["output_layer.weight"] = ["lm_head.weight"]
    return names


def hf_parameter_shapes(desc: ModelDescription) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of ``desc`` -> the shape its checkpoint must have (read off the
    Megatron shapes through :func:`name_map`: a fused tensor's parts split its first dim)."""
    shapes: dict[str, tuple[int, ...]] = {}
    d = desc.head_dim
    q_rows, kv_rows = desc.num_attention_heads * d, desc.num_query_groups * d
    megatron = full_parameter_shapes(desc)
    for mc, parts in name_map(desc).items():
        if len(parts) == 1:
            shapes[parts[0]] = megatron[mc]
        elif mc.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            tail = (desc.hidden_size,) if mc.endswith("weight") else ()
            for name, rows in zip(parts, (q_rows, kv_rows, kv_rows)):
                shapes[name] = (rows,) + tail
        else:  # [gate; up]
            rows, cols = megatron[mc]
            for name in parts:
                shapes[name] = (rows // 2, cols)
    return shapes


def hf_to_megatron_tensor(mc_name: str, parts: list[torch.Tensor], desc: ModelDescription) -> torch.Tensor:
    """Fuse the HF tensors ``parts`` (in :func:`name_map` order) into one Megatron tensor."""
    if mc_name.endswith("linear_qkv.weight") or mc_name.endswith("linear_qkv.bias"):
        return qkv_to_grouped(parts[0], parts[1], parts[2], desc.num_query_groups)
    if mc_name.endswith("linear_fc1.weight"):
        return torch.cat(parts, dim=0)
    return parts[0]


def megatron_to_hf_tensors(mc_name: str, tensor: torch.Tensor, desc: ModelDescription) -> list[torch.Tensor]:
    """Split one Megatron tensor into its HF tensors (inverse of :func:`hf_to_megatron_tensor`)."""
    if mc_name.endswith("linear_qkv.weight") or mc_name.endswith("linear_qkv.bias"):
        return list(grouped_to_qkv(tensor, desc.num_attention_heads, desc.num_query_groups, desc.head_dim))
    if mc_name.endswith("linear_fc1.weight"):
        return list(torch.chunk(tensor, 2, dim=0))
    return [tensor]


def hf_to_megatron(hf: Mapping[str, torch.Tensor], desc: ModelDescription,
                   get: Callable[[str], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full Megatron state dict (global layer indices)."""
    get = get or (lambda n: hf[n])
    missing = [n for parts in name_map(desc).values() for n in parts if n not in hf]
    if missing:
        raise KeyError(f"HF checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return {mc: hf_to_megatron_tensor(mc, [get(n) for n in parts], desc)
            for mc, parts in name_map(desc).items()}


def megatron_to_hf(mc: Mapping[str, torch.Tensor], desc: ModelDescription) -> dict[str, torch.Tensor]:
    """Full Megatron state dict -> HF state dict."""
    out: dict[str, torch.Tensor] = {}
    for mc_name, hf_names in name_map(desc).items():
        for name, tensor in zip(hf_names, megatron_to_hf_tensors(mc_name, mc[mc_name], desc), strict=True):
            out[name] = tensor.contiguous()
    return out
