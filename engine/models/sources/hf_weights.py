"""A model's starting weights straight from a Hugging Face model (an HF directory or a ``.gguf``
file), without an intermediate checkpoint on disk.

Every rank builds its part of the Megatron model without random initialisation and fills each
parameter with exactly its shard, read from the source files block by block
(:func:`~hyflow.models.sources.shard_reader.fill_shard`): host memory is the rank's shard plus one
block of reads, never a full state dict. The result equals ``hyflow convert hf2mcore`` followed by
a checkpoint load (the same mapping, the same reader), in any layout.
"""

from __future__ import annotations

import torch

from hyflow.models.description import ModelDescription
from hyflow.models.hf_mapping import name_map
from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.model_source import check_tensors, hf_description, is_hf_model, open_model_source
from hyflow.models.sources.shard_reader import fill_shard
from hyflow.models.weights import canonical_parameters, expert_offset, global_name, layer_offset, split_of
from hyflow.parallel.groups import ParallelGroups

__all__ = ["hf_description", "is_hf_model", "load_hf_weights"]


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, path: str, desc: ModelDescription, groups: ParallelGroups) -> None:
    """Fill this rank's ``model`` (any layout and layer spec; one model chunk) with its shards of
    the HF model at ``path``. No communication: every rank reads its own slices."""
    source = open_model_source(path)
    check_tensors(source, desc)
    names = name_map(desc)
    offset, experts = layer_offset(desc, groups), expert_offset(desc, groups)
    for name, param in canonical_parameters(model):
        key = global_name(name, offset, experts)
        if key == "output_layer.weight" and desc.tied_embeddings:
            key = "embedding.word_embeddings.weight"  # the last stage's copy of the tied table
        if key not in names:
            raise ConversionError(f"{path}: the model's parameter {key} has no HF tensor (an unsupported part)")
        fill_shard(source.weights, key, names[key], desc, param, *split_of(name, groups))
    source.weights.release()
