"""The ``GPTModel``'s rotary embedding, with frequencies from the model description.

:class:`DescribedRotaryEmbedding` replaces Megatron's ``RotaryEmbedding`` in every model the
builder makes. It keeps Megatron's call contract (``forward(max_seq_len, offset,
packed_seq, cp_group) -> angles [s, 1, 1, d]``, ``get_rotary_seq_len``) and adds:

* every scaling family of :mod:`hyflow.models.rope` (Megatron's module knows only
  llama3 with fixed constants); length-dependent families (dynamic NTK, longrope) compute
  the frequencies of each forward from its sequence length, as HF does;
* context-parallel slicing that runs on any device: with ``cp > 1`` a rank holds chunks
  ``r`` and ``2 cp - 1 - r`` of the sequence (Megatron's load-balanced layout, see
  :mod:`hyflow.models.context_parallel`) and gets the angles of exactly those global
  positions (Megatron's helper pins memory and calls ``.cuda()``);
* :meth:`angles` for generation: angles of arbitrary absolute positions ``[b, s]`` with
  per-row frequencies for the length-dependent families.

``inv_freq`` (the short-context frequencies) is a non-persistent buffer, so it follows
``model.to(device)`` and never enters a checkpoint.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from hyflow.models.context_parallel import cp_chunk_index
from hyflow.models.description import ModelDescription


class DescribedRotaryEmbedding(RotaryEmbedding):
    """Megatron ``RotaryEmbedding`` whose frequencies follow ``desc`` (module docstring)."""

    def __init__(self, desc: ModelDescription, cp_group=None) -> None:
        super().__init__(kv_channels=desc.head_dim, rotary_percent=1.0, use_cpu_initialization=True,
                         cp_group=cp_group)
        del self.inv_freq  # a plain attribute in Megatron; a buffer here
        self.register_buffer("inv_freq", desc.inv_freq(), persistent=False)
        self.desc = desc
        self.length_dependent = desc.rope_length_dependent
        self._by_length: dict[int, torch.Tensor] = {}

    def inv_freq_for(self, seq_len: int) -> torch.Tensor:
        """Frequencies of a forward of ``seq_len`` tokens, on ``inv_freq``'s device."""
        if not self.length_dependent:
            return self.inv_freq
        inv = self._by_length.get(seq_len)
        if inv is None or inv.device != self.inv_freq.device:
            inv = self.desc.inv_freq(seq_len).to(self.inv_freq.device)
            if len(self._by_length) >= 64:
                self._by_length.clear()
            self._by_length[seq_len] = inv
        return inv

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
        """Angles ``[s, 1, 1, d]`` of positions ``offset .. offset + max_seq_len - 1`` (this CP
        rank's share of them when the group has several ranks and the batch is not packed)."""
        inv = self.inv_freq_for(offset + max_seq_len)
        seq = torch.arange(max_seq_len, device=inv.device, dtype=inv.dtype) + offset
        freqs = torch.outer(seq, inv)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and group.size() > 1 and not packed_seq:
            emb = emb.index_select(0, cp_chunk_index(max_seq_len, group.size(), group.rank(), emb.device))
        return emb

    def angles(self, positions: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Angles ``[s, b, 1, d]`` of absolute ``positions [b, s]`` (generation). Length-dependent
        families use each row's own length: ``lengths [b]`` (its real length when the row is
        right-padded), default its last position + 1."""
        seq = positions.t().to(self.inv_freq.dtype)  # [s, b]
        if not self.length_dependent:
            inv = self.inv_freq.to(positions.device)  # [d/2]
            freqs = seq.unsqueeze(-1) * inv
        else:
            if lengths is None:
                lengths = positions.max(dim=1).values + 1
            lengths = lengths.tolist()
            table = {n: self.inv_freq_for(n).to(positions.device) for n in set(lengths)}
            inv = torch.stack([table[n] for n in lengths])  # [b, d/2]
            freqs = seq.unsqueeze(-1) * inv.unsqueeze(0)
        return torch.cat((freqs, freqs), dim=-1).unsqueeze(2)
