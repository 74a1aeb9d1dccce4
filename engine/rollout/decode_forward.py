"""Lean transformer forward for generation over a Megatron ``GPTModel``'s own modules.

Megatron's ``TransformerLayer`` spends most of a decode step's non-GEMM time in
Python (hooks, offloading and recompute contexts, per-layer RoPE cos/sin, autograd
``Function`` wrappers around every linear), which for small models costs as much
as the arithmetic. For the standard decoder block hyflow builds (pre-norm RMSNorm,
fused QKV with optional bias, RoPE, GQA, bias-free output projection, SwiGLU MLP)
this module runs the same math directly:

* norms are the layers' own norm modules; linears use the layers' weights (and
  biases) with ``F.linear``, or oneDNN packed copies when packing is on;
* Q/K/V are split from Megatron's per-query-group layout ``[q_g, k_g, v_g]``;
* RoPE cos/sin are computed once per forward and shared by all layers;
* the row-parallel outputs (attention projection, MLP down projection) are
  all-reduced over the TP group, exactly where Megatron's ``RowParallelLinear`` does;
* core attention is :class:`~hyflow.rollout.kv_cache.CachedAttention`.

:func:`unsupported_reason` lists what it does not cover (TE fused layers, MoE,
QK-norm, biases on output projections, non-SwiGLU MLPs, ...); the runner then
keeps Megatron's modules. Parity tests run both paths against HF.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp

#: ``linear(module, weight, x)``: the product of a parallel linear's local shard.
LinearFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def unsupported_reason(model: torch.nn.Module) -> Optional[str]:
    """Why the lean path cannot run ``model`` (None when it can)."""
    cfg = model.config
    if cfg.normalization != "RMSNorm" or cfg.layernorm_zero_centered_gamma:
        return f"normalization {cfg.normalization} (zero-centered={cfg.layernorm_zero_centered_gamma})"
    if not cfg.gated_linear_unit or cfg.activation_func is not F.silu:
        return "MLP is not SwiGLU"
    if cfg.add_bias_linear or cfg.num_moe_experts or cfg.apply_residual_connection_post_layernorm:
        return "biased linears, MoE or post-layernorm residuals"
    if cfg.fp32_residual_connection or getattr(cfg, "attention_output_gate", False):
        return "fp32 residual connection or attention output gate"
    if getattr(model.rotary_pos_emb, "rotary_interleaved", False):
        return "interleaved RoPE"
    head_dim = model.decoder.layers[0].self_attention.hidden_size_per_attention_head
    if 2 * model.rotary_pos_emb.inv_freq.numel() != head_dim:
        return "partial rotary embedding (rotary_percent < 1)"
    if getattr(cfg, "qk_layernorm", False):
        return "QK layernorm"
    for layer in model.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        if not (isinstance(attn.linear_qkv, ColumnParallelLinear)
                and isinstance(attn.linear_proj, RowParallelLinear)):
            return f"attention linears are {type(attn.linear_qkv).__name__} (e.g. TE fused layernorm-linear)"
        norms = (getattr(attn, n, None) for n in ("q_layernorm", "k_layernorm"))
        if not all(isinstance(n, (IdentityOp, type(None))) for n in norms):
            return "QK layernorm"
        if not hasattr(mlp, "linear_fc1") or not isinstance(mlp.linear_fc2, RowParallelLinear):
            return "MLP without linear_fc1 / linear_fc2"
        if not isinstance(layer.input_layernorm, torch.nn.Module) or isinstance(layer.input_layernorm, IdentityOp):
            return "no input layernorm module"
        if not isinstance(getattr(layer, "cross_attention", None), (IdentityOp, type(None))):
            return "cross attention"
    return None


class LeanDecoder:
    """Runs the decoder stack of ``model`` (see the module docstring).

    Args:
        model: the unwrapped ``GPTModel``.
        tp_group: tensor-parallel group (None: no reduction).
        linear: optional ``linear(module, weight, x)`` override (packed weights);
            default ``F.linear``.
    """

    def __init__(self, model: torch.nn.Module, tp_group=None, linear: Optional[LinearFn] = None) -> None:
        self.model = model
        self.layers = list(model.decoder.layers)
        self.final_norm = model.decoder.final_layernorm  # None on a pipeline stage before the last
        self.tp_group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        attn = self.layers[0].self_attention
        self.heads = attn.num_attention_heads_per_partition
        self.groups = attn.num_query_groups_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.linear = linear  # None: F.linear

    def _linear(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.linear(module, module.weight, x)
        return F.linear(x, module.weight, module.bias)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            dist.all_reduce(t, group=self.tp_group)
        return t

    def forward(self, hidden: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """``hidden [s, b, h]`` and RoPE angles ``[s, b, 1, d]`` -> final-normed hidden ``[s, b, h]``.

        On a pipeline stage the layers are the stage's own; the final norm is applied only
        on the last stage (the others have none and return the residual stream)."""
        s, b = hidden.shape[0], hidden.shape[1]
        cos, sin = torch.cos(rope).to(hidden.dtype), torch.sin(rope).to(hidden.dtype)
        half = self.head_dim // 2
        per_group = self.heads // self.groups
        x = hidden
        # Intermediates are deleted as soon as they are consumed: a long prefill's peak is then
        # one block's working set (Python locals would otherwise keep the previous block's alive).
        for layer in self.layers:
            attn, mlp = layer.self_attention, layer.mlp
            qkv = self._linear(attn.linear_qkv, layer.input_layernorm(x))
            qkv = qkv.view(s, b, self.groups, (per_group + 2) * self.head_dim)
            q, k, v = torch.split(qkv, [per_group * self.head_dim, self.head_dim, self.head_dim], dim=3)
            del qkv
            q = q.reshape(s, b, self.heads, self.head_dim)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            ctx = attn.core_attention(q, k, v, None)
            del q, k, v
            x = x + self._reduce(self._linear(attn.linear_proj, ctx))
            del ctx
            gate, up = torch.chunk(self._linear(mlp.linear_fc1, layer.pre_mlp_layernorm(x)), 2, dim=-1)
            act = F.silu(gate) * up
            del gate, up
            x = x + self._reduce(self._linear(mlp.linear_fc2, act))
            del act
        return self.final_norm(x) if self.final_norm is not None else x
