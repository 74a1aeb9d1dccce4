"""Turn generated samples into fixed-shape training tensors.

Every sequence is ``prompt + response``, right-padded to the longest in the rollout
batch, so all micro-batches share one ``[b, s]`` shape (the pipeline schedule sizes its
sends once). ``response_mask[i, j] = 1`` where token ``j`` of row ``i`` is a response
token; per-token quantities (log-probs, values, advantages) are aligned to the token
they score, the same convention as :func:`hyflow.training.logprobs.shifted_token_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class RolloutBatch:
    """A rollout batch, identical on every rank.

    Attributes:
        tokens: [B, S] prompt + response, right-padded with ``pad_id``.
        response_mask: [B, S] float, 1 on response tokens.
        attention_len: [B] real length of each row.
        group_ids: [B] index of the prompt each response answers.
        prompt_lengths: [B].
        response_lengths: [B].
        rollout_logprobs: [B, S] log-probs the sampler reported (0 elsewhere).
    """

    tokens: torch.Tensor
    response_mask: torch.Tensor
    attention_len: torch.Tensor
    group_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    rollout_logprobs: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def build_rollout_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        group_ids: Sequence[int], logprobs: Sequence[Sequence[float]] | None = None,
                        pad_id: int = 0, pad_to_multiple: int = 1) -> RolloutBatch:
    """Concatenate prompt and response per sample and pad to a common length."""
    if not (len(prompts) == len(responses) == len(group_ids)):
        raise ValueError("prompts, responses and group_ids must have one entry per sample")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    S = max(lengths)
    S = -(-S // pad_to_multiple) * pad_to_multiple
    B = len(prompts)
    tokens = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros(B, S)
    lp = torch.zeros(B, S)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tokens[i, :len(p)] = torch.tensor(list(p), dtype=torch.long)
        if r:
            tokens[i, len(p):len(p) + len(r)] = torch.tensor(list(r), dtype=torch.long)
            mask[i, len(p):len(p) + len(r)] = 1.0
            if logprobs is not None and len(logprobs[i]):
                lp[i, len(p):len(p) + len(r)] = torch.tensor(list(logprobs[i]), dtype=torch.float32)
    return RolloutBatch(
        tokens=tokens, response_mask=mask, attention_len=torch.tensor(lengths),
        group_ids=torch.tensor(list(group_ids)), prompt_lengths=torch.tensor([len(p) for p in prompts]),
        response_lengths=torch.tensor([len(r) for r in responses]), rollout_logprobs=lp)


def micro_batches(tensors: dict[str, torch.Tensor], rows: Sequence[int], size: int) -> list[dict[str, torch.Tensor]]:
    """Split the rows ``rows`` of every [B, ...] tensor into micro-batches of ``size`` rows."""
    if len(rows) % size:
        raise ValueError(f"{len(rows)} rows do not split into micro-batches of {size}")
    out = []
    for start in range(0, len(rows), size):
        idx = torch.as_tensor(rows[start:start + size])
        out.append({k: v[idx] for k, v in tensors.items()})
    return out


def position_ids(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
