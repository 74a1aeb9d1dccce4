"""Log-probabilities and entropy from vocab-parallel logits, never gathering the vocabulary.

Under tensor parallelism each rank holds logits for a contiguous slice of the
(padded) vocabulary. Log-softmax needs only three reductions over the TP group:
the max, the sum of exponentials, and (for the label's logit) a masked sum. The
padded rows beyond the real vocabulary are excluded (their logits would otherwise
take probability mass the Hugging Face model does not have).

Both are differentiable: every all-reduced quantity is a sum of partials that
depend on local logits only, consumed by computation replicated on all TP ranks,
so Megatron's reduce (forward all-reduce, backward identity) yields exact gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _masked_local(logits: torch.Tensor, vocab_size: int, tp_group,
                  temperature: float = 1.0) -> tuple[torch.Tensor, int]:
    """float32 local logits divided by ``temperature``, padded-vocabulary columns at -inf; and
    this shard's start. One float32 copy of the logits at most (the in-place steps act on it;
    neither a cast nor a scaling by a constant needs its output for the backward)."""
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    width = logits.shape[-1]
    start = rank * width
    scale = temperature not in (0.0, 1.0)
    if logits.dtype != torch.float32:
        local, own = logits.float(), True
        if scale:
            local.div_(temperature)
    elif scale:
        local, own = logits / temperature, True
    else:
        local, own = logits, False
    if start + width > vocab_size:
        valid = max(vocab_size - start, 0)
        pad = torch.arange(width, device=logits.device) >= valid
        local = local.masked_fill_(pad, float("-inf")) if own else local.masked_fill(pad, float("-inf"))
    return local, start


def _tp_size(tp_group) -> int:
    return dist.get_world_size(tp_group) if tp_group is not None else 1


def _log_normalizer(local: torch.Tensor, tp_group) -> torch.Tensor:
    """log sum_v exp(logit_v) over the whole vocabulary, [..]."""
    local_max = local.max(dim=-1).values.detach()
    if _tp_size(tp_group) > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    sum_exp = torch.exp(local - local_max.unsqueeze(-1)).sum(dim=-1)
    if _tp_size(tp_group) > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=tp_group)
    return local_max + torch.log(sum_exp)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                            tp_group=None, temperature: float = 1.0) -> torch.Tensor:
    """log p(label) for logits sharded over the TP group along the last dim, of the distribution
    ``softmax(logits / temperature)`` (the rollout's; 0 and 1 leave the logits as they are).

    ``logits`` [..., V/tp] (this rank's vocabulary slice), ``labels`` [...] global ids.
    Returns float32 [...].
    """
    local, start = _masked_local(logits, vocab_size, tp_group, temperature)
    width = local.shape[-1]
    in_shard = (labels >= start) & (labels < start + width)
    idx = (labels - start).clamp(0, width - 1)
    picked = local.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    picked = torch.where(in_shard, picked, torch.zeros_like(picked))
    if _tp_size(tp_group) > 1:
        picked = reduce_from_tensor_model_parallel_region(picked, group=tp_group)
    return picked - _log_normalizer(local, tp_group)


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int, tp_group=None,
                           temperature: float = 1.0) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v of the softmax over the whole (unpadded) vocabulary.

    Written as ``H = m + log S - T / S`` with ``S = sum_v e^(l_v - m)`` and
    ``T = sum_v e^(l_v - m) l_v``: both are sums of per-rank partials that depend on
    local logits only, so reducing them (forward all-reduce, backward identity) gives
    exact gradients on every TP rank.
    """
    local, _ = _masked_local(logits, vocab_size, tp_group, temperature)
    m = local.max(dim=-1).values.detach()
    if _tp_size(tp_group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    e = torch.exp(local - m.unsqueeze(-1))
    finite = torch.where(torch.isfinite(local), local, torch.zeros_like(local))
    S, T = e.sum(dim=-1), (e * finite).sum(dim=-1)
    if _tp_size(tp_group) > 1:
        S = reduce_from_tensor_model_parallel_region(S, group=tp_group)
        T = reduce_from_tensor_model_parallel_region(T, group=tp_group)
    return m + torch.log(S) - T / S


def shifted_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                           tp_group=None, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[:, i] | tokens[:, :i]) for i >= 1, aligned to position i (position 0 is 0).

    ``logits`` [b, s, V/tp] from a forward of ``tokens`` [b, s].
    """
    lp = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size, tp_group, temperature)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def shifted_entropy(logits: torch.Tensor, vocab_size: int, tp_group=None,
                    temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the distribution that produced position i (position 0 is 0)."""
    ent = vocab_parallel_entropy(logits[:, :-1], vocab_size, tp_group, temperature)
    return torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
