"""A job's starting weights (``actor.checkpoint``): a hyflow checkpoint, or a Hugging Face model (an
HF directory or a ``.gguf`` file) read directly, each rank its own shards
(:mod:`hyflow.models.sources.hf_weights`), with no conversion step and nothing written to disk.

With ``actor.checkpoint_cache`` set, the first start converts the HF model into that directory (a
hyflow checkpoint, written by the ranks that loaded it) and later starts load it through Megatron's
dist checkpointing instead of reading the HF files again; the cache records the source's path and
the sizes and times of its files, so a changed model is converted again.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from hyflow.checkpoint.errors import CheckpointError
from hyflow.checkpoint.model import load_model_checkpoint, read_checkpoint_info, read_description, \
    save_model_checkpoint
from hyflow.models.description import ModelDescription
from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.hf_weights import load_hf_weights
from hyflow.models.sources.model_source import check_tensors, hf_description, is_hf_model, open_model_source
from hyflow.parallel.groups import ParallelGroups

__all__ = ["is_hf_model", "starting_description", "check_starting_weights", "load_starting_weights"]


def starting_description(path: str) -> ModelDescription:
    """The architecture of the weights at ``path`` (a hyflow checkpoint's ``model.json``, or the HF
    model's config), its tokenizer path absolute."""
    if is_hf_model(path):
        try:
            return hf_description(path)
        except ConversionError as e:
            raise CheckpointError(str(e)) from None
    return read_description(path)


def check_starting_weights(path: str, key: str = "actor.checkpoint") -> None:
    """A missing, incomplete or unreadable ``key``=``path`` fails with one error naming it: the HF
    model's config and every tensor's presence and shape (headers only), or the hyflow checkpoint's
    files. Reads files only (no process group needed)."""
    convert = (f"give an HF model directory or a .gguf file (read directly), or convert one into it: `hyflow "
               f"convert hf2mcore --hf <HF model dir or .gguf file> --out {path}` (for configs/smollm2_arith.yaml, "
               "`make smollm2` writes checkpoints/smollm2-135m)")
    if not os.path.exists(path):
        raise CheckpointError(f"{key}={path!r} does not exist: {convert}")
    if is_hf_model(path):
        try:
            check_tensors(open_model_source(path), hf_description(path))
        except ConversionError as e:
            raise CheckpointError(f"{key}={path!r}: {e}") from None
        return
    try:
        read_checkpoint_info(path)
    except CheckpointError as e:
        raise CheckpointError(f"{key}={path!r}: {e}; {convert}") from None


def _source_stamp(path: str) -> list:
    """Name, size and modification time of the source's files (a cache is valid while they hold)."""
    folder, files = (path, sorted(os.listdir(path))) if os.path.isdir(path) else \
        (os.path.dirname(os.path.abspath(path)), [os.path.basename(path)])
    out = []
    for name in files:
        full = os.path.join(folder, name)
        if os.path.isfile(full):
            st = os.stat(full)
            out.append([name, st.st_size, st.st_mtime_ns])
    return out


def _cache_valid(cache: str, path: str) -> bool:
    try:
        extra = read_checkpoint_info(cache).extra
    except CheckpointError:
        return False
    return extra.get("converted_from") == os.path.abspath(path) and \
        json.loads(json.dumps(extra.get("source_stamp"))) == _source_stamp(path)


def load_starting_weights(model: torch.nn.Module, path: str, groups: ParallelGroups,
                          desc: Optional[ModelDescription] = None, cache: Optional[str] = None,
                          write_cache: bool = True) -> None:
    """Load this rank's shard of the weights at ``path`` into ``model`` (collective for a hyflow
    checkpoint or a cache write, local for an HF read). ``cache``: a hyflow checkpoint directory
    holding the converted HF model (read when valid; written after an HF read when ``write_cache``)."""
    if not is_hf_model(path):
        load_model_checkpoint(model, path, groups)
        return
    if cache and _cache_valid(cache, path):
        load_model_checkpoint(model, cache, groups)
        return
    desc = desc or starting_description(path)
    try:
        load_hf_weights(model, path, desc, groups)
    except ConversionError as e:
        raise CheckpointError(str(e)) from None
    if cache and write_cache:
        save_model_checkpoint(model, cache, groups, desc, overwrite=True,
                              extra={"converted_from": os.path.abspath(path), "source_stamp": _source_stamp(path)})
