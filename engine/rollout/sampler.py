"""Sampling from vocab-parallel logits without gathering the vocabulary.

Each TP rank holds logits for its slice ``[start, start + V/TP)`` of the padded
vocabulary. Per decode step the sampler exchanges only per-row statistics:

1. every rank sends its local max, its local ``sum exp(x - max)``, its local argmax
   and (when top-k / top-p is asked for) its local top-``c`` values: one
   all-gather of ``[b, 3 + c]``. From it every rank computes the global
   log-sum-exp (for log-probs), the greedy token, and the truncation threshold of
   each row. Top-p without top-k widens ``c`` (doubling) until the nucleus lies
   inside the exactly-known prefix of the merged candidates; for typical
   distributions that is a few hundred values per rank, never the vocabulary;
2. with truncation, the kept probability mass of each rank (an all-gather of ``[b]``);
3. sampling is an inverse-CDF draw over the vocabulary in global id order with
   one uniform per row: the rank whose mass interval holds the draw picks the
   token from a local cumulative sum, and an all-reduce of ``[b, 2]`` hands the
   token and its logit to every rank.

Greedy rows need step 1 only. With TP = 1 there is no communication at all.
Because the draw is made in global vocabulary order from one uniform, a given
seed yields the same token under any TP size (up to floating-point rounding).

The uniforms come from :func:`uniforms`, a counter-based generator keyed by a
per-sample stream and the step, so results do not depend on batch composition,
slot placement or data-parallel split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

_MASK64 = (1 << 64) - 1
_INITIAL_CANDIDATES = 64


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a bijective 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, request: int, sample: int) -> int:
    """The random stream of sample ``sample`` of request ``request`` under base ``seed``."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ (request & _MASK64)) ^ (sample & _MASK64))


def uniforms(streams: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    """One uniform in [0, 1) per (stream, step), float64 with 53 random bits."""
    return torch.tensor([(_mix64(s ^ _mix64(t)) >> 11) * (1.0 / (1 << 53))
                         for s, t in zip(streams, steps)], dtype=torch.float64)


@dataclass
class RowParams:
    """Per-row sampling parameters of one step (``[b]`` tensors).

    ``temperature`` 0 marks a greedy row; ``top_k`` 0 and ``top_p`` 1 disable truncation;
    ``uniform`` is the row's draw (ignored for greedy rows).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: torch.Tensor

    @classmethod
    def build(cls, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
              uniform: Optional[torch.Tensor] = None) -> "RowParams":
        b = len(temperature)
        return cls(torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_k, dtype=torch.long),
                   torch.tensor(top_p, dtype=torch.float32),
                   uniform if uniform is not None else torch.zeros(b, dtype=torch.float64))


class VocabParallelSampler:
    """Greedy / temperature / top-k / top-p sampling over TP-sharded logits.

    Args:
        vocab_size: real vocabulary size; ids ``>= vocab_size`` are padding, never sampled.
        local_size: logits columns on this rank (padded vocab / TP).
        tp_group: tensor-parallel group (None or size 1: no communication).
    """

    def __init__(self, vocab_size: int, local_size: int, tp_group=None) -> None:
        self.tp_group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        self.tp = tp_group.size() if self.tp_group is not None else 1
        rank = tp_group.rank() if self.tp_group is not None else 0
        self.start = rank * local_size
        self.local_size = local_size
        self.vocab_size = vocab_size
        self.valid = max(0, min(local_size, vocab_size - self.start))

    # ------------------------------------------------------------------ comms
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[tp, *t.shape]``: every rank's ``t`` in rank order."""
        if self.tp_group is None:
            return t.unsqueeze(0)
        out = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(out, t.contiguous(), group=self.tp_group)
        return torch.stack(out)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            dist.all_reduce(t, group=self.tp_group)
        return t

    # ---------------------------------------------------------------- sample
    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row; returns (global token ids [b] long, log-probs [b] float32)."""
        b, dev = logits.shape[0], logits.device
        params = RowParams(*(t.to(dev) for t in (params.temperature, params.top_k, params.top_p, params.uniform)))
        x = logits.float()
        if self.valid < self.local_size:
            x = x.clone()
            x[:, self.valid:] = float("-inf")
        greedy = params.temperature == 0
        temp = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
        x = x / temp.unsqueeze(1)
        truncate = (~greedy) & ((params.top_k > 0) | (params.top_p < 1))
        local_max, local_arg = x.max(dim=1)
        safe_max = torch.where(torch.isfinite(local_max), local_max, torch.zeros_like(local_max))
        e = torch.exp(x - safe_max.unsqueeze(1))  # 0 on padding
        local_sum = e.sum(dim=1)

        cands = self._initial_candidates(params, truncate)
        while True:
            stats = self._exchange(x, local_max, local_arg, local_sum, cands)
            thresholds = self._thresholds(stats, params, truncate)
            if thresholds is not None:
                break
            cands = min(cands * 2, self.local_size)
        gmax, lse, arg_token, rank_max, rank_sum = stats["gmax"], stats["lse"], stats["arg"], \
            stats["rank_max"], stats["rank_sum"]

        tokens = arg_token.clone()
        chosen = gmax.clone()  # the greedy token's scaled logit is the global max
        sampled = ~greedy
        if bool(sampled.any()):
            scale = torch.exp(torch.where(torch.isfinite(rank_max), rank_max, gmax) - gmax)  # [tp, b]
            if bool(truncate.any()):
                keep = x >= thresholds.unsqueeze(1)
                local_w = (e * keep).sum(dim=1) * torch.exp(safe_max - gmax)
                masses = self._gather(local_w.double())  # [tp, b]
            else:
                keep = None
                masses = (rank_sum * scale).double()
            total = masses.sum(dim=0)
            target = params.uniform.to(total.dtype) * total
            before = masses.cumsum(dim=0) - masses  # mass of lower ranks
            owner = ((before <= target) & (masses > 0)).long().cumsum(dim=0).argmax(dim=0)
            my_rank = self.start // self.local_size
            mine = sampled & (owner == my_rank)
            token_val = torch.zeros(b, 2, dtype=torch.float64, device=dev)
            if bool(mine.any()):
                rows = mine.nonzero().squeeze(1)
                w = e[rows].double() * torch.exp(safe_max[rows] - gmax[rows]).double().unsqueeze(1)
                if keep is not None:
                    w = w * keep[rows]
                cdf = w.cumsum(dim=1)
                local_target = (target[rows] - before[my_rank, rows]).unsqueeze(1)
                idx = torch.searchsorted(cdf, local_target, right=True).squeeze(1)
                last_pos = (w > 0).long().cumsum(dim=1).argmax(dim=1)  # last positive-weight index
                idx = torch.minimum(idx, last_pos)
                token_val[rows, 0] = (idx + self.start + 1).double()
                token_val[rows, 1] = x[rows, idx].double()
            token_val = self._sum(token_val)
            srows = sampled.nonzero().squeeze(1)
            tokens[srows] = token_val[srows, 0].long() - 1
            chosen[srows] = token_val[srows, 1].float()
        return tokens, (chosen - lse).float()

    # -------------------------------------------------------------- internals
    def _initial_candidates(self, params: RowParams, truncate: torch.Tensor) -> int:
        if not bool(truncate.any()):
            return 0
        k_max = int(params.top_k[truncate].max())
        top_p_only = bool(((params.top_k == 0) & (params.top_p < 1) & truncate).any())
        c = max(k_max, _INITIAL_CANDIDATES if top_p_only else 0)
        return min(c, self.local_size)

    def _exchange(self, x: torch.Tensor, local_max: torch.Tensor, local_arg: torch.Tensor,
                  local_sum: torch.Tensor, cands: int) -> dict[str, torch.Tensor]:
        """All-gather per-row statistics (and top-``cands`` values) of every rank."""
        parts = [local_max.double().unsqueeze(1), local_sum.double().unsqueeze(1),
                 (local_arg + self.start).double().unsqueeze(1)]
        if cands:
            parts.append(x.topk(cands, dim=1).values.double())
        g = self._gather(torch.cat(parts, dim=1))  # [tp, b, 3 + c]
        rank_max, rank_sum = g[:, :, 0].float(), g[:, :, 1].float()
        gmax = rank_max.max(dim=0).values
        best_rank = (rank_max == gmax.unsqueeze(0)).long().argmax(dim=0)  # first rank holding the max
        arg = g[best_rank, torch.arange(g.shape[1], device=g.device), 2].long()
        scale = torch.exp(torch.where(torch.isfinite(rank_max), rank_max, gmax) - gmax)
        lse = gmax + torch.log((rank_sum * scale).sum(dim=0))
        out = {"gmax": gmax, "lse": lse, "arg": arg, "rank_max": rank_max, "rank_sum": rank_sum,
               "cands": cands}
        if cands:
            vals = g[:, :, 3:].float()  # [tp, b, c]
            out["merged"] = vals.permute(1, 0, 2).reshape(g.shape[1], -1).sort(dim=1, descending=True).values
            # Values >= max over ranks of their c-th largest are all present (exact prefix).
            out["bound"] = vals[:, :, -1].max(dim=0).values if cands < self.local_size \
                else torch.full_like(gmax, float("-inf"))
        return out

    def _thresholds(self, stats: dict, params: RowParams, truncate: torch.Tensor) -> Optional[torch.Tensor]:
        """Per-row logit threshold (``-inf`` = keep all); None when more candidates are needed."""
        b = truncate.shape[0]
        ninf = torch.full((b,), float("-inf"), device=truncate.device)
        if not bool(truncate.any()):
            return ninf
        merged, bound, lse = stats["merged"], stats["bound"], stats["lse"]
        n = merged.shape[1]
        pos = torch.arange(n, device=merged.device).unsqueeze(0)
        k = params.top_k
        use_k = truncate & (k > 0) & (k < self.vocab_size)
        kept = torch.where(use_k.unsqueeze(1), pos < k.unsqueeze(1), torch.ones_like(pos, dtype=torch.bool))
        cut_k = merged.gather(1, (k - 1).clamp(0, n - 1).unsqueeze(1)).squeeze(1)
        thr = torch.where(use_k, cut_k, ninf)
        use_p = truncate & (params.top_p < 1)
        if not bool(use_p.any()):
            return torch.where(truncate, thr, ninf)
        # Top-p over the top-k set (renormalised) or over the whole vocabulary.
        masked = torch.where(kept, merged, torch.full_like(merged, float("-inf"))).double()
        norm = torch.where(use_k, torch.logsumexp(masked, dim=1).float(), lse).double()
        probs = torch.exp(masked - norm.unsqueeze(1))
        before = probs.cumsum(dim=1) - probs
        m = ((before < params.top_p.double().unsqueeze(1)) & kept).sum(dim=1).clamp(min=1)
        cut_p = merged.gather(1, (m - 1).unsqueeze(1)).squeeze(1)
        # Without top-k the nucleus must end inside the exactly known prefix of candidates.
        open_p = use_p & ~use_k
        if n < self.tp * self.local_size and bool((open_p & (m >= n)).any()):
            return None
        if bool((open_p & (cut_p < bound)).any()):
            return None
        thr = torch.where(use_p, torch.maximum(thr, cut_p), thr)
        return torch.where(truncate, thr, ninf)


class PipelineSampler:
    """Samples on the last pipeline stage and broadcasts the result to every stage.

    With generation PP > 1 only the last stage has logits (other stages pass an empty
    ``[b, 0]`` placeholder). The last stage runs ``sampler`` (vocab-parallel over its
    TP group, so its TP ranks agree), then one broadcast of ``[b, 2]`` float64 (token
    id, log-prob; both exact in float64) over the PP group hands the tokens and
    log-probs to the other stages, which is all the scheduler's decisions depend on.

    Args:
        sampler: this stage's :class:`VocabParallelSampler` (used on the last stage only).
        pp_group: the generation pipeline group (ranks of every stage at this TP rank).
        is_last_stage: whether this rank is on the last stage.
        src: global rank of the last stage in ``pp_group``.
    """

    def __init__(self, sampler: VocabParallelSampler, pp_group, is_last_stage: bool, src: int) -> None:
        self.sampler, self.pp_group, self.is_last_stage, self.src = sampler, pp_group, is_last_stage, src

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        b = logits.shape[0]
        buf = torch.empty(b, 2, dtype=torch.float64, device=logits.device)
        if self.is_last_stage:
            tokens, logprobs = self.sampler(logits, params)
            buf[:, 0] = tokens.to(torch.float64)
            buf[:, 1] = logprobs.to(torch.float64)
        dist.broadcast(buf, src=self.src, group=self.pp_group)
        return buf[:, 0].long(), buf[:, 1].float()
