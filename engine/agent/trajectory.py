"""A multi-turn trajectory as token ids: the prompt, then assistant turns and observations.

The response part (everything after the prompt) is one list of ids with a parallel mask: 1 on
the tokens the sampler produced (assistant turns, trained on, with the sampler's log-probs), 0
on observations (tool results, environment or simulated-user messages, and the chat template's
text around them: in the context, never in the loss, no rollout log-prob). The trainer builds its
batch from these ids as they are (:func:`to_sample_tensors`), so it scores exactly what was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from hyflow.agent.config import END_REASONS
from hyflow.rollout.dp import SampleTensors

#: per-trajectory counters carried with the samples (``SampleTensors.stats`` columns)
STATS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "end", "attempts", "dropped",
         "observation_tokens", "generated_tokens", "env_reward", "tool_turns")
#: end reasons that mean "cut by a length limit" (``response_length/clip_ratio``)
_CUT = ("token_budget", "turn_length", "context_limit")


@dataclass
class Trajectory:
    """One sample of a multi-turn rollout (ids, mask and what happened)."""

    request: int  # global index of its prompt (the GRPO group)
    sample: int  # index among its prompt's samples
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[tuple[str, int, int]] = field(default_factory=list)  # (assistant|observation, start, length)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_turns: int = 0  # assistant turns that made at least one call
    env_reward: float = 0.0
    end: str = ""
    failure: Optional[str] = None
    attempts: int = 0
    dropped: bool = False

    def restart(self) -> None:
        """Forget everything but the identity (a retry from the prompt)."""
        attempts = self.attempts
        self.__init__(self.request, self.sample)  # type: ignore[misc]
        self.attempts = attempts + 1

    def add_turn(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        self.segments.append(("assistant", len(self.response_ids), len(ids)))
        self.response_ids.extend(int(t) for t in ids)
        self.mask.extend([1] * len(ids))
        lps = list(logprobs) if len(logprobs) == len(ids) else [0.0] * len(ids)
        self.logprobs.extend(float(x) for x in lps)
        self.turns += 1

    def add_observation(self, ids: Sequence[int]) -> None:
        self.segments.append(("observation", len(self.response_ids), len(ids)))
        self.response_ids.extend(int(t) for t in ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    @property
    def context(self) -> list[int]:
        """What the next assistant turn is generated from."""
        return self.prompt_ids + self.response_ids

    @property
    def generated_tokens(self) -> int:
        return sum(self.mask)

    @property
    def observation_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)

    def final_turn_ids(self) -> list[int]:
        """The last assistant turn's ids (empty when there is none)."""
        for kind, start, length in reversed(self.segments):
            if kind == "assistant":
                return self.response_ids[start:start + length]
        return []

    def turn_ids(self) -> list[list[int]]:
        return [self.response_ids[s:s + n] for kind, s, n in self.segments if kind == "assistant"]


def finish_code(end: str) -> int:
    """``SampleTensors`` finish column: 2 for a trajectory cut by a length limit, 1 otherwise, 0 failed."""
    if end in _CUT:
        return 2
    return 0 if end == "failed" else 1


def to_sample_tensors(trajectories: Sequence[Trajectory], device: torch.device, pad_id: int = 0) -> SampleTensors:
    """The trajectories in the data plane's wire format, with their mask and counters. A dropped
    trajectory keeps its row (so batch shapes do not depend on failures) with its mask zeroed; one
    without any token gets a single masked pad token."""
    meta, tokens, logprobs, mask, stats = [], [], [], [], []
    for t in trajectories:
        prompt = t.prompt_ids or [pad_id]
        response, lps, m = list(t.response_ids), list(t.logprobs), list(t.mask)
        if not response:
            response, lps, m = [pad_id], [0.0], [0]
        if t.dropped:
            m = [0] * len(m)
        meta.append([t.request, t.sample, len(prompt), len(response), finish_code(t.end), 0])
        tokens.extend(prompt + response)
        logprobs.extend(lps)
        mask.extend(m)
        stats.append([t.turns, t.tool_calls, t.tool_errors, t.tool_timeouts, END_REASONS.index(t.end or "failed"),
                      t.attempts, float(t.dropped), t.observation_tokens, t.generated_tokens, t.env_reward,
                      t.tool_turns])
    return SampleTensors(meta=torch.tensor(meta, dtype=torch.long, device=device).view(-1, 6),
                         tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                         logprobs=torch.tensor(logprobs, dtype=torch.float32, device=device),
                         mask=torch.tensor(mask, dtype=torch.float32, device=device),
                         stats=torch.tensor(stats, dtype=torch.float64, device=device).view(-1, len(STATS)))


def final_turns(samples: SampleTensors) -> list[list[int]]:
    """Each sample's last assistant turn: the last run of masked-in response tokens (empty for a
    dropped trajectory, whose mask is zero)."""
    out = []
    meta, tokens, mask = samples.meta.tolist(), samples.tokens.tolist(), samples.mask.tolist()
    t = r = 0
    for _, _, plen, rlen, _, _ in meta:
        resp, m = tokens[t + plen:t + plen + rlen], mask[r:r + rlen]
        t, r = t + plen + rlen, r + rlen
        end = max((i + 1 for i, v in enumerate(m) if v > 0), default=0)
        start = end
        while start > 0 and m[start - 1] > 0:
            start -= 1
        out.append(resp[start:end])
    return out
