"""Slot-indexed KV cache and the core-attention module that reads and writes it.

Megatron-Core's static inference context keeps one shared sequence offset for the
whole batch, so rows cannot sit at different positions, and its dynamic context
needs flash-attention kernels. Continuous batching needs both: every row (a
*slot*) has its own length, and a freed slot is refilled with a new prompt while
the others keep decoding. So hyflow keeps its own cache:

* :class:`KVCache`: per layer, keys and values ``[slots, groups, capacity, head_dim]``
  (this TP rank's query groups), i.e. SDPA's ``[b, h, s, d]`` layout per slot;
* :class:`ForwardBatch`: what one forward works on: which slots, at which
  absolute positions (``[b, s]``, a row's tokens are consecutive), and the
  attention mask derived from them (query at position p sees keys ``0..p`` of its
  own slot);
* :class:`CachedAttention`: a drop-in for Megatron's core attention (same call
  contract as ``DotProductAttention``). Megatron's ``Attention`` still computes
  Q/K/V, applies RoPE and the output projection; this module writes the new K/V
  at their positions and attends over the slot's cache. Positions past a row's
  prompt that were written by right padding are masked until overwritten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of ``slots`` sequences of up to ``capacity`` tokens, per layer."""

    def __init__(self, num_layers: int, slots: int, groups: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (slots, groups, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots, self.capacity = slots, capacity
        self.batch: Optional[ForwardBatch] = None

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def fits(self, slots: int, capacity: int, dtype: torch.dtype) -> bool:
        """True when this cache can serve ``slots`` x ``capacity`` of ``dtype``."""
        return self.slots >= slots and self.capacity >= capacity and self.keys[0].dtype == dtype

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Copy positions ``[0, length)`` of slot ``src`` into each slot of ``dst``."""
        if not dst or length == 0:
            return
        index = torch.tensor(dst, device=self.keys[0].device)
        for buf in self.keys + self.values:
            buf[index, :, :length] = buf[src, :, :length]


@dataclass
class ForwardBatch:
    """Slots and positions of one forward; built once and shared by every layer.

    Attributes:
        slots: ``[b]`` cache slot of each row.
        positions: ``[b, s]`` absolute position of each input token.
        kv_len: keys to attend over (max position + 1).
        mask: ``[b, 1, s, kv_len]`` boolean, True where a query may attend.
        slot_range: ``(start, stop)`` when ``slots`` is that contiguous range (the
            cache is then sliced instead of gathered).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    kv_len: int
    mask: torch.Tensor
    slot_range: Optional[tuple[int, int]]

    @classmethod
    def build(cls, slots: torch.Tensor, positions: torch.Tensor) -> "ForwardBatch":
        kv_len = int(positions.max()) + 1
        keys = torch.arange(kv_len, device=positions.device)
        mask = (keys.view(1, 1, 1, -1) <= positions[:, None, :, None])
        first = int(slots[0])
        contiguous = bool(torch.equal(slots, torch.arange(first, first + len(slots), device=slots.device)))
        return cls(slots=slots, positions=positions, kv_len=kv_len, mask=mask,
                   slot_range=(first, first + len(slots)) if contiguous else None)


class CachedAttention(torch.nn.Module):
    """Core attention over a :class:`KVCache` layer (replaces Megatron's core attention).

    Called by Megatron's ``Attention`` as ``(query [sq, b, np, hn], key [sq, b, ng, hn],
    value, attention_mask, attn_mask_type=..., ...)`` after RoPE; returns
    ``[sq, b, np * hn]``. The mask argument is ignored: masking follows the positions
    of the cache's current :class:`ForwardBatch`.
    """

    def __init__(self, cache: KVCache, layer: int, heads: int, groups: int, head_dim: int,
                 softmax_scale: Optional[float] = None) -> None:
        super().__init__()
        self.cache, self.layer = cache, layer
        self.heads, self.groups, self.head_dim = heads, groups, head_dim
        self.scale = softmax_scale or 1.0 / math.sqrt(head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("CachedAttention supports neither attention bias nor packed sequences")
        batch = self.cache.batch
        if batch is None:
            raise RuntimeError("CachedAttention called outside a cached forward (no ForwardBatch set)")
        sq, b = query.shape[0], query.shape[1]
        k_buf, v_buf = self.cache.keys[self.layer], self.cache.values[self.layer]
        # Write this forward's keys / values at (slot, group, position).
        rows = batch.slots.view(b, 1, 1)
        heads = torch.arange(self.groups, device=key.device).view(1, -1, 1)
        cols = batch.positions.view(b, 1, sq)
        k_buf.index_put_((rows, heads, cols), key.permute(1, 2, 0, 3))
        v_buf.index_put_((rows, heads, cols), value.permute(1, 2, 0, 3))
        if batch.slot_range is not None:
            start, stop = batch.slot_range
            k, v = k_buf[start:stop, :, :batch.kv_len], v_buf[start:stop, :, :batch.kv_len]
        else:
            k, v = k_buf[batch.slots, :, :batch.kv_len], v_buf[batch.slots, :, :batch.kv_len]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        # Grouped-query attention without materialising repeated keys / values.
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=self.scale,
                                             enable_gqa=self.heads != self.groups)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
