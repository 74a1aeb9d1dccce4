"""The rollout engine: batched KV-cache generation with the actor's Megatron model.

Typical use on one generation replica (all TP ranks of it call the same)::

    engine = GenerationEngine.from_description(model, desc, GenerationConfig(...))
    result = engine.generate([[1, 2, 3], [4, 5]])
    batch = result.to_tensors()            # responses, response_mask, logprobs, ...

With several micro-DP replicas use :func:`hyflow.rollout.dp.generate_data_parallel`.

The engine validates requests (empty prompts, prompts over the context limit:
an error, or left truncation with a logged count when ``truncate_long_prompts``),
turns every (request, sample) into a scheduler sequence, allocates a KV cache
sized for this call (``min(max_concurrent, samples)`` slots x the longest
prompt + response) and frees it on return, so the memory goes back to training.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Optional, Sequence as Seq

import torch
import torch.distributed as dist

from hyflow.config import ConfigError
from hyflow.models.routing_replay import recording
from hyflow.monitor import comm
from hyflow.rollout.config import GenerationConfig, SamplingConfig
from hyflow.rollout.request import GenerationRequest, RolloutResult, RolloutStats, SampleOutput, as_requests
from hyflow.rollout.runner import ModelRunner
from hyflow.rollout.sampler import PipelineSampler, VocabParallelSampler, stream_seed
from hyflow.rollout.scheduler import Scheduler, Sequence, capacity_needed, stop_ids

LOG = logging.getLogger("hyflow.rollout")


def gather_stage_routing(outputs: Seq[SampleOutput], pp_group) -> None:
    """With pipeline stages each stage recorded its own layers' experts: give every stage every
    layer's (``out.routing`` ``[tokens, all layers, k]``, stages in order). All stages fed the same
    tokens (their schedulers run in lockstep), so one all-gather of the concatenated records, padded
    to the stage with the most layers, does it."""
    local = torch.cat([o.routing for o in outputs]) if outputs else None
    if local is None:
        return
    counts = torch.tensor([local.shape[1]], dtype=torch.long, device=local.device)
    every = [torch.empty_like(counts) for _ in range(pp_group.size())]
    dist.all_gather(every, counts, group=pp_group)
    layers = [int(c) for c in every]
    padded = local.new_zeros((local.shape[0], max(layers), local.shape[2]))
    padded[:, :local.shape[1]] = local
    parts = [torch.empty_like(padded) for _ in layers]
    dist.all_gather(parts, padded, group=pp_group)
    full = torch.cat([part[:, :n] for part, n in zip(parts, layers)], dim=1)
    start = 0
    for o in outputs:
        n = o.routing.shape[0]
        o.routing = full[start:start + n]
        start += n


class PromptTooLongError(ValueError):
    """A prompt does not fit the context limit (and truncation is off)."""


class GenerationEngine:
    """Generates responses on one replica of the generation layout.

    Args:
        model: the actor's ``GPTModel`` in the generation layout: the whole model, or
            this rank's pipeline stage of it (generation PP > 1; every rank of the
            replica, all stages and TP ranks, calls :meth:`generate` with the same
            requests and gets the full results; the stages run one after another,
            see :mod:`hyflow.rollout.runner`).
        config: engine and default sampling settings.
        vocab_size: the real (unpadded) vocabulary size; padded ids are never sampled.
        eos_token_ids: default end-of-sequence ids (``SamplingConfig.eos_token_ids`` overrides).
        tp_group: the generation TP group (default: the model's).
        pp_group: the generation PP group (default: the model's ``pg_collection.pp``).
        max_position_embeddings: the model's context length (default: the model's
            ``max_sequence_length``); ``config.max_seq_len`` may lower it.
    """

    def __init__(self, model: torch.nn.Module, config: Optional[GenerationConfig] = None, *,
                 vocab_size: int, eos_token_ids: Seq[int] = (), tp_group=None,
                 max_position_embeddings: Optional[int] = None, pp_group=None) -> None:
        self.config = config or GenerationConfig()
        self.config.validate()
        self.runner = ModelRunner(model, tp_group, self.config.layer_impl, pp_group=pp_group)
        if not 0 < vocab_size <= self.runner.padded_vocab:
            raise ConfigError(f"vocab_size={vocab_size} must be in [1, {self.runner.padded_vocab}] "
                              "(the model's padded vocabulary)")
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        model_len = max_position_embeddings or int(getattr(self.runner.model, "max_sequence_length", 0) or 0)
        limit = self.config.max_seq_len or model_len
        if not limit:
            raise ConfigError("set GenerationConfig.max_seq_len (the model does not report its context length)",
                              key="max_seq_len")
        if model_len and limit > model_len:
            raise ConfigError(f"max_seq_len={limit} exceeds the model's context length {model_len}",
                              key="max_seq_len")
        self.max_seq_len = limit
        self.max_prompt_length = min(self.config.max_prompt_length or limit - 1, limit - 1)
        self.sampler = VocabParallelSampler(vocab_size, self.runner.local_vocab, self.runner.tp_group)
        if self.runner.pp_size > 1:
            self.sampler = PipelineSampler(self.sampler, self.runner.pp_group, self.runner.is_last_stage,
                                           self.runner.last_stage_rank)
        self.last_stats = RolloutStats()

    @classmethod
    def from_description(cls, model: torch.nn.Module, desc, config: Optional[GenerationConfig] = None,
                         tp_group=None, pp_group=None) -> "GenerationEngine":
        """Engine for a model built from a :class:`~hyflow.models.description.ModelDescription`."""
        return cls(model, config, vocab_size=desc.vocab_size, eos_token_ids=desc.eos_token_ids,
                   tp_group=tp_group, max_position_embeddings=desc.context_length,
                   pp_group=pp_group)

    # -------------------------------------------------------------- requests
    def prepare(self, requests: Seq, sampling: Optional[SamplingConfig] = None,
                request_offset: int = 0) -> tuple[list[Sequence], int]:
        """Validate ``requests`` and expand them into sequences (one per sample).

        Returns (sequences, number of truncated prompts). ``request_offset`` is the
        index of ``requests[0]`` in the whole batch (seeds and output indices use it).
        """
        return prepare_requests(requests, sampling or self.config.sampling, request_offset,
                                vocab_size=self.vocab_size, max_prompt_length=self.max_prompt_length,
                                max_seq_len=self.max_seq_len, truncate=self.config.truncate_long_prompts,
                                eos_token_ids=self.eos_token_ids)

    # -------------------------------------------------------------- generate
    def generate(self, requests: Seq, sampling: Optional[SamplingConfig] = None,
                 request_offset: int = 0, on_finish: Optional[Callable[[SampleOutput], None]] = None,
                 version: Optional[int] = None, on_decode: Optional[Callable] = None,
                 partial: str = "continue", resume: Optional[Seq[SampleOutput]] = None) -> RolloutResult:
        """Generate every sample of ``requests`` (token-id lists or :class:`GenerationRequest`).

        Collective over the replica's TP (and PP) groups. Returns samples ordered by
        (request, sample) with per-call :class:`RolloutStats`. ``on_finish(sample)`` is called
        with each sample as soon as it is complete, while the others still decode (multi-turn
        rollouts start the sample's tool calls there: :mod:`hyflow.agent.rollout`). ``version``: the
        weight version held, recorded per token; ``on_decode(scheduler)`` runs at every token boundary
        and returns a new version when it loaded new weights, ``partial`` says what the running samples
        do then (:class:`~hyflow.rollout.scheduler.Scheduler`; ``trainer.mode: async``). ``resume``: the
        samples of these requests as a checkpoint saved them half way: finished ones are kept, the
        others continue from their tokens (``partial=abort``: restart).
        """
        start = time.perf_counter()
        seqs, truncated = self.prepare(requests, sampling, request_offset)
        todo = seqs
        if resume is not None:
            saved = {(o.request_index, o.sample_index): o for o in resume}
            for s in seqs:
                s.out = saved.get((s.out.request_index, s.out.sample_index), s.out)
                if partial == "abort" and s.out.finish_reason is None:
                    s.out.token_ids, s.out.logprobs, s.out.versions = [], [], []
            todo = [s for s in seqs if s.out.finish_reason is None]
        stats = RolloutStats(samples=len(seqs), truncated_prompts=truncated,
                             prompt_tokens=sum(len(s.prompt) for s in seqs))
        if todo:
            cache = self.runner.new_cache(min(self.config.max_concurrent, len(todo)), capacity_needed(todo))
            record = recording(self.runner.model) if self.config.record_routing else contextlib.nullcontext()
            # the decode loop's TP all-reduces (two per layer per token) are counted, not CUDA-timed
            # packed copies of the weights would go stale when on_decode loads new ones: plain products then
            pack = self.config.cpu_weight_packing and on_decode is None
            with torch.inference_mode(), self.runner.attach(cache, pack), \
                    comm.untimed(), record as hooks:
                scheduler = Scheduler(self.runner, self.sampler, cache, self.config, stats, routing_hooks=hooks,
                                      on_finish=on_finish, version=version, on_decode=on_decode, partial=partial,
                                      outputs=[s.out for s in seqs])
                scheduler.run(todo)
            for s in seqs:
                s.finish_routing()
            if self.config.record_routing and self.runner.pp_size > 1:
                gather_stage_routing([s.out for s in seqs], self.runner.pp_group)
            del cache, scheduler
        stats.generated_tokens = sum(len(s.out.token_ids) for s in seqs)
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return RolloutResult(samples=[s.out for s in seqs], stats=stats)

    def stream(self, feed: Callable[[Scheduler], list[Sequence]], resume: Seq[Sequence] = (), *,
               max_new_tokens: int, max_sequences: Optional[int] = None,
               on_finish: Optional[Callable[[SampleOutput], None]] = None,
               version: Optional[int] = None, on_decode: Optional[Callable] = None,
               partial: str = "continue") -> RolloutStats:
        """Run sequences (from :meth:`prepare`) as ``feed(scheduler)`` supplies them, cache slots kept
        full, until it returns none with nothing left to run (one long-lived
        :class:`~hyflow.rollout.scheduler.Scheduler`; ``trainer.mode: async``). ``resume``: sequences a
        checkpoint saved half way (finished ones are not given), continued first (``partial=abort``:
        restarted). The cache holds ``rollout.max_concurrent`` slots (at most ``max_sequences``: the most
        the feeder ever has running) of the longest prompt plus ``max_new_tokens``. Results arrive
        through ``on_finish``; returns the run's counters."""
        if self.config.record_routing:  # refused by the async config check: experts across weight updates
            raise ValueError("stream() does not record routing")
        todo = list(resume)
        if partial == "abort":
            for s in todo:
                s.out.token_ids, s.out.logprobs, s.out.versions = [], [], []
        stats = RolloutStats()
        capacity = min(self.max_seq_len, self.max_prompt_length + max_new_tokens)
        slots = min(self.config.max_concurrent, max_sequences or self.config.max_concurrent)
        cache = self.runner.new_cache(max(slots, 1), capacity)
        with torch.inference_mode(), self.runner.attach(cache, False), comm.untimed():
            scheduler = Scheduler(self.runner, self.sampler, cache, self.config, stats, on_finish=on_finish,
                                  version=version, on_decode=on_decode, partial=partial, feed=feed)
            scheduler.run(todo)
        del cache, scheduler
        return stats

    def generate_one(self, prompt_ids: list[int], **sampling) -> SampleOutput:
        """Convenience: one prompt, one sample, sampling fields as keywords."""
        params = (self.config.sampling.replace(**sampling) if sampling else self.config.sampling)
        return self.generate([GenerationRequest(prompt_ids, sampling=params.replace(n=1))]).samples[0]


def prepare_requests(requests: Seq, default: SamplingConfig, request_offset: int, *, vocab_size: int,
                     max_prompt_length: int, max_seq_len: int, truncate: bool,
                     eos_token_ids: Seq[int]) -> tuple[list[Sequence], int]:
    """Validate ``requests`` and expand them into one :class:`Sequence` per sample: the prompt
    (left-truncated to ``max_prompt_length`` when ``truncate``, else an error), its sampling
    settings, stop ids, token budget and random stream (keyed by the global request index
    ``request_offset + i`` and the sample index). Every generation backend starts here, so they
    agree on what a request means. Returns (sequences, number of truncated prompts)."""
    default.validate()
    seqs: list[Sequence] = []
    truncated = 0
    too_long = []
    for i, req in enumerate(as_requests(requests)):
        index = request_offset + i
        params = req.sampling or default
        params.validate()
        prompt = [int(t) for t in req.prompt_ids]
        if not prompt:
            raise ValueError(f"request {index}: empty prompt (at least one token is needed)")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {index}: token ids {bad[:4]} outside the vocabulary "
                             f"[0, {vocab_size})")
        cut = 0
        if len(prompt) > max_prompt_length:
            if not truncate:
                too_long.append((index, len(prompt)))
                continue
            cut = len(prompt) - max_prompt_length
            prompt = prompt[cut:]
            truncated += 1
        # A request's own seed gives the same samples wherever the request sits in the batch.
        seed = req.seed if req.seed is not None else stream_seed(params.seed, index, 0)
        max_new = min(params.max_new_tokens, max_seq_len - len(prompt))
        stops = stop_ids(params, list(eos_token_ids))
        for j in range(params.n):
            out = SampleOutput(request_index=index, sample_index=j, prompt_ids=prompt,
                               prompt_truncated=cut)
            seqs.append(Sequence(out=out, params=params, stream=stream_seed(seed, 0, j),
                                 stops=stops, max_new=max_new))
    if too_long:
        shown = ", ".join(f"request {i}: {n} tokens" for i, n in too_long[:5])
        raise PromptTooLongError(
            f"{len(too_long)} prompt(s) exceed the prompt limit of {max_prompt_length} tokens "
            f"(max_prompt_length, at most the context limit max_seq_len={max_seq_len} minus one "
            f"new token): {shown}. "
            "Shorten them, raise max_seq_len, or set truncate_long_prompts=true to keep their last "
            f"{max_prompt_length} tokens.")
    if truncated:
        LOG.warning("truncated %d prompt(s) to their last %d tokens (truncate_long_prompts)",
                    truncated, max_prompt_length)
    return seqs, truncated
