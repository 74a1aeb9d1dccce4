"""Run a Megatron-Core ``GPTModel`` forward against a :class:`~hyflow.rollout.kv_cache.KVCache`.

The runner reuses the model's own modules: the vocab-parallel embedding, every
``TransformerLayer`` (Q/K/V projection, RoPE, output projection, MLP, with
Megatron's TP communication) and the vocab-parallel output layer. Two things are
hyflow's own (Megatron's static inference context cannot give rows different
positions):

* RoPE angles are computed per row from absolute positions (``[s, b, 1, d]``,
  which Megatron's unfused RoPE broadcasts), by the model's own rotary module
  (:meth:`~hyflow.models.rotary.DescribedRotaryEmbedding.angles`: the frequencies
  training uses, per row for length-dependent scalings such as dynamic NTK);
* every layer's core attention is swapped for a :class:`CachedAttention` while
  the runner is attached (:meth:`ModelRunner.attach`), and restored afterwards.

Only the requested rows' last hidden states go through the output layer, and the
logits stay vocab-parallel (``[n, V / TP]`` on each TP rank).

Pipeline parallelism (generation PP > 1): each rank holds one stage's model (the
first stage has the embedding, the last the final norm and the output layer) and
caches only its own layers. A forward runs stage after stage: stage 0 embeds and
runs its layers, every stage sends its hidden states ``[s, b, h]`` to the next one
(point-to-point on the generation PP group), and the last stage computes the
logits. Other stages return an empty ``[n, 0]`` placeholder; the engine's
:class:`~hyflow.rollout.sampler.PipelineSampler` samples on the last stage and
broadcasts the tokens and log-probs to every stage, so all stages run the same
scheduler steps. There is no micro-batch overlap between stages in this version:
while one stage computes, the others wait (a pipeline bubble of ``(PP - 1) / PP``
of each rank's time); PP in generation buys memory (layers per rank), not speed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from hyflow.rollout.kv_cache import CachedAttention, ForwardBatch, KVCache
from hyflow.rollout.cpu_pack import PackedLinears
from hyflow.rollout.decode_forward import LeanDecoder, unsupported_reason


class GenerationLayoutError(ValueError):
    """The model's layout or configuration is not supported by the generation engine."""


class ModelRunner:
    """Prefill / decode forwards of one generation replica's model part.

    Args:
        model: the ``GPTModel`` (possibly DDP-wrapped) in the generation layout: the
            whole depth, or one pipeline stage of it (built with Megatron's
            ``pre_process`` / ``post_process`` for its stage).
        tp_group: tensor-parallel group of the generation layout (``None``: the
            model's own ``pg_collection.tp``).
        layer_impl: ``megatron`` runs Megatron's ``TransformerBlock``; ``lean`` the
            :class:`~hyflow.rollout.decode_forward.LeanDecoder` over the same modules (error if
            the model is outside what it covers); ``auto`` picks lean when it can.
        pp_group: pipeline-parallel group of the generation layout (``None``: the
            model's own ``pg_collection.pp``); its rank order is the stage order.
    """

    def __init__(self, model: torch.nn.Module, tp_group=None, layer_impl: str = "auto",
                 pp_group=None) -> None:
        self.model = unwrap_model(model)  # Megatron DDP / Float16Module wrappers
        m = self.model
        cfg = m.config
        if pp_group is None:
            pp_group = getattr(getattr(m, "pg_collection", None), "pp", None)
        self.pp_group = pp_group
        self.pp_size = pp_group.size() if pp_group is not None else 1
        self.pp_rank = pp_group.rank() if pp_group is not None else 0
        self.is_first_stage = bool(getattr(m, "pre_process", True))
        self.is_last_stage = bool(getattr(m, "post_process", True))
        if self.pp_size == 1 and not (self.is_first_stage and self.is_last_stage):
            raise GenerationLayoutError(
                "this model is one pipeline stage but its pipeline group has one rank; pass the "
                "generation pp_group the stages were built with")
        if (self.is_first_stage, self.is_last_stage) != (self.pp_rank == 0, self.pp_rank == self.pp_size - 1):
            raise GenerationLayoutError(
                f"pipeline rank {self.pp_rank} of {self.pp_size} holds a model with pre_process="
                f"{self.is_first_stage}, post_process={self.is_last_stage}; the pp_group must be the "
                "one the stages were built for (stage i = group rank i)")
        if cfg.pipeline_model_parallel_size != self.pp_size:
            raise GenerationLayoutError(
                f"the model was built for pipeline size {cfg.pipeline_model_parallel_size} but its "
                f"generation pp_group has {self.pp_size} ranks")
        if getattr(cfg, "virtual_pipeline_model_parallel_size", None) or getattr(m, "mtp_process", False):
            raise GenerationLayoutError(
                "generation does not support virtual pipeline stages (vpp) or multi-token prediction")
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
        if not self.layers:
            raise GenerationLayoutError("a pipeline stage without transformer layers is not supported")
        self.hidden_size = cfg.hidden_size
        self.hidden_dtype = torch.float32 if cfg.fp32_residual_connection else cfg.params_dtype
        if self.pp_size > 1:  # global ranks of the neighbouring stages and of the last stage
            self._prev = dist.get_global_rank(pp_group, self.pp_rank - 1) if self.pp_rank > 0 else None
            self._next = dist.get_global_rank(pp_group, self.pp_rank + 1) \
                if self.pp_rank < self.pp_size - 1 else None
            self.last_stage_rank = dist.get_global_rank(pp_group, self.pp_size - 1)
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
            reason = unsupported_reason(m)
            if reason is None:
                self.lean = LeanDecoder(m, self.tp_group)
            elif layer_impl == "lean":
                raise GenerationLayoutError(f"layer_impl=lean does not cover this model: {reason}")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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
                if not self.is_first_stage:
                    self.model.decoder.set_input_tensor(None)
                self.cache = None
                cache.batch = None
                if self.lean is not None:
                    self.lean.linear = None

    def rope(self, positions: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """RoPE angles ``[s, b, 1, d]`` for absolute ``positions [b, s]`` (as Megatron computes);
        ``lengths [b]``: each row's real length after this forward (right padding excluded)."""
        rotary = self.model.rotary_pos_emb
        if hasattr(rotary, "angles"):  # hyflow's module: every scaling family
            return rotary.angles(positions, lengths)
        inv_freq = rotary.inv_freq.to(self.device)
        seq = positions.t().to(inv_freq.dtype)
        if self._interp is not None:
            seq = seq * (1 / self._interp)
        freqs = seq.unsqueeze(-1) * inv_freq  # [s, b, d/2]
        if self._interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.unsqueeze(2)

    def plan(self, slots: Sequence[int], starts: Sequence[int], width: int) -> ForwardBatch:
        """The :class:`ForwardBatch` of a forward feeding ``width`` tokens per row, row ``i`` into
        slot ``slots[i]`` from position ``starts[i]`` (host integers: no device read)."""
        return ForwardBatch.build(slots, starts, width, rep=self.heads // self.groups, dtype=self.dtype,
                                  device=self.device)

    def forward(self, tokens: torch.Tensor, batch: ForwardBatch,
                rows: Optional[torch.Tensor] = None, cols: Optional[torch.Tensor] = None,
                lengths: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Run ``tokens [b, s]`` at the slots and positions of ``batch`` (see :meth:`plan`).

        ``lengths [b]``: each row's real length after this forward when rows are right-padded
        (default: last position + 1); length-dependent RoPE scalings (dynamic NTK) use it.

        Returns fp32 vocab-parallel logits ``[n, V / TP]`` of the hidden state at
        (``rows[i]``, ``cols[i]``) (default: every row's last column), or None when
        ``rows`` is empty (a prefill chunk that ends no prompt). Requires :meth:`attach`.
        With pipeline parallelism every stage is called with the same arguments; a
        stage other than the last returns an empty ``[n, 0]`` placeholder.
        """
        if self.cache is None:
            raise RuntimeError("ModelRunner.forward needs an attached cache (use `with runner.attach(cache)`)")
        m = self.model
        self.cache.batch = batch
        positions = batch.positions
        b, s = tokens.shape
        if self.is_first_stage:
            hidden = m.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        else:
            hidden = torch.empty(s, b, self.hidden_size, dtype=self.hidden_dtype, device=tokens.device)
            dist.recv(hidden, src=self._prev, group=self.pp_group)
        if self.lean is not None:
            hidden = self.lean.forward(hidden, self.rope(positions, lengths))
        else:
            if not self.is_first_stage:
                m.decoder.set_input_tensor(hidden)
            hidden = m.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=self.rope(positions, lengths))
        n = b if rows is None else rows.numel()
        if not self.is_last_stage:
            dist.send(hidden.contiguous(), dst=self._next, group=self.pp_group)
            return torch.empty(n, 0, device=hidden.device) if n else None
        if n == 0:
            return None
        picked = (hidden[s - 1] if rows is None else hidden[cols, rows]).unsqueeze(0)  # [1, n, h]
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(picked, weight=weight)
        return logits[0].float()
