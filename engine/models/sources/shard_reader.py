"""Read exactly this rank's shard of a Megatron parameter from HF tensors.

A Megatron tensor is assembled from one or more HF tensors (Q/K/V fused per query
group, ``[gate; up]``), padded (vocabulary rows) and then split over TP ranks
(``partition_dim``, with ``partition_stride`` for the gated ``linear_fc1``). Rather
than building the full tensor and slicing it, the same mapping is applied to *row
tags* (``part << 40 | row``): :func:`hyflow.models.hf_mapping.hf_to_megatron_tensor`
orders the tags exactly as it would order the rows, the TP split picks this rank's
tags, and only those row (or column) ranges are read from the source. The mapping
therefore has a single definition, and a rank never holds a full tensor it does not own.
"""

from __future__ import annotations

from typing import Iterator

import torch

from hyflow.models.description import ModelDescription
from hyflow.models.hf_mapping import hf_to_megatron_tensor
from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.source import WeightSource

BLOCK_BYTES = 16 * 1024 * 1024  #: rows read per block (float32 bytes)
_SHIFT = 40
_PAD = -1
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def tp_select(index: torch.Tensor, tp_rank: int, tp: int, stride: int = 1) -> torch.Tensor:
    """This rank's entries of a 1-D ``index`` under Megatron's TP split (as its CPU init)."""
    chunks = torch.chunk(index, tp * stride)
    return torch.cat([chunks[tp_rank + i * tp] for i in range(stride)])


def _runs(tags: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """Split tags into runs: (part, first row, stop row), or (-1, 0, n) for n padding rows."""
    values = tags.tolist()
    i = 0
    while i < len(values):
        j = i + 1
        if values[i] == _PAD:
            while j < len(values) and values[j] == _PAD:
                j += 1
            yield _PAD, 0, j - i
        else:
            while j < len(values) and values[j] == values[j - 1] + 1:
                j += 1
            part, row = values[i] >> _SHIFT, values[i] & ((1 << _SHIFT) - 1)
            yield part, row, row + (j - i)
        i = j


def _row_tags(source: WeightSource, mc_name: str, hf_names: list[str], desc: ModelDescription,
              padded_rows: int) -> torch.Tensor:
    parts = [(i << _SHIFT) + torch.arange(source.shape(n)[0], dtype=torch.int64)
             for i, n in enumerate(hf_names)]
    tags = hf_to_megatron_tensor(mc_name, parts, desc)
    if padded_rows > tags.numel():
        tags = torch.cat([tags, torch.full((padded_rows - tags.numel(),), _PAD, dtype=torch.int64)])
    return tags


def fill_shard(source: WeightSource, mc_name: str, hf_names: list[str], desc: ModelDescription,
               param: torch.Tensor, tp_rank: int, tp: int, block_bytes: int = BLOCK_BYTES) -> None:
    """Copy this rank's shard of Megatron tensor ``mc_name`` into ``param`` (cast on copy).

    ``param`` supplies the target shape and Megatron's TP attributes. Rows are read
    in blocks of about ``block_bytes`` and the source is released after each block,
    so no full tensor is ever held besides ``param`` itself.
    """
    sharded = tp > 1 and getattr(param, "tensor_model_parallel", False)
    dim = getattr(param, "partition_dim", 0) if sharded else 0
    stride = getattr(param, "partition_stride", 1) if sharded else 1
    ranks, rank = (tp, tp_rank) if sharded else (1, 0)
    if dim == 0:
        padded = param.shape[0] * ranks if mc_name in _VOCAB else 0
        tags = tp_select(_row_tags(source, mc_name, hf_names, desc, padded), rank, ranks, stride)
        if tags.numel() != param.shape[0]:
            raise ConversionError(f"{mc_name}: {tags.numel()} rows map to a parameter of shape "
                                  f"{tuple(param.shape)} (tp rank {tp_rank} of {tp})")
        row_bytes = max(1, param[0].numel() * 4)
        step = max(1, block_bytes // row_bytes)
        pos = 0
        for part, start, stop in _runs(tags):
            if part == _PAD:
                param[pos:pos + stop - start].zero_()
                pos += stop - start
                continue
            for first in range(start, stop, step):
                last = min(first + step, stop)
                block = source.read_rows(hf_names[part], first, last)
                _check(mc_name, hf_names[part], block.shape[1:], param.shape[1:])
                param[pos:pos + last - first].copy_(block)
                pos += last - first
                del block
                source.release()
        return
    if len(hf_names) != 1 or dim != 1:
        raise ConversionError(f"{mc_name}: cannot split a fused tensor along dim {dim}")
    cols = tp_select(torch.arange(source.shape(hf_names[0])[1]), rank, ranks, stride)
    if cols.numel() != param.shape[1]:
        raise ConversionError(f"{mc_name}: {cols.numel()} columns map to a parameter of shape "
                              f"{tuple(param.shape)} (tp rank {tp_rank} of {tp})")
    pos = 0
    for _, start, stop in _runs(cols):
        block = source.read_cols(hf_names[0], start, stop)
        _check(mc_name, hf_names[0], block.shape[:1], param.shape[:1])
        param[:, pos:pos + stop - start].copy_(block)
        pos += stop - start
        del block
        source.release()


def _check(mc_name: str, hf_name: str, got: torch.Size, want: torch.Size) -> None:
    if tuple(got) != tuple(want):
        raise ConversionError(f"{mc_name}: {hf_name} has inner shape {tuple(got)}, the parameter "
                              f"needs {tuple(want)}")
