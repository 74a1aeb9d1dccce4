"""The word-embedding lookup with its weight gradient added straight into DDP's ``main_grad``.

Megatron's ``VocabParallelEmbedding`` looks rows up with ``F.embedding``, whose backward builds
a dense [vocabulary, hidden] gradient per micro-batch (for SmolLM2-135M 113 MB zero-filled, then
added into the DDP buffer: ~0.1 s a micro-batch on a dev-box core) although only the batch's
token rows are non-zero. Here the backward adds the looked-up rows' gradients into the
parameter's ``main_grad`` in place (``index_add_``), as Megatron's own linear layers do with
gradient-accumulation fusion, and hands autograd no weight gradient; without ``main_grad`` (a
model outside DDP) it returns the usual dense gradient. Megatron's deterministic mode keeps its
own lookup (``index_add_`` is not deterministic on CUDA).

Exact with hyflow's DDP, which reduces ``main_grad`` after the backward
(``overlap_grad_reduce=False``), not from per-parameter hooks; the fused output head
(:mod:`hyflow.training.logprobs`) adds the tied weight's other gradient the same way.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ids, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is not None:
            main_grad.index_add_(0, ids.reshape(-1), rows.to(main_grad.dtype))
            return None, None
        dense = torch.zeros_like(weight)
        dense.index_add_(0, ids.reshape(-1), rows.to(dense.dtype))
        return None, dense


def _forward(self, input_: torch.Tensor) -> torch.Tensor:
    """``VocabParallelEmbedding.forward`` (Megatron-Core 0.16) with :class:`_Lookup` as the lookup."""
    if self.tp_group.size() > 1:
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
    else:
        ids = input_
    output = _Lookup.apply(ids, self.weight)
    if self.tp_group.size() > 1:
        output = output.masked_fill(outside.unsqueeze(-1), 0.0)
    if self.reduce_scatter_embeddings:
        return reduce_scatter_to_sequence_parallel_region(output.transpose(0, 1).contiguous(),
                                                          group=self.tp_group)
    return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)


def install(model: torch.nn.Module) -> bool:
    """Give ``model``'s word embedding (if this stage has one) the main-grad lookup; False where
    it keeps Megatron's (no embedding on this stage, or deterministic mode)."""
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if embedding is None or getattr(embedding, "deterministic_mode", False):
        return False
    embedding.forward = types.MethodType(_forward, embedding)
    return True
