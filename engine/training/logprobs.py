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

from typing import Optional

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

#: float32 logits per block of the fused path (rows x vocabulary columns), on the CPU: 4 Mi values,
#: 16 MiB; on a GPU: 16 Mi values, 64 MiB
CHUNK_ELEMENTS = 1 << 22
GPU_CHUNK_ELEMENTS = 1 << 24
#: vocabulary columns per block on the CPU. Narrow blocks keep a block's weights and logits in
#: cache: on the dev box a [132, 576] x [576, 1024] product runs at ~80 GFLOP/s where the whole
#: 49152-column one runs at ~55, and the softmax passes stay in cache.
VOCAB_BLOCK = 1024
#: rows per block on a GPU. Every row chunk reads the whole vocabulary shard of the weight (and, in
#: the backward, adds a weight-sized product into the fp32 gradient), so chunks of thousands of rows
#: keep that traffic a small share of the GEMMs'; columns then follow from GPU_CHUNK_ELEMENTS
#: (4096 x 4096: 64 MiB of float32 logits, GEMMs large enough to fill an H100).
GPU_BLOCK_ROWS = 4096


def _shard(weight: torch.Tensor, vocab_size: int, tp_group) -> tuple[int, int]:
    """This rank's first vocabulary id and how many of its rows are real (not padding)."""
    rank = dist.get_rank(tp_group) if _tp_size(tp_group) > 1 else 0
    start = rank * weight.shape[0]
    return start, max(0, min(weight.shape[0], vocab_size - start))


def _block_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``h @ w.T / temperature``: the product in the model's dtype, like its output layer."""
    z = (h @ w.t()).float()
    return z.div_(temperature) if temperature not in (0.0, 1.0) else z


def _rescale(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, new_m: torch.Tensor):
    """Softmax partial sums ``s = sum e^(z-m)``, ``u = sum e^(z-m) (z-m)`` re-expressed against a
    larger max ``new_m``; rows with nothing summed yet (``s == 0``, ``m`` may be -inf) stay 0."""
    shift = torch.where(s > 0, m - new_m, torch.zeros_like(m))
    f = torch.exp(shift)
    return f * s, f * (u + shift * s)


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b``: in place within the product when the dtypes agree, else through it."""
    if out.dtype == a.dtype == b.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)


def _label_column(z: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """``z[i, col[i]]`` where ``0 <= col[i] < z.shape[1]``, else 0 (labels in other blocks / shards)."""
    inside = (col >= 0) & (col < z.shape[1])
    value = z.gather(1, col.clamp(0, z.shape[1] - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(inside, value, torch.zeros_like(value))


class _FusedHeadScores(torch.autograd.Function):
    """log p(label) and entropy of ``softmax(hidden @ weight.T / T)`` for ``hidden`` [N, h] and a
    vocabulary shard ``weight`` [V/tp, h], block by block: chunks of rows x ``VOCAB_BLOCK`` columns
    of logits live only while they are reduced (forward, an online log-sum-exp) or differentiated
    (backward, recomputed from the saved log-normaliser and entropy), so no [N, V] float32 tensor
    exists. Padded vocabulary rows are skipped.

    Gradients: with ``p = softmax(z)``, ``d logp / dz = onehot(label) - p`` and
    ``dH / dz = -p (log p + H)``. The hidden-state gradient is this shard's partial; the caller's
    TP copy region (Megatron's ``copy_to_tensor_model_parallel_region``) sums it over the group,
    exactly as the model's own column-parallel output layer does. The weight gradient goes straight
    into Megatron DDP's ``main_grad`` buffer when the weight has one (no weight-sized temporary per
    micro-batch); autograd then gets no gradient for it from here, which is exact because hyflow's
    DDP reduces the buffer after the backward (``overlap_grad_reduce=False``), not from hooks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, tp_group, temperature, chunk_rows, block):
        start, valid = _shard(weight, vocab_size, tp_group)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)
        tp = _tp_size(tp_group)
        for i in range(0, n, chunk_rows):
            h = hidden[i:i + chunk_rows]
            lab = labels[i:i + chunk_rows] - start
            m = torch.full((h.shape[0],), float("-inf"), dtype=torch.float32, device=h.device)
            s, u, picked = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
            for b in range(0, valid, block):
                z = _block_logits(h, weight[b:min(b + block, valid)], temperature)
                new_m = torch.maximum(m, z.max(dim=-1).values)
                s, u = _rescale(m, s, u, new_m)
                m = new_m
                picked += _label_column(z, lab - b)  # a masked gather: no host sync
                z.sub_(m.unsqueeze(-1))
                e = torch.exp(z)
                s += e.sum(dim=-1)
                u += torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1)
            if tp > 1:
                global_m = m.clone()
                dist.all_reduce(global_m, op=dist.ReduceOp.MAX, group=tp_group)
                s, u = _rescale(m, s, u, global_m)
                m = global_m
                sums = torch.stack([s, u, picked])
                dist.all_reduce(sums, group=tp_group)
                s, u, picked = sums
            log_s = torch.log(s)
            lse[i:i + chunk_rows] = m + log_s
            logp[i:i + chunk_rows] = picked - (m + log_s)
            ent[i:i + chunk_rows] = log_s - u / s
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.vocab, ctx.tp_group, ctx.temperature = vocab_size, tp_group, temperature
        ctx.chunk_rows, ctx.block = chunk_rows, block
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        T, chunk_rows, block = ctx.temperature, ctx.chunk_rows, ctx.block
        start, valid = _shard(weight, ctx.vocab, ctx.tp_group)
        want_w = ctx.needs_input_grad[1]
        main_grad = getattr(weight, "main_grad", None) if want_w else None
        grad_w = (main_grad if main_grad is not None else torch.zeros_like(weight)) if want_w else None
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        scale = T if T not in (0.0, 1.0) else 1.0
        for i in range(0, hidden.shape[0], chunk_rows):
            rows = slice(i, i + chunk_rows)
            h = hidden[rows]
            coef = torch.zeros_like(lse[rows]) if g_logp is None else g_logp[rows]
            lab = labels[rows] - start
            for b in range(0, valid, block):
                w = weight[b:min(b + block, valid)]
                log_p = _block_logits(h, w, T).sub_(lse[rows].unsqueeze(-1))
                p = torch.exp(log_p)
                if g_ent is not None:  # -p (g_logp + g_ent (log p + H)), in place on log p
                    gz = log_p.add_(ent[rows].unsqueeze(-1)).mul_(g_ent[rows].unsqueeze(-1))
                    gz.add_(coef.unsqueeze(-1)).mul_(p).neg_()
                else:
                    gz = p.mul_(-coef.unsqueeze(-1))
                if g_logp is not None:  # + coef at each row's label column, where it lies in this block
                    col = lab - b
                    inside = (col >= 0) & (col < gz.shape[1])
                    gz.scatter_add_(1, col.clamp(0, gz.shape[1] - 1).unsqueeze(-1),
                                    torch.where(inside, coef, torch.zeros_like(coef)).unsqueeze(-1))
                if scale != 1.0:
                    gz.div_(scale)
                gz = gz.to(hidden.dtype)
                _accumulate(grad_h[rows], gz, w)
                if want_w:
                    _accumulate(grad_w[b:b + w.shape[0]], gz.t(), h)
        grad_w = None if main_grad is not None else grad_w
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None, None, None


def block_shape(device: torch.device, width: int, chunk_elements: Optional[int] = None,
                vocab_block: Optional[int] = None) -> tuple[int, int]:
    """(rows, columns) of the fused head's blocks of logits for a vocabulary shard of ``width``
    rows on ``device``: :data:`CHUNK_ELEMENTS` / :data:`VOCAB_BLOCK` x :data:`VOCAB_BLOCK` on the CPU,
    :data:`GPU_BLOCK_ROWS` x (:data:`GPU_CHUNK_ELEMENTS` / :data:`GPU_BLOCK_ROWS`) elsewhere (a
    narrower shard gives its spare columns to more rows), unless given."""
    cpu = torch.device(device).type == "cpu"
    if chunk_elements is None:
        chunk_elements = CHUNK_ELEMENTS if cpu else GPU_CHUNK_ELEMENTS
    if vocab_block is None:
        vocab_block = VOCAB_BLOCK if cpu else max(1, chunk_elements // GPU_BLOCK_ROWS)
    columns = max(1, min(vocab_block, width))
    return max(1, chunk_elements // columns), columns


def fused_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                           tp_group=None, temperature: float = 1.0, chunk_elements: Optional[int] = None,
                           vocab_block: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy), float32 [N] each, of the output layer ``weight`` [V/tp, h] (this
    rank's vocabulary shard, padded rows included) applied to ``hidden`` [N, h] at ``temperature``:
    the values and gradients of :func:`vocab_parallel_logprobs` / :func:`vocab_parallel_entropy`
    on ``hidden @ weight.T`` without ever holding those logits whole. ``hidden`` must already be in
    the TP region (:func:`hyflow.training.output_head.hidden_states`). ``chunk_elements`` /
    ``vocab_block``: the block of logits (default: the device's, :func:`block_shape`)."""
    rows, block = block_shape(hidden.device, weight.shape[0], chunk_elements, vocab_block)
    return _FusedHeadScores.apply(hidden, weight, labels, vocab_size, tp_group, temperature, rows, block)
