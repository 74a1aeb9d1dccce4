"""All-to-all (Ulysses-style) context-parallel core attention, for models without Transformer Engine.

Megatron-Core's context parallelism lives in Transformer Engine's attention (ring exchange
of keys / values, CUDA only). Without TE the builder puts this module in the layer spec's
``core_attention`` slot when ``layout.cp > 1``:

1. each CP rank holds ``s / cp`` tokens (chunks ``r`` and ``2 cp - 1 - r``, see
   :mod:`hyflow.models.context_parallel`) of all of its TP rank's heads; queries, keys and values
   arrive already rotated with each token's global position;
2. one all-to-all over the CP group per tensor trades sequence shards for head shards: each rank
   then holds the whole sequence for ``1 / cp`` of the heads (``num_attention_heads`` must divide
   by ``tp x cp``; key/value groups that do not divide by ``cp`` are repeated until they do);
3. the sequence is put in natural order and ordinary causal attention runs
   (``torch.nn.functional.scaled_dot_product_attention``);
4. the inverse all-to-all returns the context of the local tokens for all local heads.

Communication per layer: 4 all-to-alls of ``s/cp x b x heads x d`` elements each (q, k, v
forward, context back), i.e. independent of ``cp`` per rank; attention memory is the one of
``1 / cp`` of the heads over the full sequence. The all-to-all is differentiable: with equal
splits it is its own inverse, so its backward is the same exchange on the gradient.
``attention_mask`` (optional) is the *whole-sequence* boolean mask ``[b or 1, 1, s, s]``,
True = masked, in natural order; or, for a packed row, the sequences' bounds ``[0, n1, ..., s]``
(1-D, :func:`hyflow.models.context_parallel.sequence_bounds`): causal attention then runs per
sequence, with no mask and no cross-sequence scores.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.process_groups_config import ProcessGroupCollection

from hyflow.models.context_parallel import cp_order


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of a ``[cp, ...]`` buffer over ``group`` (slot i goes to rank i)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[s/cp, b, H, d]`` (local tokens, all heads) -> ``[s, b, H/cp, d]`` (all tokens in rank
    order, this rank's heads)."""
    cp = group.size()
    s, b, h, d = x.shape
    send = x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp, s/cp, b, H/cp, d]
    return _AllToAll.apply(send, group).reshape(cp * s, b, h // cp, d)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`sequence_to_heads`: ``[s, b, H/cp, d]`` -> ``[s/cp, b, H, d]``."""
    cp = group.size()
    s, b, h, d = x.shape
    recv = _AllToAll.apply(x.reshape(cp, s // cp, b, h, d), group)  # [cp(head group), s/cp, b, H/cp, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * h, d)


class UlyssesAttention(MegatronModule):
    """Context-parallel core attention for one TP shard of heads (module docstring)."""

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        tp, cp = pg_collection.tp.size(), self.cp_group.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        if self.heads % cp:
            raise ValueError(
                f"context parallelism splits the {self.heads} attention heads of a TP rank over cp={cp} "
                f"ranks: num_attention_heads={config.num_attention_heads} must be divisible by "
                f"tp x cp = {tp} x {cp}")
        # Key/value groups are repeated until the CP ranks can share them (GQA with few groups).
        self.kv_repeat = math.lcm(self.groups, cp) // self.groups
        self.head_dim = config.kv_channels
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self._orders: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def _order(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(to_natural, to_ranks) index vectors over the gathered sequence."""
        key = (seq_len, str(device))
        if key not in self._orders:
            ranks = cp_order(seq_len, self.cp_group.size(), device)
            self._orders[key] = (torch.argsort(ranks), ranks)
        return self._orders[key]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """query [s/cp, b, np, hn], key/value [s/cp, b, ng, hn] -> context [s/cp, b, np*hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("the all-to-all context-parallel attention supports neither THD-packed "
                             "sequences (packed_seq_params) nor attention bias; pack with a "
                             "block-diagonal attention_mask, or use the TE spec")
        s_local, b = query.shape[0], query.shape[1]
        if self.kv_repeat > 1:
            key = key.repeat_interleave(self.kv_repeat, dim=2)
            value = value.repeat_interleave(self.kv_repeat, dim=2)
        q, k, v = (sequence_to_heads(t, self.cp_group) for t in (query, key, value))
        seq_len = q.shape[0]
        to_natural, to_ranks = self._order(seq_len, q.device)
        q, k, v = (t.index_select(0, to_natural).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
        if attention_mask is not None and attention_mask.dim() == 1:  # packed sequences' bounds
            ctx = self._per_sequence(q, k, v, attention_mask.tolist(), seq_len)
        else:
            mask, is_causal = None, False
            if attention_mask is not None:
                if attention_mask.shape[-1] != seq_len or attention_mask.shape[-2] != seq_len:
                    raise ValueError(
                        f"under context parallelism attention_mask must cover the whole sequence "
                        f"[b, 1, {seq_len}, {seq_len}], got {tuple(attention_mask.shape)}")
                mask = ~attention_mask.to(torch.bool)
            elif (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal:
                is_causal = True
            ctx = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=is_causal, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        ctx = ctx.permute(2, 0, 1, 3).index_select(0, to_ranks)  # [s, b, h/cp, d] in rank order
        return heads_to_sequence(ctx, self.cp_group).reshape(s_local, b, self.heads * self.head_dim)

    def _per_sequence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                      seq_len: int) -> torch.Tensor:
        """Causal attention inside each packed sequence ``[bounds[i], bounds[i + 1])`` of ``[b, h, s, d]``."""
        if bounds[0] != 0 or bounds[-1] != seq_len or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"packed sequence bounds must rise from 0 to the sequence length {seq_len}, "
                             f"got {bounds}")
        dropout = self.dropout_p if self.training else 0.0
        parts = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=dropout,
                                                is_causal=True, scale=self.softmax_scale,
                                                enable_gqa=q.shape[1] != k.shape[1])
                 for a, b in zip(bounds, bounds[1:])]
        return torch.cat(parts, dim=2)
