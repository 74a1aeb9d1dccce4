"""Tiny random HF models of every supported family (dense and mixture of experts), for tests and
quick experiments.

:func:`make_tiny_hf_model` builds one with transformers (a few hundred thousand
parameters, random weights with non-trivial norms and biases) and saves it as
safetensors, sharded safetensors or ``pytorch_model.bin``. Needs transformers.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(vocab_size=300, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, rms_norm_eps=1e-5)

#: name -> (transformers config class, overrides). Covers GQA and MHA, tied and untied
#: embeddings, Q/K/V biases, every RoPE scaling family (llama3, linear, yarn with the legacy
#: ``type`` spelling, dynamic NTK, longrope), rope_theta, head_dim != hidden/heads. The
#: long-context ones have a short original context (64) so tests run past it cheaply.
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama_tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(head_dim=32, rope_theta=1000000.0, sliding_window=None,
                                      tie_word_embeddings=False)),
    "qwen2_yarn": ("Qwen2Config", dict(rope_theta=10000.0, tie_word_embeddings=False, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_dynamic": ("LlamaConfig", dict(max_position_embeddings=64, tie_word_embeddings=False,
                                          rope_scaling={"rope_type": "dynamic", "factor": 4.0})),
    "llama_longrope": ("LlamaConfig", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 64, "factor": 4.0,
        "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.2],
        "long_factor": [1.0, 1.3, 1.8, 2.5, 3.2, 3.8, 4.0, 4.0]})),
    # Mixture of experts: 8 experts, top-2. Qwen3-MoE renormalises the chosen probabilities and
    # has QK-norm; Qwen2-MoE keeps the softmax over all experts and adds a gated shared expert
    # and Q/K/V biases; Mixtral's experts are as wide as intermediate_size.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, head_dim=16, tie_word_embeddings=False,
                                         router_aux_loss_coef=0.01)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, norm_topk_prob=False,
                                         tie_word_embeddings=False, router_aux_loss_coef=0.01)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                      sliding_window=None, tie_word_embeddings=False, router_aux_loss_coef=0.01)),
}


def tiny_hf_config(name: str, **overrides: Any):
    """The transformers config of tiny model ``name`` (``architectures`` set)."""
    # optional dependency (transformers): the tests' reference models only
    import transformers

    cls_name, extra = TINY_MODELS[name]
    kwargs = {**_COMMON, **extra, **overrides}
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    return cfg


@torch.no_grad()
def make_tiny_hf_model(path: str, name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                       weights_format: str = "safetensors", **overrides: Any):
    """Build, randomise and save tiny model ``name`` at ``path``; returns the model (eval).

    ``weights_format``: ``safetensors``, ``sharded`` (several safetensors shards with
    an index) or ``bin`` (``pytorch_model.bin``).
    """
    # optional dependency (transformers): the tests' reference models only
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(name, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for pname, p in model.named_parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.08)
        elif pname.endswith("bias"):
            p.normal_(0.0, 0.1)
        else:
            p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    if weights_format == "safetensors":
        model.save_pretrained(path)
    elif weights_format == "sharded":
        model.save_pretrained(path, max_shard_size="100KB")
    elif weights_format == "bin":
        cfg.save_pretrained(path)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
    else:
        raise ValueError(f"unknown weights_format {weights_format!r}")
    return model
