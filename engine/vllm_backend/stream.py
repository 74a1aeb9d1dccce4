"""A long-lived streaming run on vLLM's in-process engine (``trainer.mode: async`` with ``rollout.backend: vllm``).

:class:`VLLMStream` gives the feeder and the token-boundary hook of :mod:`hyflow.jobs.fully_async`
what hyflow's :class:`~hyflow.rollout.scheduler.Scheduler` gives them (the
:class:`hyflow.roles.GenerationRun` surface), over vLLM's own step loop (``LLMEngine.add_request`` /
``step`` / ``abort_request``):

* **slots**: vLLM's ``max_num_seqs``; a sequence holds one from its submission to vLLM until it
  finishes. ``feed`` is asked for more whenever slots are free that the queue cannot fill, and when
  nothing runs; the run ends when it returns none with nothing left to run.
* **token boundary**: after every ``LLMEngine.step()`` (one forward: new requests' prefills and one
  token for every running one). Each new token is appended with its sampled-token log-prob (vLLM's
  raw log-probs, the engine's temperature in the logits: :mod:`hyflow.vllm_backend.engine`) and the
  weight version held (``out.versions``); ``on_finish`` gets each finished sample, ``on_decode`` the
  run, which may load new weights into vLLM and return their version.
* **new weights** (:meth:`VLLMStream.new_weights`): every request in vLLM is aborted and the prefix
  cache reset (its blocks hold keys / values of the old weights); ``continue`` re-adds each running
  sample with its prompt plus the tokens drawn so far as the prompt (vLLM recomputes their keys and
  values with the new weights, the next token is drawn from them), ``abort`` drops the tokens and
  queues the sample again from its prompt, ahead of the rest.
* **seeds**: a sample first runs with its hyflow stream as vLLM's per-request seed (the seed
  :meth:`~hyflow.vllm_backend.engine.VLLMEngine.generate` gives it); a sample re-added after
  ``t > 0`` tokens runs with :func:`continued_seed` (its stream, ``t``), so the same schedule gives
  the same tokens, and a checkpoint's half-generated sample (``resume``) continues exactly as the
  straight run continued it after the weight update the checkpoint was taken at.

Every rank of a replica runs the same calls in the same order (vLLM's external launcher keeps its
TP ranks in lockstep), and every decision here depends only on sampled tokens, which are the same
on all of them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

from hyflow.rollout.request import RolloutStats, SampleOutput
from hyflow.rollout.sampler import stream_seed

#: vLLM seeds torch.Generator objects, which take seeds below 2**63 without complaint.
SEED_MASK = (1 << 63) - 1


def continued_seed(stream: int, tokens: int) -> int:
    """vLLM's seed for a sample (hyflow stream ``stream``) submitted with ``tokens`` tokens drawn
    already: its stream itself at 0 (a fresh start, as ``generate`` seeds it), else a stream mixed
    with the count, so each re-submission draws anew and deterministically."""
    return (stream if tokens == 0 else stream_seed(stream, tokens, 1)) & SEED_MASK


def sampling_params(seq, scaled: bool, delta: bool = True):
    """vLLM's ``SamplingParams`` for sequence ``seq`` (:class:`~hyflow.rollout.scheduler.Sequence`),
    continued after its tokens so far: one sample, the budget left, hyflow's stop ids, the
    sampled-token log-prob. ``scaled``: the temperature is in the logits (vLLM samples at 1), else
    greedy; ``delta``: each step's output holds the new tokens only (else vLLM's default)."""
    from vllm import SamplingParams  # optional dependency (loaded by then)
    from vllm.sampling_params import RequestOutputKind  # optional dependency (loaded by then)

    done = len(seq.out.token_ids)
    return SamplingParams(
        n=1, temperature=1.0 if scaled else 0.0, top_k=seq.params.top_k, top_p=seq.params.top_p,
        max_tokens=seq.max_new - done, seed=continued_seed(seq.stream, done), stop_token_ids=sorted(seq.stops),
        ignore_eos=True, logprobs=0 if seq.params.logprobs else None, detokenize=False,
        **({"output_kind": RequestOutputKind.DELTA} if delta else {}))


def fill_finish(seq, finish_reason: Optional[str]) -> None:
    """``seq.out``'s finish reason and stop token from vLLM's (the stop token is dropped from the
    response unless ``include_stop_token``)."""
    out = seq.out
    stopped = finish_reason == "stop" and out.token_ids and out.token_ids[-1] in seq.stops
    out.finish_reason = "stop" if stopped else "length"
    if stopped:
        out.stop_token = out.token_ids[-1]
        if not seq.params.include_stop_token:
            out.token_ids.pop()
            if out.logprobs:
                out.logprobs.pop()
            if out.versions:
                out.versions.pop()


class VLLMStream:
    """One streaming run on ``llm_engine`` (vLLM's ``LLMEngine``; see the module docstring).
    ``slots``: sequences in vLLM at most; ``scaled``: the temperature is in the logits."""

    def __init__(self, llm_engine, slots: int, scaled: bool, *, version: Optional[int], partial: str,
                 on_finish: Optional[Callable[[SampleOutput], None]], on_decode: Optional[Callable],
                 feed: Optional[Callable], reset_prefix_cache: Callable[[], bool], stats: RolloutStats) -> None:
        self.engine, self.slots, self.scaled = llm_engine, slots, scaled
        self.version, self.partial = version, partial
        self.on_finish, self.on_decode, self.feed = on_finish, on_decode, feed
        self.reset_prefix_cache, self.stats = reset_prefix_cache, stats
        self._pending: deque = deque()  # sequences not in vLLM yet
        self._active: dict[str, object] = {}  # vLLM request id -> sequence
        self._submitted = 0

    # ------------------------------------------------------------- the GenerationRun surface (hyflow.roles)
    running = property(lambda self: len(self._active))  # in vLLM (its own waiting queue included)
    queued = property(lambda self: len(self._pending))
    free_slots = property(lambda self: self.slots - len(self._active))

    def cancel(self, outs: list) -> None:
        """Stop the sequences whose ``out`` is in ``outs`` (in vLLM or queued) and free their slots; their
        outputs stay as they are."""
        ids = {id(o) for o in outs}
        stopped = [rid for rid, seq in self._active.items() if id(seq.out) in ids]
        if stopped:
            self.engine.abort_request(stopped)
            for rid in stopped:
                del self._active[rid]
        self._pending = deque(s for s in self._pending if id(s.out) not in ids)

    def new_weights(self, version: int) -> None:
        """vLLM holds weight version ``version`` from this token boundary on (the module docstring:
        every request aborted, the prefix cache reset, the running samples re-added or re-queued)."""
        self.version = version
        # (group, sample) order, the order a resumed run re-feeds them in
        running = sorted(self._active.values(), key=lambda q: q.order)
        if self._active:
            self.engine.abort_request(list(self._active))
            self._active.clear()
        if not self.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after every request was aborted: its blocks hold "
                               "keys and values of the old weights")
        if self.partial == "abort":
            for seq in reversed(running):
                seq.out.token_ids, seq.out.logprobs, seq.out.versions = [], [], []
                self.stats.aborted_samples += 1
                self._pending.appendleft(seq)
        else:
            for seq in running:
                self._submit(seq)

    # ------------------------------------------------------------------- loop
    def run(self, todo: list) -> None:
        """Generate ``todo`` (sequences, half generated ones continue from their tokens) and what
        ``feed`` supplies, until ``feed`` returns none with nothing left to run."""
        start = time.perf_counter()
        self._pending.extend(todo)
        while True:
            if self.feed is not None and self.free_slots > len(self._pending):
                self._pending.extend(self.feed(self))
            if not (self._pending or self._active):
                more = self.feed(self) if self.feed is not None else []
                if not more:
                    break
                self._pending.extend(more)
            while self._pending and self.free_slots > 0:
                self._submit(self._pending.popleft())
            if not self._active:
                continue
            for result in self.engine.step():
                self._take(result)
            self.stats.decode_steps += 1
            if self.on_decode is not None:
                version = self.on_decode(self)
                if version is not None:
                    self.new_weights(version)
        self.stats.seconds += time.perf_counter() - start

    def _submit(self, seq) -> None:
        from vllm.inputs import TokensPrompt  # optional dependency (loaded by then)

        rid = f"hyflow-stream-{self._submitted}"
        self._submitted += 1
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=seq.prompt + seq.out.token_ids),
                                sampling_params(seq, self.scaled))
        self._active[rid] = seq
        if not seq.out.token_ids:
            self.stats.samples += 1
            self.stats.prompt_tokens += len(seq.prompt)

    def _take(self, result) -> None:
        """A step's output of one request (the tokens new since the last step): the tokens, their
        log-probs and the version held; the finish."""
        seq = self._active.get(result.request_id)
        if seq is None:
            return
        out, completion = seq.out, result.outputs[0]
        new = list(completion.token_ids)
        out.token_ids.extend(new)
        if seq.params.logprobs:
            out.logprobs.extend(float(step[tok].logprob) for step, tok in zip(completion.logprobs, new))
        if self.version is not None:
            out.versions.extend([self.version] * len(new))
        self.stats.generated_tokens += len(new)
        self.stats.decode_rows += len(new)
        if result.finished:
            del self._active[result.request_id]
            fill_finish(seq, completion.finish_reason)
            if self.on_finish is not None:
                self.on_finish(out)
