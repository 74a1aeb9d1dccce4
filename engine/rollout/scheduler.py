"""Continuous batching over KV-cache slots.

Every sample of every request is a sequence. The scheduler keeps up to
``slots`` sequences in flight and alternates two kinds of forward:

* **prefill** of newly admitted sequences (prompts sorted by length, batched up to
  ``max_prefill_tokens`` padded tokens, in chunks of ``prefill_chunk_size`` for
  long prompts). The samples of one prompt share its prefill: the prompt runs
  once and its KV cache is copied to the siblings' slots; the logits of its last
  token are kept until every sibling has drawn its first token;
* **decode** of every running sequence, one token each.

After each sampled token a sequence may finish (EOS / stop id / max_new_tokens /
context limit); its slot is freed at once and, with the ``continuous`` policy, the
next pending sequence is admitted before the next decode step, so decode steps
never carry finished rows. The ``static`` policy admits only when nothing is
running (whole batches; finished rows still leave the forward). Running sequences
are kept in slots ``0..n-1`` (when a hole opens below a running sequence and no new
prompt fills it, the highest sequence moves down once), so every decode step reads
one contiguous span of the cache.

Each decode step is planned from the host's own integers (slots, lengths, last
tokens, sampling parameters) and reads the device once: the drawn tokens and their
log-probs, which the stop rules need.

All TP ranks of a replica run this loop in lockstep: every decision depends only
on sampled tokens, which the sampler makes identical on all of them. With
pipeline parallelism the stages do too: the last stage samples and the
:class:`~hyflow.rollout.sampler.PipelineSampler` broadcasts the tokens (and
log-probs) to the others.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from hyflow.rollout.config import GenerationConfig, SamplingConfig
from hyflow.rollout.host import to_device
from hyflow.rollout.kv_cache import KVCache
from hyflow.rollout.request import RolloutStats, SampleOutput
from hyflow.rollout.runner import ModelRunner
from hyflow.rollout.sampler import RowParams, VocabParallelSampler


@dataclass
class Sequence:
    """Scheduler state of one sample."""

    out: SampleOutput
    params: SamplingConfig
    stream: int
    stops: frozenset
    max_new: int
    slot: int = -1
    length: int = 0  # tokens whose keys / values are in the cache
    last: int = -1  # last sampled token (fed at the next decode step)

    @property
    def group(self) -> int:
        return self.out.request_index

    @property
    def prompt(self) -> list[int]:
        return self.out.prompt_ids


@dataclass
class _Prefix:
    """A prompt whose prefill some of its samples still need."""

    slot: int  # slot holding the prompt's keys / values (-1: none alive)
    logits: torch.Tensor  # local logits of the prompt's last token
    waiting: int  # siblings not yet admitted


@dataclass
class Scheduler:
    """Runs sequences to completion on one replica (see the module docstring)."""

    runner: ModelRunner
    sampler: VocabParallelSampler
    cache: KVCache
    config: GenerationConfig
    stats: RolloutStats = field(default_factory=RolloutStats)
    on_finish: Optional[Callable[[SampleOutput], None]] = None  # called with each completed sample

    def __post_init__(self) -> None:
        self._device = self.runner.device
        self._prefixes: dict[int, _Prefix] = {}

    # ------------------------------------------------------------------ loop
    def run(self, seqs: list[Sequence]) -> None:
        """Generate every sequence (fills ``seq.out`` in place)."""
        pending = deque(seqs)
        remaining: dict[int, int] = {}
        for s in seqs:
            remaining[s.group] = remaining.get(s.group, 0) + 1
        free = list(range(self.cache.slots))
        active: dict[int, Sequence] = {}
        continuous = self.config.batching == "continuous"
        while pending or active:
            if pending and free and (continuous or not active):
                admitted = []
                while pending and len(admitted) < len(free):
                    admitted.append(pending.popleft())
                free.sort()
                for seq, slot in zip(admitted, free):
                    seq.slot = slot
                del free[:len(admitted)]
                for seq in self._admit(admitted, remaining):
                    self._release(seq, free, active)
                for seq in admitted:
                    if seq.out.finish_reason is None:
                        active[seq.slot] = seq
            if active:
                self._compact(active, free)
                for seq in self._decode([active[s] for s in range(len(active))]):
                    self._release(seq, free, active)

    def _compact(self, active: dict[int, Sequence], free: list[int]) -> None:
        """Keep the running sequences in slots ``0..n-1``: move the highest ones into the holes
        below ``n``. A decode batch is then one contiguous span of the cache, read as a view; the
        move copies a sequence once, where reading a sparse span would cost every step."""
        n = len(active)
        holes = [slot for slot in range(n) if slot not in active]
        movers = sorted((slot for slot in active if slot >= n), reverse=True)
        for hole, src in zip(holes, movers):
            seq = active.pop(src)
            self.cache.move(src, hole, seq.length)
            seq.slot = hole
            active[hole] = seq
            prefix = self._prefixes.get(seq.group)
            if prefix is not None and prefix.slot == src:
                prefix.slot = hole
            free.remove(hole)
            free.append(src)
            self.stats.compactions += 1

    def _release(self, seq: Sequence, free: list[int], active: dict[int, Sequence]) -> None:
        if self.on_finish is not None:
            self.on_finish(seq.out)
        active.pop(seq.slot, None)
        free.append(seq.slot)
        prefix = self._prefixes.get(seq.group)
        if prefix is not None and prefix.slot == seq.slot:
            prefix.slot = -1  # the prompt's cache is gone; a late sibling re-prefills
        seq.slot = -1

    # --------------------------------------------------------------- prefill
    def _admit(self, seqs: list[Sequence], remaining: dict[int, int]) -> list[Sequence]:
        """Prefill (or copy) the prompts of ``seqs``, draw each first token; return finished ones."""
        share = self.config.share_prompt_prefill
        primaries: list[Sequence] = []
        copies: list[tuple[Sequence, Sequence]] = []  # (sibling, primary admitted with it)
        seen: dict[int, Sequence] = {}
        for seq in seqs:
            prefix = self._prefixes.get(seq.group) if share else None
            if prefix is not None and prefix.slot >= 0:
                self.cache.copy_prefix(prefix.slot, [seq.slot], len(seq.prompt))
            elif share and seq.group in seen:
                copies.append((seq, seen[seq.group]))
            else:
                primaries.append(seq)
                seen[seq.group] = seq
        logits = self._prefill(primaries)
        for seq in primaries:
            if share:
                old = self._prefixes.get(seq.group)
                waiting = old.waiting if old is not None else remaining[seq.group]
                self._prefixes[seq.group] = _Prefix(seq.slot, logits[seq.slot], waiting)
        for sib, prim in copies:
            self.cache.copy_prefix(prim.slot, [sib.slot], len(sib.prompt))
        rows = []
        for seq in seqs:
            seq.length = len(seq.prompt)
            if share:
                prefix = self._prefixes[seq.group]
                rows.append(prefix.logits)
                prefix.waiting -= 1
                if prefix.waiting == 0:
                    del self._prefixes[seq.group]
            else:
                rows.append(logits[seq.slot])
        return self._sample_and_check(seqs, torch.stack(rows))

    def _prefill(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Run the prompts of ``seqs`` into their slots; logits of each last token by slot."""
        out: dict[int, torch.Tensor] = {}
        chunk = self.config.prefill_chunk_size
        budget = self.config.max_prefill_tokens
        order = sorted(seqs, key=lambda s: -len(s.prompt))
        i = 0
        while i < len(order):
            width = min(len(order[i].prompt), chunk) if chunk else len(order[i].prompt)
            rows = max(1, budget // max(width, 1))
            group = order[i:i + rows]
            i += len(group)
            self._prefill_group(group, out)
        return out

    def _prefill_group(self, group: list[Sequence], out: dict[int, torch.Tensor]) -> None:
        chunk = self.config.prefill_chunk_size or max(len(s.prompt) for s in group)
        longest = max(len(s.prompt) for s in group)
        for start in range(0, longest, chunk):
            live = [s for s in group if len(s.prompt) > start]
            width = min(chunk, max(len(s.prompt) for s in live) - start)
            flat, ends, rows = [], [], []
            for r, s in enumerate(live):
                piece = s.prompt[start:start + width]
                flat.append(piece + [0] * (width - len(piece)))
                if len(s.prompt) <= start + width:  # the prompt ends in this chunk
                    rows.append(r)
                    ends.append(len(s.prompt) - 1 - start)
            batch = self.runner.plan([s.slot for s in live], [start] * len(live), width)
            # one transfer: the rows that end a prompt, their last columns, every row's real length
            index = to_device(rows + ends + [min(len(s.prompt), start + width) for s in live], torch.long,
                              self._device)
            k = len(rows)
            logits = self.runner.forward(to_device(flat, torch.long, self._device), batch,
                                         rows=index[:k], cols=index[k:2 * k], lengths=index[2 * k:])
            self.stats.prefill_forwards += 1
            self.stats.prefill_tokens += len(live) * width
            for j, r in enumerate(rows):
                out[live[r].slot] = logits[j]

    # ---------------------------------------------------------------- decode
    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """One token for every running sequence; returns the ones that finished."""
        tokens = to_device([[s.last] for s in seqs], torch.long, self._device)
        batch = self.runner.plan([s.slot for s in seqs], [s.length for s in seqs], 1)
        logits = self.runner.forward(tokens, batch)
        for s in seqs:
            s.length += 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(seqs)
        return self._sample_and_check(seqs, logits)

    # -------------------------------------------------------------- sampling
    def _sample_and_check(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Draw one token per sequence from ``logits`` rows; apply stop rules."""
        params = [s.params for s in seqs]
        rp = RowParams.build(
            [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
            streams=[s.stream for s in seqs], steps=[len(s.out.token_ids) for s in seqs], device=self._device)
        tokens, logprobs = self.sampler(logits, rp)
        # The step's one device-to-host read: tokens (exact in float64) and log-probs together.
        drawn = torch.stack([tokens.double(), logprobs.double()], dim=1).tolist()
        finished = []
        for s, (tok, lp) in zip(seqs, drawn):
            tok = int(tok)
            out = s.out
            out.token_ids.append(tok)
            if s.params.logprobs:
                out.logprobs.append(lp)
            s.last = tok
            if tok in s.stops:
                out.finish_reason, out.stop_token = "stop", tok
                if not s.params.include_stop_token:
                    out.token_ids.pop()
                    if s.params.logprobs:
                        out.logprobs.pop()
            elif len(out.token_ids) >= s.max_new:
                out.finish_reason = "length"
            if out.finish_reason is not None:
                finished.append(s)
        return finished


def stop_ids(params: SamplingConfig, default_eos: list[int]) -> frozenset:
    """The ids that end a sequence under ``params``."""
    if params.ignore_eos:
        return frozenset()
    eos = params.eos_token_ids if params.eos_token_ids is not None else default_eos
    return frozenset(eos) | frozenset(params.stop_token_ids)


def capacity_needed(seqs: list[Sequence]) -> int:
    """Cache positions the longest sequence can use (its last token is never fed)."""
    return max(len(s.prompt) + s.max_new - 1 for s in seqs)

