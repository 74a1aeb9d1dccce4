"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

A drop-in replacement for Megatron's local ``DotProductAttention`` (same
constructor and ``forward`` contract) that lets PyTorch pick the flash /
memory-efficient kernels on GPU and its fused CPU kernel otherwise, without
Transformer Engine. Megatron's local module materialises the full
``[b, heads, sq, sk]`` score matrix; SDPA does not need to.

Masks follow Megatron's convention: ``attention_mask`` is boolean with ``True``
meaning *masked out*; a 1-D ``attention_mask`` holds the bounds of the sequences packed into a row
(:func:`hyflow.models.context_parallel.sequence_bounds`), and causal attention runs inside each
one with no ``s x s`` mask. Without a mask the attention is causal, aligned to the end
of the key sequence (a query at position i of the last sq positions sees keys
0..sk-sq+i), which also covers incremental decoding against a KV cache.

Grouped-query attention never repeats keys / values: the causal training forward
passes ``enable_gqa`` (flash attention on CUDA); with a mask, the query heads that
share a key/value group are folded into the query axis instead, so a fused kernel
that takes masks (memory-efficient on CUDA, flash on CPU) still applies.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.process_groups_config import ProcessGroupCollection


class SDPAttention(MegatronModule):
    """Scaled-dot-product core attention for one TP shard of heads."""

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not implement context parallelism; with cp > 1 the "
                             "builder uses UlyssesAttention (or TE's attention with the te spec)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np*hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor attention bias")
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]: never repeated per query head
        v = value.permute(1, 2, 0, 3)
        rep = self.heads // self.groups
        mask = None
        mask_type = attn_mask_type or self.attn_mask_type
        dropout = self.dropout_p if self.training else 0.0
        if attention_mask is not None and attention_mask.dim() == 1 and sq == sk:  # packed sequences' bounds
            bounds = attention_mask.tolist()
            if bounds[0] != 0 or bounds[-1] != sq or any(e <= a for a, e in zip(bounds, bounds[1:])):
                raise ValueError(f"packed sequence bounds must rise from 0 to the row's {sq} tokens, got {bounds}")
            ctx = torch.cat([F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], dropout_p=dropout,
                                                            is_causal=True, scale=self.softmax_scale,
                                                            enable_gqa=rep > 1)
                             for a, e in zip(bounds, bounds[1:])], dim=2)
            return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
        if attention_mask is None and mask_type == AttnMaskType.causal and sq == sk:
            # The training forward: causal, no mask tensor (flash attention on CUDA, GQA included).
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                 scale=self.softmax_scale, enable_gqa=rep > 1)
            return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
        if attention_mask is not None:
            mask = ~attention_mask.to(torch.bool)  # SDPA: True means "attend"
        elif mask_type == AttnMaskType.causal:  # queries are the last sq positions
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        if mask is not None:  # additive float mask, [b or 1, 1 or np, sq, sk]
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            while mask.dim() < 4:
                mask = mask.unsqueeze(0)
        if rep > 1:
            # Fold the rep query heads of each key/value group into the query axis, so SDPA sees as
            # many query as key heads; no fused CUDA kernel takes enable_gqa together with a mask.
            q = q.reshape(b, self.groups, rep * sq, self.head_dim)
            if mask is not None:
                mask = _fold_mask(mask, self.groups, rep)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                             scale=self.softmax_scale)
        ctx = ctx.reshape(b, self.heads, sq, self.head_dim)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)


def _fold_mask(mask: torch.Tensor, groups: int, rep: int) -> torch.Tensor:
    """A ``[B, 1 | heads, sq, sk]`` mask for the folded queries ``[B, groups, rep * sq, hn]``
    (folded query ``r * sq + i`` of group ``g`` is head ``g * rep + r``, query ``i``)."""
    mb, mh, sq, sk = mask.shape
    if mh == 1:
        return mask.repeat(1, 1, rep, 1)
    return mask.reshape(mb, groups, rep * sq, sk)
