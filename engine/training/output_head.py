"""The model's last hidden states instead of its logits, for losses that score few positions.

Megatron's ``GPTModel`` ends with ``self.output_layer(hidden_states, weight=output_weight)``: a
column-parallel linear over the vocabulary that is handed the weight at run time (the embedding
matrix when input and output embeddings are tied). While :func:`hidden_states` is active, that call
returns its TP-region input ``[s, b, h]`` instead (the model then hands back ``[b, s, h]``) and
records the weight it was given, so a loss can apply the output layer itself to the response
positions only, chunk by chunk (:func:`hyflow.training.logprobs.fused_logprobs_entropy`). Nothing
of the model is forked or copied: the same parameters, the same tied-weight handling on every
pipeline stage, the same gradients (DDP's hooks see the weight's gradient as usual).

The input enters the tensor-parallel region the way ``ColumnParallelLinear`` enters it: a copy
whose backward all-reduces the partial input gradients over the TP group, or, under sequence
parallelism, the all-gather along the sequence whose backward reduce-scatters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

from hyflow.training.logprobs import fused_logprobs_entropy


@dataclass
class Hidden:
    """What a hidden-state loss receives in place of logits on the last pipeline stage."""

    states: torch.Tensor  #: [b, s, h] last hidden states (after the final norm), in the TP region
    weight: torch.Tensor  #: [V/tp, h] this rank's vocabulary shard of the output layer, padded rows included


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. Megatron's TP copy region all-reduces
    ``grad.contiguous()`` and returns ``grad``: a transposed (non-contiguous) gradient, which the
    model's final ``[s, b, h] -> [b, s, h]`` transpose produces here, would not be reduced."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _Capture:
    weight: Optional[torch.Tensor] = None


def _gpt(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    return model


def wants_hidden(loss_fn) -> bool:
    """Whether ``loss_fn`` takes :class:`Hidden` (it says so with ``hidden_states = True``)."""
    return bool(getattr(loss_fn, "hidden_states", False))


@contextlib.contextmanager
def hidden_states(model: torch.nn.Module) -> Iterator[_Capture]:
    """Within the block ``model`` returns its last hidden states ``[b, s, h]`` instead of logits
    (on the stage that has the output layer; other stages are unchanged). The yielded object's
    ``weight`` is the output weight of the last forward."""
    capture = _Capture()
    layer = getattr(_gpt(model), "output_layer", None)
    if layer is None:
        yield capture
        return

    def forward(input_, weight=None, runtime_gather_output=None):
        capture.weight = layer.weight if weight is None else weight
        group = layer.tp_group
        if getattr(layer, "sequence_parallel", False):
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
        elif group is not None and group.size() > 1:
            input_ = copy_to_tensor_model_parallel_region(input_, group=group)
        return _ContiguousGrad.apply(input_), None

    layer.forward = forward
    try:
        yield capture
    finally:
        del layer.forward


def response_logprobs_entropy(hidden: Hidden, tokens: torch.Tensor, scored: torch.Tensor, vocab_size: int,
                              tp_group=None, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(tokens[:, i] | tokens[:, :i]) and the entropy of that distribution, [b, s] float32
    aligned to position i like :func:`hyflow.training.logprobs.shifted_token_logprobs`, computed
    only where ``scored`` [b, s] is true (position 0 never is); 0 elsewhere."""
    shifted = Hidden(hidden.states[:, :-1], hidden.weight)
    lp, ent = label_logprobs_entropy(shifted, tokens[:, 1:], scored[:, 1:], vocab_size, tp_group, temperature)
    return tuple(torch.cat([torch.zeros_like(v[:, :1]), v], dim=1) for v in (lp, ent))


def label_logprobs_entropy(hidden: Hidden, labels: torch.Tensor, scored: torch.Tensor, vocab_size: int,
                           tp_group=None, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(labels[:, i]) from the states at position i and that distribution's entropy, [b, s]
    float32, only where ``scored`` is true (0 elsewhere): the label-aligned form a context-parallel
    share uses (:func:`hyflow.models.context_parallel.shard_micro_batch`)."""
    sel = scored.bool()
    lp, ent = fused_logprobs_entropy(hidden.states[sel], hidden.weight, labels[sel], vocab_size, tp_group,
                                     temperature)
    zeros = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    return zeros.masked_scatter(sel, lp), zeros.masked_scatter(sel, ent)
