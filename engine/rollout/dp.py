"""Micro-DP: split requests over generation replicas and gather the samples back, as tensors.

In a generation layout the ranks form replicas of TP_g x PP_g ranks. Replica ``r`` of a group of
``R`` replicas generates a contiguous share of the requests (sizes differ by at most one); every
rank of a replica (every TP rank of every stage) runs the same engine call and gets the replica's
full results. The shares are then all-gathered over ``dp_group`` — one rank per replica, the same
TP rank and stage — as flat tensors (:class:`SampleTensors`: a few integers per sample, the token
ids and the log-probs back to back; nothing is pickled), so every rank ends with all samples of the
group in (request, sample) order.

The RL step uses this with the micro-DP group of one training data-parallel rank (the replicas
carved out of that rank's model-parallel group), so data moves only inside that group
(:mod:`hyflow.rl.dispatch`); ``hyflow generate`` uses it with the whole generation DP group.
Seeds are keyed by the *global* request index (``request_offset``), so the samples do not depend
on the number of replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hyflow.models.routing_replay import routing_dtype
from hyflow.rollout.config import SamplingConfig
from hyflow.rollout.request import RolloutResult, RolloutStats, SampleOutput, as_requests

#: columns of ``SampleTensors.meta``
META = ("request", "sample", "prompt_len", "response_len", "finish", "truncated")
_FINISH = {None: 0, "stop": 1, "length": 2}
_FINISH_NAME = {v: k for k, v in _FINISH.items()}
_STATS = ("samples", "prompt_tokens", "generated_tokens", "prefill_tokens", "prefill_forwards",
          "decode_steps", "decode_rows", "truncated_prompts")


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges covering ``range(count)``, sizes within 1."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(count, parts)
    out, start = [], 0
    for r in range(parts):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return out


@dataclass
class SampleTensors:
    """Samples as three flat tensors, the wire format of the data plane.

    Attributes:
        meta: [N, 6] int64, one row per sample: request index, sample index, prompt length,
            response length, finish reason (0 none, 1 stop, 2 length), prompt tokens truncated.
        tokens: [sum(prompt + response lengths)] int64, each sample's prompt then response.
        logprobs: [sum(response lengths)] float32, the sampler's log-probs of the response tokens.
        mask: None (every response token was sampled), or [sum(response lengths)] float32: 1 on
            sampled tokens, 0 on tokens the sampler did not produce (a multi-turn trajectory's
            observations, :mod:`hyflow.agent`), which are context only.
        stats: None, or [N, k] float64 per-sample counters gathered with the samples (a
            multi-turn trajectory's turns, tool calls, end reason, ...: :mod:`hyflow.agent.trajectory`).
        routing: mixture-of-experts models that recorded it: [sum(prompt + response lengths), layers,
            top_k] (uint8 / int32), each token's experts (id + 1; 0 for the last token, which was never fed;
            :mod:`hyflow.models.routing_replay`), aligned with ``tokens``; else None.
        versions: None, or [sum(response lengths)] int64: the weight version that sampled each
            response token (``trainer.mode: async``, whose weights change at token boundaries).
    """

    meta: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: Optional[torch.Tensor] = None
    stats: Optional[torch.Tensor] = None
    routing: Optional[torch.Tensor] = None
    versions: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.meta.shape[0]

    def column(self, name: str) -> torch.Tensor:
        return self.meta[:, META.index(name)]

    @classmethod
    def from_samples(cls, samples: Sequence[SampleOutput], device: torch.device) -> "SampleTensors":
        """Pack ``samples`` (host objects from the engine) into tensors on ``device``."""
        meta = [[s.request_index, s.sample_index, len(s.prompt_ids), len(s.token_ids), _FINISH[s.finish_reason],
                 s.prompt_truncated] for s in samples]
        tokens = [t for s in samples for t in list(s.prompt_ids) + list(s.token_ids)]
        logprobs = []
        for s in samples:
            logprobs.extend(s.logprobs if len(s.logprobs) == len(s.token_ids) else [0.0] * len(s.token_ids))
        versions = None
        if samples and all(len(s.versions) == len(s.token_ids) for s in samples) and any(s.versions for s in samples):
            versions = torch.tensor([v for s in samples for v in s.versions], dtype=torch.long, device=device)
        return cls(meta=torch.tensor(meta, dtype=torch.long, device=device).view(-1, len(META)),
                   tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                   logprobs=torch.tensor(logprobs, dtype=torch.float32, device=device),
                   routing=_routing_column(samples, device), versions=versions)

    def sorted(self) -> "SampleTensors":
        """The samples in (request, sample) order."""
        if len(self) == 0:
            return self
        key = self.column("request") * (int(self.column("sample").max()) + 1) + self.column("sample")
        order = torch.argsort(key)
        return self.select(order)

    def select(self, order: torch.Tensor) -> "SampleTensors":
        """The samples ``order`` (indices), in that order."""
        lengths = self.column("prompt_len") + self.column("response_len")
        tok = _gather_runs(self.tokens, lengths, order)
        lp = _gather_runs(self.logprobs, self.column("response_len"), order)
        routing = _gather_runs(self.routing, lengths, order) if self.routing is not None else None
        mask = None if self.mask is None else _gather_runs(self.mask, self.column("response_len"), order)
        versions = None if self.versions is None else _gather_runs(self.versions, self.column("response_len"), order)
        return SampleTensors(meta=self.meta[order], tokens=tok, logprobs=lp, mask=mask,
                             stats=None if self.stats is None else self.stats[order], routing=routing,
                             versions=versions)

    @classmethod
    def concat(cls, parts: Sequence["SampleTensors"]) -> "SampleTensors":
        """The samples of ``parts`` one after another (masks and stats kept when every part has them)."""
        def cat(name: str) -> Optional[torch.Tensor]:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else torch.cat(values)

        return cls(meta=cat("meta"), tokens=cat("tokens"), logprobs=cat("logprobs"), mask=cat("mask"),
                   stats=cat("stats"), routing=cat("routing"), versions=cat("versions"))

    def replace_logprobs(self, logprobs: torch.Tensor) -> "SampleTensors":
        """The same samples with other response log-probs (flat, as ``logprobs``)."""
        return SampleTensors(self.meta, self.tokens, logprobs, self.mask, self.stats, self.routing, self.versions)

    def to_outputs(self) -> list[SampleOutput]:
        """Host ``SampleOutput`` objects (for ``hyflow generate`` and tests)."""
        meta, tokens, logprobs = self.meta.tolist(), self.tokens.tolist(), self.logprobs.tolist()
        out, t, l_ = [], 0, 0
        for req, smp, plen, rlen, fin, trunc in meta:
            prompt, resp = tokens[t:t + plen], tokens[t + plen:t + plen + rlen]
            lps = logprobs[l_:l_ + rlen]
            t, l_ = t + plen + rlen, l_ + rlen
            out.append(SampleOutput(request_index=req, sample_index=smp, prompt_ids=prompt, token_ids=resp,
                                    logprobs=lps, finish_reason=_FINISH_NAME[fin], prompt_truncated=trunc))
        if self.versions is not None:
            versions, v = self.versions.tolist(), 0
            for o in out:
                o.versions, v = versions[v:v + len(o.token_ids)], v + len(o.token_ids)
        if self.routing is not None:
            starts = (torch.cumsum(self.column("prompt_len") + self.column("response_len"), 0)).tolist()
            for o, end in zip(out, starts):
                o.routing = self.routing[end - len(o.prompt_ids) - len(o.token_ids):end]
        return out


def _routing_column(samples: Sequence[SampleOutput], device: torch.device) -> Optional[torch.Tensor]:
    """The samples' recorded experts back to back, each padded with zeros (no record) to its
    ``prompt + response`` length; None when no sample has any."""
    recorded = [s.routing for s in samples if s.routing is not None]
    if not recorded:
        return None
    layers, k = recorded[0].shape[1:]
    parts = []
    for s in samples:
        n = len(s.prompt_ids) + len(s.token_ids)
        part = torch.zeros((n, layers, k), dtype=recorded[0].dtype, device=device)
        if s.routing is not None:
            part[:min(n, s.routing.shape[0])] = s.routing[:n].to(device)
        parts.append(part)
    return torch.cat(parts)


def _gather_runs(flat: torch.Tensor, lengths: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The runs of ``flat`` (back to back, ``lengths`` long) in ``order``, concatenated."""
    if flat.numel() == 0:
        return flat
    starts = torch.cumsum(lengths, 0) - lengths
    picked_len = lengths[order]
    total = int(picked_len.sum())
    run = torch.repeat_interleave(torch.arange(len(order), device=flat.device), picked_len, output_size=total)
    offset_in_run = torch.arange(total, device=flat.device) - torch.repeat_interleave(
        torch.cumsum(picked_len, 0) - picked_len, picked_len, output_size=total)
    return flat[starts[order][run] + offset_in_run]


def _all_gather_padded(t: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """Every rank's ``t`` (first dim ``sizes[r]`` on rank r) through one equal-size all-gather."""
    longest = max(sizes)
    padded = t.new_zeros((longest,) + tuple(t.shape[1:]))
    padded[:t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [p[:n] for p, n in zip(parts, sizes)]


def all_gather_samples(local: SampleTensors, group) -> SampleTensors:
    """The samples of every rank of ``group``, concatenated in group-rank order (4 collectives; one more
    each for a mask and stats)."""
    if group is None or group.size() == 1:
        return local
    device = local.meta.device
    sizes = torch.tensor([len(local), local.tokens.numel(), local.logprobs.numel()], dtype=torch.long, device=device)
    every = [torch.empty_like(sizes) for _ in range(group.size())]
    dist.all_gather(every, sizes, group=group)
    n, t, r = (list(col) for col in zip(*(e.tolist() for e in every)))
    meta = torch.cat(_all_gather_padded(local.meta, n, group))
    tokens = torch.cat(_all_gather_padded(local.tokens, t, group))
    logprobs = torch.cat(_all_gather_padded(local.logprobs, r, group))
    routing = None
    if local.routing is not None:  # every replica of a routing-recording engine records
        routing = torch.cat(_all_gather_padded(local.routing, t, group))
    mask = None if local.mask is None else torch.cat(_all_gather_padded(local.mask, r, group))
    stats = None if local.stats is None else torch.cat(_all_gather_padded(local.stats, n, group))
    versions = None if local.versions is None else torch.cat(_all_gather_padded(local.versions, r, group))
    return SampleTensors(meta=meta, tokens=tokens, logprobs=logprobs, mask=mask, stats=stats,
                         routing=routing, versions=versions)


def stats_tensor(stats: RolloutStats, device: torch.device) -> torch.Tensor:
    """The counters of ``stats`` as a float64 vector (to sum over ranks)."""
    return torch.tensor([float(getattr(stats, k)) for k in _STATS], dtype=torch.float64, device=device)


def stats_from_tensor(values: torch.Tensor, seconds: float = 0.0) -> RolloutStats:
    return RolloutStats(**{k: int(v) for k, v in zip(_STATS, values.tolist())}, seconds=seconds)


@dataclass
class GatheredRollout:
    """What :func:`generate_data_parallel` returns: the group's samples (sorted) and counters."""

    samples: SampleTensors
    stats: RolloutStats

    def to_result(self) -> RolloutResult:
        return RolloutResult(samples=self.samples.to_outputs(), stats=self.stats)


def generate_data_parallel(engine, requests: Sequence, dp_group=None, sampling: Optional[SamplingConfig] = None,
                           request_offset: int = 0, device: Optional[torch.device] = None,
                           **partial) -> GatheredRollout:
    """Generate ``requests`` over the replicas of ``dp_group``; every rank gets every sample.

    Args:
        engine: this replica's :class:`~hyflow.rollout.engine.GenerationEngine`.
        requests: the group's requests (identical on every rank of the group).
        dp_group: one rank per replica (same TP rank and stage); None or size 1 runs everything here.
        sampling: sampling settings for requests without their own.
        request_offset: global index of ``requests[0]`` (seeds and request indices use it).
        device: where the gathered tensors live (default: the engine model's device).
        partial: ``version`` / ``on_decode`` / ``partial`` for the engine's weight updates at token
            boundaries (:meth:`~hyflow.rollout.engine.GenerationEngine.generate`; ``trainer.mode: async``).

    Returns the gathered samples in (request, sample) order; ``stats`` sums the replicas' counters
    (the wall time is this replica's).
    """
    reqs = as_requests(requests)
    size = dp_group.size() if dp_group is not None else 1
    rank = dp_group.rank() if dp_group is not None else 0
    device = device or next(engine.runner.model.parameters()).device
    start, stop = split_evenly(len(reqs), size)[rank]
    result = engine.generate(reqs[start:stop], sampling, request_offset=request_offset + start, **partial) \
        if stop > start else RolloutResult(samples=[], stats=RolloutStats())
    local = SampleTensors.from_samples(result.samples, device)
    if engine.config.record_routing and local.routing is None:  # an idle replica joins the exchange too
        cfg = engine.runner.model.config
        local.routing = torch.zeros((local.tokens.numel(), cfg.num_layers, cfg.moe_router_topk),
                                    dtype=routing_dtype(cfg.num_moe_experts), device=device)
    gathered = all_gather_samples(local, dp_group).sorted()
    counters = stats_tensor(result.stats, device)
    if size > 1:
        dist.all_reduce(counters, group=dp_group)
    return GatheredRollout(samples=gathered, stats=stats_from_tensor(counters, result.stats.seconds))
