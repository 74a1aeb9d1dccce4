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

from hyflow.models.routing_replay import take_recorded
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
    routing: list = field(default_factory=list)  # recorded experts, [layers, tokens, k] per forward
    context: Optional[list[int]] = None  # what a refresh re-feeds (prompt + response so far), else None
    #: the group its samples share a prompt in (default: its request index); a feeder that mixes requests of
    #: several calls keys them apart, e.g. ``(origin, request)``
    key: Optional[tuple] = None

    @property
    def feed(self) -> list[int]:
        """The tokens a prefill runs: the prompt, or the context a weight update re-feeds."""
        return self.prompt if self.context is None else self.context

    def finish_routing(self) -> None:
        """The recorded experts as ``out.routing`` ``[fed tokens, layers, k]``."""
        if self.routing:
            self.out.routing = torch.cat(self.routing, dim=1).transpose(0, 1).contiguous()
            self.routing = []

    @property
    def group(self):
        return self.out.request_index if self.key is None else self.key

    @property
    def order(self) -> tuple:
        """Where it sorts among the running sequences (a refresh re-feeds them in this order)."""
        return (self.group, self.out.sample_index)

    @property
    def prompt(self) -> list[int]:
        return self.out.prompt_ids


@dataclass
class _Prefix:
    """A prompt whose prefill some of its samples still need."""

    slot: int  # slot holding the prompt's keys / values (-1: none alive)
    logits: torch.Tensor  # local logits of the prompt's last token
    waiting: int  # siblings not yet admitted
    routing: list = field(default_factory=list)  # the prompt's recorded experts (routing replay)


@dataclass
class Scheduler:
    """Runs sequences to completion on one replica (see the module docstring)."""

    runner: ModelRunner
    sampler: VocabParallelSampler
    cache: KVCache
    config: GenerationConfig
    stats: RolloutStats = field(default_factory=RolloutStats)
    routing_hooks: Optional[list] = None  # recording routers (hyflow.models.routing_replay)
    on_finish: Optional[Callable[[SampleOutput], None]] = None  # called with each completed sample
    #: the weight version sampling now (recorded per token in ``out.versions``); None: not recorded
    version: Optional[int] = None
    #: called after every decode step (a token boundary); returns the new weight version when it
    #: loaded new weights into the model, else None (``trainer.mode: async``)
    on_decode: Optional[Callable[["Scheduler"], Optional[int]]] = None
    partial: str = "continue"  # after new weights: continue the running samples, or abort and re-queue them
    #: every sample of the call (finished ones included; their ``out`` is filled in place): what a
    #: checkpoint taken at a token boundary saves (``trainer.mode: async``)
    outputs: list = field(default_factory=list)
    #: ``feed(scheduler)``: more sequences to run, asked whenever cache slots are free that the queue
    #: cannot fill, and when nothing runs (it may wait then, and load new weights with
    #: :meth:`new_weights`); the run ends when it returns none with nothing left to run. None: the
    #: sequences given to :meth:`run` only
    feed: Optional[Callable[["Scheduler"], list]] = None

    def __post_init__(self) -> None:
        self._device = self.runner.device
        self._prefixes: dict[int, _Prefix] = {}

    # ------------------------------------------------------------------ loop
    def run(self, seqs: list[Sequence]) -> None:
        """Generate every sequence (fills ``seq.out`` in place). A sequence whose ``out`` holds tokens
        already (a sample half generated when a checkpoint was taken) continues: its prompt and
        response but the last token are prefilled into a slot, and the next decode step feeds that
        token, as after a weight update (:meth:`new_weights`)."""
        self._pending = pending = deque(s for s in seqs if not s.out.token_ids)
        remaining: dict[int, int] = {}
        for s in pending:
            remaining[s.group] = remaining.get(s.group, 0) + 1
        self._free = free = list(range(self.cache.slots))
        self._active = active = {}
        resumed = [s for s in seqs if s.out.token_ids]
        if resumed:
            if len(resumed) > len(free):  # zip below would drop the rest: never lose a saved sample
                raise ValueError(f"{len(resumed)} half-generated samples to continue but {len(free)} cache slots: "
                                 "resume with the rollout.max_concurrent the checkpoint was written with")
            for seq, slot in zip(resumed, free):
                seq.slot, seq.last = slot, seq.out.token_ids[-1]
                seq.context = (seq.prompt + seq.out.token_ids)[:-1]
                seq.length = len(seq.context)
                active[slot] = seq
            del free[:len(resumed)]
            self._prefill(resumed)
            for seq in resumed:
                seq.context = None
        continuous = self.config.batching == "continuous"
        self._remaining = remaining
        while True:
            if self.feed is not None and len(free) > len(pending) and (continuous or not active):
                self._add(self.feed(self))
            if not (pending or active):
                if self.feed is None or not self._add(self.feed(self)):
                    break
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
                if self.on_decode is not None:
                    version = self.on_decode(self)
                    if version is not None:
                        self.new_weights(version)

    def _add(self, seqs: list[Sequence]) -> int:
        """Queue ``seqs`` (from :attr:`feed`) behind the pending ones; returns how many."""
        for s in seqs:
            self._pending.append(s)
            self._remaining[s.group] = self._remaining.get(s.group, 0) + 1
        return len(seqs)

    def cancel(self, outs: list) -> None:
        """Stop the sequences whose ``out`` is in ``outs`` (running or queued) and free their slots; their
        outputs stay as they are (a feeder that no longer needs them: ``trainer.mode: async``)."""
        ids = {id(o) for o in outs}
        for slot, seq in list(self._active.items()):
            if id(seq.out) in ids:
                self._active.pop(slot)
                self._free.append(slot)
                self._prefixes.pop(seq.group, None)  # the feeder stops whole prompts: no sibling needs it
                seq.slot = -1
        for seq in [s for s in self._pending if id(s.out) in ids]:
            self._pending.remove(seq)
            self._prefixes.pop(seq.group, None)

    @property
    def running(self) -> int:
        """Sequences decoding now."""
        return len(self._active)

    @property
    def queued(self) -> int:
        """Sequences waiting for a cache slot."""
        return len(self._pending)

    @property
    def queue(self) -> list:
        """The outputs of the sequences waiting for a cache slot, in admission order (a checkpoint keeps it)."""
        return [s.out for s in self._pending]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def new_weights(self, version: int) -> None:
        """The model holds weight version ``version`` from this token boundary on. ``continue``: every
        running sequence's cache is recomputed with them (its prompt and response so far re-fed, as a
        prefill into its own slot), so each later token's log-prob is exactly the new weights' (the
        behaviour policy of that token); ``abort``: running sequences drop their tokens and go back to
        the front of the queue (their random streams restart, so they draw as if first admitted now).
        Prompts cached for siblings not yet admitted are re-prefilled when those are admitted."""
        self.version = version
        for prefix in self._prefixes.values():
            prefix.slot = -1
        # (request, sample) order, the order a resumed batch re-feeds them in (same prefill groups)
        running = sorted(self._active.values(), key=lambda q: q.order)
        if self.partial == "abort":
            for seq in reversed(running):
                self._active.pop(seq.slot)
                self._free.append(seq.slot)
                seq.slot, seq.length, seq.last = -1, 0, -1
                seq.out.token_ids, seq.out.logprobs, seq.out.versions = [], [], []
                self.stats.aborted_samples += 1
                self._pending.appendleft(seq)
            return
        for seq in running:
            seq.context = (seq.prompt + seq.out.token_ids)[:seq.length]
        if running:
            self._prefill(running)
        for seq in running:
            seq.context = None

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
                seq.routing = list(prefix.routing)
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
                self._prefixes[seq.group] = _Prefix(seq.slot, logits[seq.slot], waiting, list(seq.routing))
        for sib, prim in copies:
            self.cache.copy_prefix(prim.slot, [sib.slot], len(sib.prompt))
            sib.routing = list(prim.routing)
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
        order = sorted(seqs, key=lambda s: -len(s.feed))
        i = 0
        while i < len(order):
            width = min(len(order[i].feed), chunk) if chunk else len(order[i].feed)
            rows = max(1, budget // max(width, 1))
            group = order[i:i + rows]
            i += len(group)
            self._prefill_group(group, out)
        return out

    def _prefill_group(self, group: list[Sequence], out: dict[int, torch.Tensor]) -> None:
        chunk = self.config.prefill_chunk_size or max(len(s.feed) for s in group)
        longest = max(len(s.feed) for s in group)
        for start in range(0, longest, chunk):
            live = [s for s in group if len(s.feed) > start]
            width = min(chunk, max(len(s.feed) for s in live) - start)
            flat, ends, rows = [], [], []
            for r, s in enumerate(live):
                piece = s.feed[start:start + width]
                flat.append(piece + [0] * (width - len(piece)))
                if len(s.feed) <= start + width:  # the prompt ends in this chunk
                    rows.append(r)
                    ends.append(len(s.feed) - 1 - start)
            batch = self.runner.plan([s.slot for s in live], [start] * len(live), width)
            # one transfer: the rows that end a prompt, their last columns, every row's real length
            index = to_device(rows + ends + [min(len(s.feed), start + width) for s in live], torch.long,
                              self._device)
            k = len(rows)
            logits = self.runner.forward(to_device(flat, torch.long, self._device), batch,
                                         rows=index[:k], cols=index[k:2 * k], lengths=index[2 * k:])
            self.stats.prefill_forwards += 1
            self.stats.prefill_tokens += len(live) * width
            for j, r in enumerate(rows):
                out[live[r].slot] = logits[j]
            recorded = self._recorded(width, len(live))
            if recorded is not None:  # each row's real prompt tokens
                for r, s in enumerate(live):
                    s.routing.append(recorded[:, :min(len(s.feed) - start, width), r])

    # ---------------------------------------------------------------- decode
    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """One token for every running sequence; returns the ones that finished."""
        tokens = to_device([[s.last] for s in seqs], torch.long, self._device)
        batch = self.runner.plan([s.slot for s in seqs], [s.length for s in seqs], 1)
        logits = self.runner.forward(tokens, batch)
        recorded = self._recorded(1, len(seqs))
        for i, s in enumerate(seqs):
            s.length += 1
            if recorded is not None:
                s.routing.append(recorded[:, :, i])
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(seqs)
        return self._sample_and_check(seqs, logits)

    def _recorded(self, width: int, rows: int) -> Optional[torch.Tensor]:
        """The last forward's experts ``[layers, width, rows, k]`` (the routers see the tokens of a
        ``[rows, width]`` input in ``[width, rows]`` order), or None when not recording."""
        if not self.routing_hooks:
            return None
        recorded = take_recorded(self.routing_hooks)
        return None if recorded is None else recorded.view(recorded.shape[0], width, rows, -1)

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
            if self.version is not None:
                out.versions.append(self.version)
            s.last = tok
            if tok in s.stops:
                out.finish_reason, out.stop_token = "stop", tok
                if not s.params.include_stop_token:
                    out.token_ids.pop()
                    if s.params.logprobs:
                        out.logprobs.pop()
                    if self.version is not None:
                        out.versions.pop()
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

