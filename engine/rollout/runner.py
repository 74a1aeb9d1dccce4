"""Run a Megatron-Core ``GPTModel`` forward against a :class:`~hyflow.rollout.kv_cache.KVCache`.

The runner reuses the model's own modules: the vocab-parallel embedding, every
``TransformerLayer`` (Q/K/V projection, RoPE, output projection, MLP, with
Megatron's TP communication) and the vocab-parallel output layer. Two things are
hyflow's own (Megatron's static inference context cannot give rows different
positions):

* RoPE angles are computed per row from absolute positions (``[s, b, 1, d]``,
  which Megatron's unfused RoPE broadcasts), from the model's own ``inv_freq``;
* every layer's core attention is swapped for a :class:`CachedAttention` while
  the runner is attached (:meth:`ModelRunner.attach`), and restored afterwards.

Only the requested rows' last hidden states go through the output layer, and the
logits stay vocab-parallel (``[n, V / TP]`` on each TP rank).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from hyflow.rollout.kv_cache import CachedAttention, ForwardBatch, KVCache


class GenerationLayoutError(ValueError):
    """The model's layout or configuration is not supported by the generation engine."""


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module  # Megatron DDP / Float16Module wrappers
    return model


class ModelRunner:
    """Prefill / decode forwards of one generation replica's model part.

    Args:
        model: the ``GPTModel`` (possibly DDP-wrapped) in the generation layout; it
            must hold the whole depth (PP = 1) and the output layer.
        tp_group: tensor-parallel group of the generation layout (``None``: the
            model's own ``pg_collection.tp``).
        layer_impl: ``megatron`` runs Megatron's ``TransformerBlock``; ``lean`` the
            :class:`~hyflow.rollout.lean.LeanDecoder` over the same modules (error if
            the model is outside what it covers); ``auto`` picks lean when it can.
    """

    def __init__(self, model: torch.nn.Module, tp_group=None, layer_impl: str = "auto") -> None:
        self.model = _unwrap(model)
        m = self.model
        cfg = m.config
        if not (getattr(m, "pre_process", True) and getattr(m, "post_process", True)):
            raise GenerationLayoutError(
                "generation needs the whole model on each rank (generation PP = 1); this model is "
                "one pipeline stage. Set rollout.layout.pp=1 (the hybrid engine merges stages).")
        if cfg.pipeline_model_parallel_size != 1:
            raise GenerationLayoutError(
                f"generation with pipeline parallelism (pp={cfg.pipeline_model_parallel_size}) is "
                "not supported; use a generation layout with pp=1")
        if cfg.sequence_parallel:
            raise GenerationLayoutError(
                "the generation model must be built without sequence parallelism (decode steps have "
                "one token per row, which cannot be split over TP ranks)")
        if cfg.context_parallel_size != 1:
            raise GenerationLayoutError("generation does not support context parallelism (cp must be 1)")
        if getattr(m, "position_embedding_type", "rope") != "rope" or m.rotary_pos_emb is None:
            raise GenerationLayoutError("the generation engine supports RoPE models only")
        if getattr(cfg, "flash_decode", False) or getattr(cfg, "multi_latent_attention", False):
            raise GenerationLayoutError("flash_decode / multi-latent attention are not supported")
        if tp_group is None:
            tp_group = m.pg_collection.tp if getattr(m, "pg_collection", None) is not None else None
        self.tp_group = tp_group
        self.tp_size = tp_group.size() if tp_group is not None else 1
        self.tp_rank = tp_group.rank() if tp_group is not None else 0
        self.layers = list(m.decoder.layers)
        attn = self.layers[0].self_attention
        self.heads = attn.num_attention_heads_per_partition
        self.groups = attn.num_query_groups_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.softmax_scale = cfg.softmax_scale
        self.dtype = cfg.params_dtype
        self.padded_vocab = m.vocab_size
        self.local_vocab = self.padded_vocab // self.tp_size
        rope = m.rotary_pos_emb
        self._interleaved = bool(getattr(rope, "rotary_interleaved", False))
        self._interp = getattr(rope, "seq_len_interpolation_factor", None)
        self.cache: Optional[KVCache] = None
        self.lean = None
        if layer_impl not in ("auto", "lean", "megatron"):
            raise ValueError(f"layer_impl must be auto, lean or megatron, got {layer_impl!r}")
        if layer_impl != "megatron":
            from hyflow.rollout.lean import LeanDecoder, unsupported_reason

            reason = unsupported_reason(m)
            if reason is None:
                self.lean = LeanDecoder(m, self.tp_group)
            elif layer_impl == "lean":
                raise GenerationLayoutError(f"layer_impl=lean does not cover this model: {reason}")

    @property
    def device(self) -> torch.device:
        return self.model.embedding.word_embeddings.weight.device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, slots: int, capacity: int) -> KVCache:
        """Allocate a cache for ``slots`` sequences of ``capacity`` tokens (this TP shard)."""
        return KVCache(self.num_layers, slots, self.groups, capacity, self.head_dim,
                       self.dtype, self.device)

    @contextlib.contextmanager
    def attach(self, cache: KVCache, pack_weights: bool = False) -> Iterator["ModelRunner"]:
        """Swap every layer's core attention for one bound to ``cache``; eval mode inside.

        ``pack_weights``: route small products through oneDNN packed weights on CPU
        (:class:`~hyflow.rollout.cpu_pack.PackedLinears`).
        """
        saved = [layer.self_attention.core_attention for layer in self.layers]
        was_training = self.model.training
        packer = contextlib.nullcontext()
        if pack_weights and self.device.type == "cpu":
            from hyflow.rollout.cpu_pack import PackedLinears

            packer = PackedLinears(self.model)
        with packer:
            if self.lean is not None:
                self.lean.linear = packer.linear if hasattr(packer, "linear") else None
            try:
                for i, layer in enumerate(self.layers):
                    layer.self_attention.core_attention = CachedAttention(
                        cache, i, self.heads, self.groups, self.head_dim, self.softmax_scale)
                self.model.eval()
                self.cache = cache
                yield self
            finally:
                for layer, module in zip(self.layers, saved):
                    layer.self_attention.core_attention = module
                self.model.train(was_training)
                self.cache = None
                cache.batch = None
                if self.lean is not None:
                    self.lean.linear = None

    def rope(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE angles ``[s, b, 1, d]`` for absolute ``positions [b, s]`` (as Megatron computes)."""
        inv_freq = self.model.rotary_pos_emb.inv_freq.to(self.device)
        seq = positions.t().to(inv_freq.dtype)
        if self._interp is not None:
            seq = seq * (1 / self._interp)
        freqs = seq.unsqueeze(-1) * inv_freq  # [s, b, d/2]
        if self._interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.unsqueeze(2)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                rows: Optional[torch.Tensor] = None, cols: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
        """Run ``tokens [b, s]`` at ``positions [b, s]`` into cache ``slots [b]``.

        Returns fp32 vocab-parallel logits ``[n, V / TP]`` of the hidden state at
        (``rows[i]``, ``cols[i]``) (default: every row's last column), or None when
        ``rows`` is empty (a prefill chunk that ends no prompt). Requires :meth:`attach`.
        """
        if self.cache is None:
            raise RuntimeError("ModelRunner.forward needs an attached cache (use `with runner.attach(cache)`)")
        m = self.model
        self.cache.batch = ForwardBatch.build(slots, positions)
        hidden = m.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        if self.lean is not None:
            hidden = self.lean.forward(hidden, self.rope(positions))
        else:
            hidden = m.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=self.rope(positions))
        b, s = tokens.shape
        if rows is None:
            rows = torch.arange(b, device=hidden.device)
            cols = torch.full((b,), s - 1, device=hidden.device)
        if rows.numel() == 0:
            return None
        picked = hidden[cols, rows].unsqueeze(0)  # [1, n, h]
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(picked, weight=weight)
        return logits[0].float()
