"""The hybrid engine's generation-layout weights, named and cut the way vLLM's loaders take them.

The hybrid engine (:mod:`hyflow.hybrid.executor`) fills a Megatron ``GPTModel`` in the generation
layout (TP_g ranks, one pipeline stage) every train -> generate transition. vLLM's Llama / Qwen2 /
Mistral models load Hugging Face names (``model.load_weights``, which fuses ``q/k/v_proj`` into
``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` itself), so this module only renames and
splits, tensor by tensor, with the same Megatron <-> HF rules as the converters
(:func:`hyflow.models.hf_mapping.megatron_to_hf_tensors`):

* ``linear_qkv`` (Megatron's per-query-group ``[q_g; k_g; v_g]``, GQA, Qwen2's bias too) ->
  ``q_proj``, ``k_proj``, ``v_proj``;
* ``linear_fc1`` (``[gate; up]``) -> ``gate_proj``, ``up_proj``;
* the embedding and an untied ``output_layer`` -> ``embed_tokens`` / ``lm_head`` without Megatron's
  vocabulary padding (only the ``vocab_rows`` ids vLLM's config declares); tied embeddings load the
  embedding once (vLLM's ``lm_head`` is the same module).

TP_g > 1: a TP shard of ``linear_qkv`` holds whole query groups, so it splits into this rank's
q, k and v heads, exactly vLLM's shard of ``qkv_proj``; ``linear_fc1``'s ``[gate_r; up_r]`` and the
row-parallel ``linear_proj`` / ``linear_fc2`` shards are vLLM's shards too. They load as they are
(:func:`hyflow.vllm_backend.engine` tells vLLM's loaders the tensors are pre-sharded). Only the
vocabulary shards differ (vLLM pads the vocabulary its own way), so the embedding and output layer
are all-gathered over the generation TP group: one vocabulary matrix per rank, transiently.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hyflow.models.description import ModelDescription
from hyflow.models.hf_mapping import name_map
from hyflow.models.weights import canonical_name
from hyflow.kernels.reshard_reference import grouped_to_qkv

#: HF names whose tensors are TP-sharded in the generation layout (vLLM shards them alike).
VOCAB_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")


def gather_vocab(shard: torch.Tensor, tp_group) -> torch.Tensor:
    """The whole (padded) vocabulary matrix from every TP rank's contiguous rows."""
    size = dist.get_world_size(tp_group)
    out = shard.new_empty((shard.shape[0] * size,) + tuple(shard.shape[1:]))
    dist.all_gather_into_tensor(out, shard.contiguous(), group=tp_group)
    return out


@dataclasses.dataclass
class GenerationShards:
    """This rank's generation-layout shards for vLLM. Iterating yields ``(HF name, tensor)``, what
    vLLM's checkpoint loaders take (:func:`hf_tensors`); :class:`hyflow.vllm_backend.engine.VLLMEngine`
    writes the model's tensors into vLLM's live weights without that detour where it can
    (:mod:`hyflow.vllm_backend.inplace`). Arguments as :func:`vllm_weights`."""

    gen_model: torch.nn.Module
    desc: ModelDescription
    vocab_rows: int
    tp_group: Any = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return hf_tensors(self.gen_model, self.desc, self.vocab_rows, self.tp_group)


def vllm_weights(gen_model: torch.nn.Module, desc: ModelDescription, vocab_rows: int, tp_group=None
                 ) -> GenerationShards:
    """This rank's generation-layout shards of ``gen_model`` for :meth:`VLLMEngine.load_weights`.

    Args:
        gen_model: the Megatron ``GPTModel`` in the generation layout (one stage: PP_g = 1).
        desc: its architecture.
        vocab_rows: the vocabulary vLLM's config declares (the embedding's first rows).
        tp_group: the generation TP group (None or size 1: every tensor is whole).
    """
    return GenerationShards(gen_model, desc, vocab_rows, tp_group)


@torch.no_grad()
def hf_tensors(gen_model: torch.nn.Module, desc: ModelDescription, vocab_rows: int, tp_group=None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of this rank's generation-layout shards, layer by layer (views where
    the split allows; nothing is copied before vLLM's loader copies it).

    Args:
        gen_model: the Megatron ``GPTModel`` in the generation layout (one stage: PP_g = 1).
        desc: its architecture.
        vocab_rows: the vocabulary vLLM's config declares (the embedding's first rows).
        tp_group: the generation TP group (None or size 1: every tensor is whole).
    """
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    heads, groups = desc.num_attention_heads // tp, desc.num_query_groups // tp
    hf_names = name_map(desc)
    module = getattr(gen_model, "module", gen_model)
    for raw_name, param in module.named_parameters():
        name = canonical_name(raw_name)
        if name == "output_layer.weight" and desc.tied_embeddings:
            continue  # Megatron's last-stage copy of the tied embedding: vLLM shares the module
        targets = hf_names.get(name)
        if targets is None:
            raise KeyError(f"{raw_name}: no Hugging Face name for this generation-model parameter "
                           "(hyflow.models.hf_mapping.name_map); vLLM cannot load it")
        tensor = param.detach()
        if name in VOCAB_NAMES:
            if tp > 1:
                tensor = gather_vocab(tensor, tp_group)
            yield targets[0], tensor[:vocab_rows]
        elif name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            yield from zip(targets, grouped_to_qkv(tensor, heads, groups, desc.head_dim))
        elif name.endswith("linear_fc1.weight"):
            yield from zip(targets, torch.chunk(tensor, 2, dim=0))
        else:
            yield targets[0], tensor
