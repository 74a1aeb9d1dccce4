"""Slot-indexed KV cache and the core-attention module that reads and writes it.

Megatron-Core's static inference context keeps one shared sequence offset for the
whole batch, so rows cannot sit at different positions, and its dynamic context
needs flash-attention kernels. Continuous batching needs both: every row (a
*slot*) has its own length, and a freed slot is refilled with a new prompt while
the others keep decoding. So hyflow keeps its own cache:

* :class:`KVCache`: per layer, keys and values ``[slots, groups, capacity, head_dim]``
  (this TP rank's query groups), i.e. SDPA's ``[b, h, s, d]`` layout per slot;
* :class:`ForwardBatch`: what one forward works on, planned on the host from the
  scheduler's own integers (no device read): which slots, at which absolute positions
  (a row's tokens are consecutive), and how attention must run;
* :class:`CachedAttention`: a drop-in for Megatron's core attention (same call
  contract as ``DotProductAttention``). Megatron's ``Attention`` still computes
  Q/K/V, applies RoPE and the output projection; this module writes the new K/V
  at their positions and attends over the slot's cache.

Attention takes a fused SDPA path in the common cases and never copies the cache:

* **prefill from position 0** (every row of the forward starts a prompt): attention over
  the forward's own keys, ``is_causal`` with grouped-query heads (``enable_gqa``); no mask,
  no cache read (flash attention on CUDA);
* **otherwise** (decode, later prefill chunks): the cache rows are read as one strided view
  ``[lo:hi, :, :kv_len]`` over the span of slots the batch uses (the scheduler keeps running
  sequences in slots ``0..n-1``, so a decode batch *is* the span); the query heads that share
  a key/value group are folded into the query axis (``[b, groups, heads/groups * s, d]``), so
  keys and values are used as stored, with no repeat and no ``enable_gqa`` (which no fused
  CUDA kernel accepts together with a mask). An additive float mask is passed only when rows
  see different numbers of keys (ragged decode); a decode batch whose rows all sit at one
  position runs without a mask;
* **a later prefill chunk** (every row continues at one position ``p``, ``s > 1`` tokens):
  query-blocked attention. A chunk's mask is ``s x (p + s)`` per folded head, i.e. more than the
  whole prompt's mask-free prefill once the context is long (the fused kernels keep no score
  matrix, but they take the mask as a tensor). So the chunk's queries run in blocks of
  :func:`prefill_query_block` tokens; a block reads only the keys up to its last query and
  builds its own mask, so a chunk costs one block's mask (at most :data:`PREFILL_MASK_BYTES`,
  or one query's row) whatever its width, and the same tokens as the unchunked prefill.

Positions past a row's prompt that were written by right padding are masked (or not yet
read) until overwritten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from hyflow.rollout.host import to_device


#: Budget of one query block's additive mask in a continued prefill chunk (``4 x rep x block x
#: context`` bytes, see :func:`prefill_query_block`).
PREFILL_MASK_BYTES = 2 << 20


def prefill_query_block(width: int, context: int, rep: int, budget: Optional[int] = None) -> int:
    """Queries per block of a continued prefill chunk of ``width`` tokens over ``context`` keys,
    ``rep`` query heads per key/value group: the most whose fp32 mask fits ``budget`` (default
    :data:`PREFILL_MASK_BYTES`; at least one query)."""
    budget = PREFILL_MASK_BYTES if budget is None else budget
    return max(1, min(width, budget // (4 * rep * max(context, 1))))


def prefill_block_mask_bytes(width: int, context: int, rep: int, budget: Optional[int] = None) -> int:
    """Peak bytes of one block's mask (the fp32 mask and its ``rep`` folded copies, alive
    together while it is built): what a continued chunk adds to a layer's working set."""
    block = prefill_query_block(width, context, rep, budget)
    return block * context * (4 + 4 * rep)


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

    def copy_prefix(self, src: int, dst: Sequence[int], length: int) -> None:
        """Copy positions ``[0, length)`` of slot ``src`` into each slot of ``dst`` (views, no index
        tensors)."""
        for d in dst:
            if d == src or length == 0:
                continue
            for buf in self.keys + self.values:
                buf[d, :, :length] = buf[src, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Move a sequence's first ``length`` positions from slot ``src`` to slot ``dst`` (used
        to keep running sequences in the lowest slots)."""
        self.copy_prefix(src, [dst], length)


@dataclass
class ForwardBatch:
    """Slots and positions of one forward, planned on the host; shared by every layer.

    Attributes:
        slots: ``[b]`` cache slot of each row (device).
        positions: ``[b, s]`` absolute position of each input token (device).
        kv_len: keys to attend over (max position + 1).
        fresh: every row starts at position 0: attend causally over this forward's keys.
        chunk_start: every row continues at this position with more than one token (a later
            prefill chunk): query-blocked attention, masks built per block; else None.
        span: ``(lo, hi)``: the cache rows attention reads as one view (min / max + 1 slot).
        rows: ``[b]`` index of each row within the span, or None when the rows are the span
            in order (the usual decode batch).
        mask: additive float mask ``[hi - lo, 1, rep * s, kv_len]`` (0 = attend, -inf = not),
            with the grouped query heads folded into the query axis; None when not needed.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    kv_len: int
    fresh: bool
    span: tuple[int, int]
    rows: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    chunk_start: Optional[int] = None

    @classmethod
    def build(cls, slots: Sequence[int], starts: Sequence[int], width: int, *, rep: int,
              dtype: torch.dtype, device: torch.device) -> "ForwardBatch":
        """Row ``i`` feeds ``width`` tokens at positions ``starts[i] .. starts[i] + width - 1`` into
        slot ``slots[i]``; ``rep`` query heads share each key/value group."""
        b = len(slots)
        if b == 0 or len(starts) != b or width < 1:
            raise ValueError(f"need one start per slot and width >= 1, got {b} slots, {len(starts)} starts, "
                             f"width {width}")
        lo, hi = min(slots), max(slots) + 1
        in_order = list(slots) == list(range(lo, hi))
        packed = to_device([list(slots), list(starts)] + ([[s - lo for s in slots]] if not in_order else []),
                           torch.long, device)
        slot_t, start_t = packed[0], packed[1]
        positions = start_t.unsqueeze(1) + torch.arange(width, device=device)
        kv_len = max(starts) + width
        fresh = max(starts) == 0
        rows = None if in_order else packed[2]
        mask = None
        uniform = min(starts) == max(starts)
        if not fresh and width > 1 and uniform:  # a later prefill chunk: masks per query block
            return cls(slots=slot_t, positions=positions, kv_len=kv_len, fresh=False, span=(lo, hi), rows=rows,
                       mask=None, chunk_start=starts[0])
        if not fresh and not (width == 1 and uniform):
            keys = torch.arange(kv_len, device=device)
            allowed = keys.view(1, 1, -1) <= positions.unsqueeze(-1)  # [b, s, kv]
            add = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            if rows is not None:  # slots of the span outside the batch: dummy rows, attend to all
                add = torch.zeros(hi - lo, width, kv_len, dtype=dtype, device=device).index_copy_(0, rows, add)
            mask = add.unsqueeze(1).repeat(1, 1, rep, 1)
        return cls(slots=slot_t, positions=positions, kv_len=kv_len, fresh=fresh, span=(lo, hi), rows=rows,
                   mask=mask)


class CachedAttention(torch.nn.Module):
    """Core attention over a :class:`KVCache` layer (replaces Megatron's core attention).

    Called by Megatron's ``Attention`` as ``(query [sq, b, np, hn], key [sq, b, ng, hn],
    value, attention_mask, attn_mask_type=..., ...)`` after RoPE; returns
    ``[sq, b, np * hn]``. The mask argument is ignored: masking follows the positions
    of the cache's current :class:`ForwardBatch` (see the module docstring for the paths).
    """

    def __init__(self, cache: KVCache, layer: int, heads: int, groups: int, head_dim: int,
                 softmax_scale: Optional[float] = None) -> None:
        super().__init__()
        self.cache, self.layer = cache, layer
        self.heads, self.groups, self.head_dim = heads, groups, head_dim
        self.rep = heads // groups
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
        k_new, v_new = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, ng, sq, hn]
        # Write this forward's keys / values at (slot, group, position).
        rows = batch.slots.view(b, 1, 1)
        heads = torch.arange(self.groups, device=key.device).view(1, -1, 1)
        cols = batch.positions.view(b, 1, sq)
        k_buf.index_put_((rows, heads, cols), k_new)
        v_buf.index_put_((rows, heads, cols), v_new)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        if batch.fresh:
            ctx = F.scaled_dot_product_attention(q, k_new, v_new, is_causal=sq > 1, scale=self.scale,
                                                 enable_gqa=self.rep > 1)
        elif batch.chunk_start is not None:
            ctx = self._blocked(q, k_buf, v_buf, batch)
        else:
            lo, hi = batch.span
            k, v = k_buf[lo:hi, :, :batch.kv_len], v_buf[lo:hi, :, :batch.kv_len]  # views of the cache
            if batch.rows is not None:
                q = q.new_zeros(hi - lo, self.heads, sq, self.head_dim).index_copy_(0, batch.rows, q)
            q = q.reshape(hi - lo, self.groups, self.rep * sq, self.head_dim)  # fold GQA into queries
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=self.scale)
            ctx = ctx.reshape(hi - lo, self.heads, sq, self.head_dim)
            if batch.rows is not None:
                ctx = ctx.index_select(0, batch.rows)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _blocked(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """A continued prefill chunk, ``q [b, np, sq, hn]`` at positions ``start .. start + sq - 1``
        of every row: query blocks, each over the keys up to its last query with its own mask
        (query ``i`` of a block at ``a`` sees keys ``0 .. start + a + i``). Returns ``[b, np, sq, hn]``."""
        lo, hi = batch.span
        if batch.rows is not None:  # slots of the span outside the batch: dummy rows
            q = q.new_zeros((hi - lo,) + tuple(q.shape[1:])).index_copy_(0, batch.rows, q)
        b, _, sq, hn = q.shape
        start, rep = batch.chunk_start, self.rep
        block = prefill_query_block(sq, batch.kv_len, rep)
        out = torch.empty_like(q)
        for a in range(0, sq, block):
            n = min(block, sq - a)
            keys = start + a + n
            k, v = k_buf[lo:hi, :, :keys], v_buf[lo:hi, :, :keys]  # views of the cache
            allowed = torch.arange(keys, device=q.device).view(1, -1) <= torch.arange(
                start + a, keys, device=q.device).view(-1, 1)  # [n, keys]
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
            del allowed
            mask = mask.repeat(rep, 1).view(1, 1, rep * n, keys)  # the folded query heads of a group
            qb = q[:, :, a:a + n].reshape(b, self.groups, rep * n, hn)
            ctx = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=self.scale)
            del mask, qb
            out[:, :, a:a + n] = ctx.reshape(b, self.heads, n, hn)
        return out if batch.rows is None else out.index_select(0, batch.rows)
