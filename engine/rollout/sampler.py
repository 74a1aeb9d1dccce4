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

from hyflow.rollout.host import to_device

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
    """One uniform in [0, 1) per (stream, step), float64 with 53 random bits (host reference)."""
    return torch.tensor([(_mix64(s ^ _mix64(t)) >> 11) * (1.0 / (1 << 53))
                         for s, t in zip(streams, steps)], dtype=torch.float64, device="cpu")


def _signed(x: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN, _MUL1, _MUL2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts signed values arithmetically)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64_t(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix64` on int64 tensors (two's-complement add / multiply wrap modulo 2**64)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def device_uniforms(streams: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """:func:`uniforms` computed on the streams' device: ``streams`` and ``steps`` are int64
    tensors (streams as the int64 with the stream's bits). Bit-identical to the host version."""
    bits = _shr(_mix64_t(streams ^ _mix64_t(steps)), 11)
    return bits.to(torch.float64) * (1.0 / (1 << 53))


@dataclass
class RowParams:
    """Per-row sampling parameters of one step (``[b]`` tensors) and host-side summaries of them.

    ``temperature`` 0 marks a greedy row; ``top_k`` 0 and ``top_p`` 1 disable truncation;
    ``uniform`` is the row's draw (ignored for greedy rows). The summaries (``any_sampled``,
    ``any_truncate``, ``k_max``, ``top_p_only``, ``any_top_p``) let the sampler choose its path
    without reading the tensors back from the device; :meth:`build` fills them.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: torch.Tensor
    any_sampled: bool = True
    any_truncate: bool = True
    any_top_p: bool = True
    top_p_only: bool = True
    k_max: int = 0

    @classmethod
    def build(cls, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
              uniform: Optional[torch.Tensor] = None, *, streams: Optional[Sequence[int]] = None,
              steps: Optional[Sequence[int]] = None, device: Optional[torch.device] = None) -> "RowParams":
        """Parameters on ``device`` (default: ``uniform``'s, else the CPU). The draws are ``uniform``,
        or computed on the device from ``streams`` / ``steps`` (:func:`device_uniforms`), or 0."""
        b = len(temperature)
        device = torch.device(device) if device is not None else (
            uniform.device if uniform is not None else torch.device("cpu"))
        sampled = [t > 0 for t in temperature]
        draw = streams is not None and uniform is None and any(sampled)  # greedy rows never draw
        floats = to_device([[float(t) for t in temperature], [float(p) for p in top_p]], torch.float32, device)
        ints = [[int(k) for k in top_k]]
        if draw:
            ints += [[_signed(s) for s in streams], [int(t) for t in steps]]
        ints = to_device(ints, torch.long, device)
        if uniform is not None:
            draws = uniform.to(device=device, dtype=torch.float64)
        elif draw:
            draws = device_uniforms(ints[1], ints[2])
        else:
            draws = torch.zeros(b, dtype=torch.float64, device=device)
        truncating = [s and (k > 0 or p < 1) for s, k, p in zip(sampled, top_k, top_p)]
        return cls(floats[0], ints[0], floats[1], draws,
                   any_sampled=any(sampled), any_truncate=any(truncating),
                   any_top_p=any(t and p < 1 for t, p in zip(truncating, top_p)),
                   top_p_only=any(t and k == 0 and p < 1 for t, k, p in zip(truncating, top_k, top_p)),
                   k_max=max([k for t, k in zip(truncating, top_k) if t], default=0))

    def to(self, device: torch.device) -> "RowParams":
        return RowParams(*(t.to(device) for t in (self.temperature, self.top_k, self.top_p, self.uniform)),
                         any_sampled=self.any_sampled, any_truncate=self.any_truncate, any_top_p=self.any_top_p,
                         top_p_only=self.top_p_only, k_max=self.k_max)


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
        dev = logits.device
        params = params.to(dev)
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

        cands = self._initial_candidates(params)
        while True:
            stats = self._exchange(x, local_max, local_arg, local_sum, cands)
            thresholds = self._thresholds(stats, params, truncate)
            if thresholds is not None:
                break
            cands = min(cands * 2, self.local_size)
        gmax, lse, arg_token, rank_max, rank_sum = stats["gmax"], stats["lse"], stats["arg"], \
            stats["rank_max"], stats["rank_sum"]

        if not params.any_sampled:  # all greedy: the argmax and its log-prob, nothing to draw
            return arg_token, (gmax - lse).float()
        sampled = ~greedy
        scale = torch.exp(torch.where(torch.isfinite(rank_max), rank_max, gmax) - gmax)  # [tp, b]
        rescale = torch.exp(safe_max - gmax)
        keep = x >= thresholds.unsqueeze(1) if params.any_truncate else None
        if keep is not None:
            masses = self._gather(((e * keep).sum(dim=1) * rescale).double())  # [tp, b]
        else:
            masses = (rank_sum * scale).double()
        total = masses.sum(dim=0)
        target = params.uniform.to(total.dtype) * total
        before = masses.cumsum(dim=0) - masses  # mass of lower ranks
        owner = ((before <= target) & (masses > 0)).long().cumsum(dim=0).argmax(dim=0)
        my_rank = self.start // self.local_size
        mine = sampled & (owner == my_rank)
        # Every row is drawn locally (no data-dependent row selection: no host sync); rows this
        # rank does not own are discarded by `mine`.
        w = e.double() * rescale.double().unsqueeze(1)
        if keep is not None:
            w = w * keep
        cdf = w.cumsum(dim=1)
        local_target = (target - before[my_rank]).unsqueeze(1)
        idx = torch.searchsorted(cdf, local_target, right=True).squeeze(1)
        last_pos = (w > 0).long().cumsum(dim=1).argmax(dim=1)  # last positive-weight index
        idx = torch.minimum(idx, last_pos)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        token_val = torch.stack([torch.where(mine, (idx + self.start + 1).double(), zero),
                                 torch.where(mine, x.gather(1, idx.unsqueeze(1)).squeeze(1).double(), zero)],
                                dim=1)
        token_val = self._sum(token_val)
        tokens = torch.where(sampled, token_val[:, 0].long() - 1, arg_token)
        chosen = torch.where(sampled, token_val[:, 1].float(), gmax)  # greedy: the global max
        return tokens, (chosen - lse).float()

    # -------------------------------------------------------------- internals
    def _initial_candidates(self, params: RowParams) -> int:
        if not params.any_truncate:
            return 0
        c = max(params.k_max, _INITIAL_CANDIDATES if params.top_p_only else 0)
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
        if not params.any_truncate:
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
        if not params.any_top_p:
            return torch.where(truncate, thr, ninf)
        # Top-p over the top-k set (renormalised) or over the whole vocabulary.
        masked = torch.where(kept, merged, torch.full_like(merged, float("-inf"))).double()
        norm = torch.where(use_k, torch.logsumexp(masked, dim=1).float(), lse).double()
        probs = torch.exp(masked - norm.unsqueeze(1))
        before = probs.cumsum(dim=1) - probs
        m = ((before < params.top_p.double().unsqueeze(1)) & kept).sum(dim=1).clamp(min=1)
        cut_p = merged.gather(1, (m - 1).unsqueeze(1)).squeeze(1)
        # Without top-k the nucleus must end inside the exactly known prefix of candidates: a
        # data-dependent check, the one host read the sampler makes (top-p-only rows only).
        if params.top_p_only:
            open_p = use_p & ~use_k
            short = open_p & ((m >= n) if n < self.tp * self.local_size else torch.zeros_like(open_p))
            if bool((short | (open_p & (cut_p < bound))).any()):
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
