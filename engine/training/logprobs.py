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


# --------------------------------------------------------------------------- fused output layer

#: float32 logits per chunk of the fused path (rows x vocabulary shard): 16 Mi values, 64 MiB
CHUNK_ELEMENTS = 1 << 24


def _shard(weight: torch.Tensor, vocab_size: int, tp_group) -> tuple[int, int]:
    """This rank's first vocabulary id and how many of its rows are real (not padding)."""
    rank = dist.get_rank(tp_group) if _tp_size(tp_group) > 1 else 0
    start = rank * weight.shape[0]
    return start, max(0, min(weight.shape[0], vocab_size - start))


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``h @ w.T / temperature``: the product in the model's dtype, like its output layer."""
    z = (h @ w.t()).float()
    return z.div_(temperature) if temperature not in (0.0, 1.0) else z


class _FusedHeadScores(torch.autograd.Function):
    """log p(label) and entropy of ``softmax(hidden @ weight.T / T)`` for ``hidden`` [N, h] and a
    vocabulary shard ``weight`` [V/tp, h], chunk by chunk of rows: a chunk's logits live only while
    it is reduced (forward) or differentiated (backward, recomputed from the saved log-normaliser
    and entropy), so no [N, V] float32 tensor exists. Padded vocabulary rows are skipped.

    Gradients: with ``p = softmax(z)``, ``d logp / dz = onehot(label) - p`` and
    ``dH / dz = -p (log p + H)``. The hidden-state gradient is this shard's partial; the caller's
    TP copy region (Megatron's ``copy_to_tensor_model_parallel_region``) sums it over the group,
    exactly as the model's own column-parallel output layer does.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, tp_group, temperature, chunk_rows):
        start, valid = _shard(weight, vocab_size, tp_group)
        w = weight[:valid]
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)
        tp = _tp_size(tp_group)
        for i in range(0, n, chunk_rows):
            z = _chunk_logits(hidden[i:i + chunk_rows], w, temperature)
            lab = labels[i:i + chunk_rows] - start
            own = (lab >= 0) & (lab < valid)
            if valid:
                m = z.max(dim=-1).values
            else:
                m = torch.full((z.shape[0],), float("-inf"), dtype=z.dtype, device=z.device)
            if tp > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            e = torch.exp(z - m.unsqueeze(-1))
            sums = torch.stack([e.sum(dim=-1), (e * z).sum(dim=-1),
                                torch.where(own, z.gather(-1, lab.clamp(0, max(valid - 1, 0)).unsqueeze(-1)).squeeze(-1)
                                            if valid else torch.zeros_like(m), torch.zeros_like(m))])
            if tp > 1:
                dist.all_reduce(sums, group=tp_group)
            log_s = torch.log(sums[0])
            lse[i:i + chunk_rows] = m + log_s
            logp[i:i + chunk_rows] = sums[2] - (m + log_s)
            ent[i:i + chunk_rows] = m + log_s - sums[1] / sums[0]
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.vocab, ctx.tp_group, ctx.temperature, ctx.chunk_rows = vocab_size, tp_group, temperature, chunk_rows
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        T, chunk_rows = ctx.temperature, ctx.chunk_rows
        start, valid = _shard(weight, ctx.vocab, ctx.tp_group)
        w = weight[:valid]
        grad_h = torch.zeros_like(hidden)
        grad_w = torch.zeros_like(weight)
        scale = T if T not in (0.0, 1.0) else 1.0
        for i in range(0, hidden.shape[0], chunk_rows):
            if not valid:
                break
            h = hidden[i:i + chunk_rows]
            z = _chunk_logits(h, w, T)
            rows = slice(i, i + chunk_rows)
            p = torch.exp(z - lse[rows].unsqueeze(-1))
            coef = torch.zeros_like(lse[rows]) if g_logp is None else g_logp[rows]
            if g_ent is not None:  # -p (g_logp + g_ent (log p + H))
                gz = (z - (lse[rows] - ent[rows]).unsqueeze(-1)).mul_(g_ent[rows].unsqueeze(-1))
                gz.add_(coef.unsqueeze(-1)).mul_(p).neg_()
            else:
                gz = p.mul_(-coef.unsqueeze(-1))
            if g_logp is not None:
                lab = labels[rows] - start
                own = (lab >= 0) & (lab < valid)
                gz[own.nonzero().squeeze(-1), lab[own]] += coef[own]
            if scale != 1.0:
                gz.div_(scale)
            gz = gz.to(hidden.dtype)
            grad_h[rows] = gz @ w
            grad_w[:valid].addmm_(gz.t(), h)
        return grad_h, grad_w, None, None, None, None, None


def fused_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                           tp_group=None, temperature: float = 1.0,
                           chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy), float32 [N] each, of the output layer ``weight`` [V/tp, h] (this
    rank's vocabulary shard, padded rows included) applied to ``hidden`` [N, h] at ``temperature``:
    the values and gradients of :func:`vocab_parallel_logprobs` / :func:`vocab_parallel_entropy`
    on ``hidden @ weight.T`` without ever holding those logits whole. ``hidden`` must already be in
    the TP region (:func:`hyflow.training.output_head.hidden_states`)."""
    rows = max(1, chunk_elements // max(1, weight.shape[0]))
    return _FusedHeadScores.apply(hidden, weight, labels, vocab_size, tp_group, temperature, rows)
