"""Generation requests, per-sample outputs and the batched result of a rollout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch

from hyflow.rollout.config import SamplingConfig

FinishReason = Literal["stop", "length"]


@dataclass
class GenerationRequest:
    """One prompt to complete.

    Attributes:
        prompt_ids: prompt token ids.
        sampling: per-request sampling settings (None: the engine's); ``n`` of it is the
            number of samples drawn for this prompt.
        seed: this request's random stream (None: derived from ``sampling.seed`` and the
            request's index in the call, so a data-parallel split does not change it).
    """

    prompt_ids: list[int]
    sampling: Optional[SamplingConfig] = None
    seed: Optional[int] = None


@dataclass
class SampleOutput:
    """One generated response.

    Attributes:
        request_index: index of the request in the ``generate`` call.
        sample_index: 0..n-1 among that request's samples.
        prompt_ids: the prompt as generated from (after truncation, if any).
        token_ids: response tokens (the stop token last when ``include_stop_token``).
        logprobs: log-prob of each response token (empty when disabled).
        finish_reason: ``stop`` (EOS / stop id) or ``length`` (max_new_tokens or context limit).
        stop_token: the id that stopped generation, if any.
        prompt_truncated: tokens dropped from the front of the prompt.
        routing: mixture-of-experts models with ``record_routing``: the experts every fed token went
            to, ``[fed tokens, layers, top_k]`` expert id + 1 (the prompt, then each sampled
            token but the last; :mod:`hyflow.models.routing_replay`), else None.
        versions: the weight version that sampled each response token (``trainer.mode: async``
            takes new weights at token boundaries, :mod:`hyflow.rollout.scheduler`); empty when
            the engine was given no version.
    """

    request_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    stop_token: Optional[int] = None
    prompt_truncated: int = 0
    routing: Optional[torch.Tensor] = None
    versions: list[int] = field(default_factory=list)

    @property
    def response_length(self) -> int:
        return len(self.token_ids)


@dataclass
class RolloutStats:
    """Counters of one ``generate`` call (summed over data-parallel replicas when gathered)."""

    samples: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model (padding included)
    prefill_forwards: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # row-forwards spent in decode steps
    aborted_samples: int = 0  # running samples restarted after new weights (trainer.partial_rollout=abort)
    compactions: int = 0  # running sequences moved to a lower cache slot (keeps decode batches contiguous)
    truncated_prompts: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def merge(self, other: "RolloutStats") -> "RolloutStats":
        """Sum of the counters; the wall time is the longest."""
        out = RolloutStats()
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            setattr(out, name, max(a, b) if name == "seconds" else a + b)
        return out


@dataclass
class RolloutResult:
    """All samples of a ``generate`` call, ordered by (request, sample)."""

    samples: list[SampleOutput]
    stats: RolloutStats = field(default_factory=RolloutStats)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def finish_reasons(self) -> list[Optional[str]]:
        return [s.finish_reason for s in self.samples]

    def to_tensors(self, pad_token_id: int = 0, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Padded tensors for the trainer, on ``device``.

        ``prompts [N, P]`` left-padded with ``prompt_mask``; ``responses [N, R]``
        right-padded with ``response_mask``, ``logprobs`` (0 on padding),
        ``prompt_lengths`` and ``response_lengths``.
        """
        n = len(self.samples)
        p = max((len(s.prompt_ids) for s in self.samples), default=0)
        r = max((len(s.token_ids) for s in self.samples), default=0)
        prompts = [[pad_token_id] * (p - len(s.prompt_ids)) + list(s.prompt_ids) for s in self.samples]
        prompt_mask = [[0] * (p - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in self.samples]
        responses = [list(s.token_ids) + [pad_token_id] * (r - len(s.token_ids)) for s in self.samples]
        response_mask = [[1] * len(s.token_ids) + [0] * (r - len(s.token_ids)) for s in self.samples]
        logprobs = [(list(s.logprobs) if s.logprobs else [0.0] * len(s.token_ids)) + [0.0] * (r - len(s.token_ids))
                    for s in self.samples]
        as_t = lambda rows, dtype, width: torch.tensor(rows, dtype=dtype, device=device).reshape(n, width)  # noqa: E731
        prompts, prompt_mask = as_t(prompts, torch.long, p), as_t(prompt_mask, torch.long, p)
        responses, response_mask = as_t(responses, torch.long, r), as_t(response_mask, torch.long, r)
        logprobs = as_t(logprobs, torch.float32, r)
        return {
            "prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
            "response_mask": response_mask, "logprobs": logprobs,
            "prompt_lengths": prompt_mask.sum(1), "response_lengths": response_mask.sum(1),
        }


def as_requests(prompts: Sequence) -> list[GenerationRequest]:
    """Accept ``GenerationRequest`` objects or plain token-id lists."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, GenerationRequest):
            out.append(p)
        elif isinstance(p, (list, tuple)) or (isinstance(p, torch.Tensor) and p.dim() == 1):
            out.append(GenerationRequest(prompt_ids=[int(t) for t in p]))
        else:
            raise TypeError(f"request {i}: expected a GenerationRequest or a list of token ids, "
                            f"got {type(p).__name__}")
    return out
