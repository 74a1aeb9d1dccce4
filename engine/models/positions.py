"""Rotary embeddings at explicit per-token positions (packed sequences).

Megatron's ``GPTModel`` computes its rotary table for positions ``0..s-1`` of every row: right
for padded batches, wrong for a packed row holding several sequences, each of which restarts
at position 0. :func:`install` adds a forward hook to the model's ``RotaryEmbedding`` that, while
:func:`explicit_positions` is active, replaces the table by one computed from the batch's own
``position_ids`` ``[b, s]`` (laid out ``[s, b, 1, dim]``, which Megatron's RoPE application
broadcasts like its usual ``[s, 1, 1, dim]``). Each entry is the same single product
``position * inv_freq`` Megatron computes, so a packed sequence sees bit for bit the rotary
values of the same sequence alone in a row.

With Transformer Engine's THD format (``PackedSeqParams``) Megatron restarts positions itself
and the hook is not needed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_ATTR = "_hyflow_positions"


def _rotary(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    module = getattr(model, "module", model)  # DDP
    return getattr(module, "rotary_pos_emb", None)


def _hook(module: torch.nn.Module, args, output):
    positions: Optional[torch.Tensor] = getattr(module, _ATTR, None)
    if positions is None:
        return output
    angles = getattr(module, "angles", None)
    if angles is not None:  # hyflow's DescribedRotaryEmbedding: every RoPE scaling family
        return angles(positions.to(module.inv_freq.device))
    inv_freq = module.inv_freq
    seq = positions.to(device=inv_freq.device, dtype=inv_freq.dtype)
    if getattr(module, "seq_len_interpolation_factor", None) is not None:
        seq = seq * (1 / module.seq_len_interpolation_factor)
    freqs = seq.unsqueeze(-1) * inv_freq  # [b, s, dim/2]: Megatron's torch.outer, entry by entry
    if getattr(module, "rotary_interleaved", False):
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.transpose(0, 1).unsqueeze(2)  # [s, b, 1, dim]


def install(model: torch.nn.Module) -> None:
    """Let :func:`explicit_positions` steer ``model``'s rotary table (idempotent)."""
    rotary = _rotary(model)
    if rotary is not None and not getattr(rotary, "_hyflow_hooked", False):
        rotary.register_forward_hook(_hook)
        rotary._hyflow_hooked = True


@contextlib.contextmanager
def explicit_positions(model: torch.nn.Module, position_ids: Optional[torch.Tensor]) -> Iterator[None]:
    """Within the block, ``model``'s rotary embedding uses ``position_ids`` [b, s] (None: Megatron's
    own ``0..s-1``)."""
    rotary = _rotary(model)
    if rotary is None or position_ids is None:
        yield
        return
    if not getattr(rotary, "_hyflow_hooked", False):
        raise RuntimeError("explicit positions need hyflow.models.positions.install(model) at build time")
    setattr(rotary, _ATTR, position_ids)
    try:
        yield
    finally:
        setattr(rotary, _ATTR, None)
