"""PPO-style updates of a trained model over the rows of one rank: mini-batches, epochs, micro-batches.

**Mini-batches that do not depend on the layout.** The step's ``R`` rows (all DP ranks) form
``M = R / mini_batch_size`` mini-batches. Rows are assigned to them in blocks of ``M`` consecutive
global rows: inside each block a random permutation (keyed by seed, step, epoch and the block's
global index) hands one row to every mini-batch. A DP rank's rows are a contiguous run of whole
blocks (``R / DP`` rows, a multiple of ``M``), so each rank contributes ``mini_batch_size / DP`` rows
to every mini-batch without moving data, and mini-batch ``k`` holds the same rows at any DP size:
with the loss weights of :mod:`hyflow.rl.step_losses` the update equals the one-rank update up to
floating-point rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from hyflow.rl.balance import balance_rows
from hyflow.rl.batch import MicroBatching
from hyflow.rl.step_losses import loss_weights, minibatch_counts
from hyflow.rollout.sampler import stream_seed
from hyflow.training.step import train_step


def minibatch_assignment(n_rows: int, row_offset: int, n_minibatches: int, seed: int, step: int,
                         epoch: int) -> list[int]:
    """The mini-batch of each of ``n_rows`` local rows whose first global index is ``row_offset``
    (both multiples of ``n_minibatches``; see the module docstring)."""
    M = n_minibatches
    if n_rows % M or row_offset % M:
        raise ValueError(f"{n_rows} rows at offset {row_offset} are not whole blocks of {M} mini-batches")
    out = [0] * n_rows
    base = stream_seed(seed, step, epoch)
    for block in range(n_rows // M):
        first = row_offset + block * M
        keys = [stream_seed(base, first + j, 0) for j in range(M)]
        for position, j in enumerate(sorted(range(M), key=keys.__getitem__)):
            out[block * M + j] = position
    return out


@dataclass
class UpdateStats:
    """Averages of a model's update statistics and the token counts behind the padding ratio."""

    sums: dict[str, float] = field(default_factory=dict)
    updates: int = 0
    processed_tokens: int = 0
    real_tokens: int = 0

    def add(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.updates += 1

    def means(self) -> dict[str, float]:
        return {k: v / max(self.updates, 1) for k, v in self.sums.items()}


def update_model(model, groups, columns: dict[str, torch.Tensor], lengths: Sequence[int], loss_fn, *,
                 batching: MicroBatching, mini_batch_size: int, epochs: int, agg_mode: str,
                 norm_length: Optional[float], seed: int, step: int, row_offset: int,
                 balance: bool = False) -> UpdateStats:
    """``epochs`` passes of mini-batch updates of ``model`` (a :class:`TrainedModel`) over this rank's
    rows. ``columns``: per-row [B, S] tensors the loss reads (``response_mask`` among them);
    ``lengths``: each row's real length; ``row_offset``: global index of the first local row;
    ``balance``: re-deal each mini-batch's rows over the DP ranks by tokens first
    (:mod:`hyflow.rl.balance`; the same update)."""
    B = len(lengths)
    dp_group = groups.pgs.dp
    M = B * dp_group.size() // mini_batch_size
    mask = columns["response_mask"]
    out = UpdateStats()
    for epoch in range(epochs):
        assign = minibatch_assignment(B, row_offset, M, seed, step, epoch)
        assign_t = torch.tensor(assign, dtype=torch.long, device=mask.device)
        tokens, seqs = minibatch_counts(mask, assign_t, M, dp_group)
        local, local_lengths = columns, lengths
        if balance and dp_group.size() > 1:
            local, local_lengths, assign = balance_rows(columns, lengths, assign, M, dp_group)
        for k in range(M):
            rows = [i for i, a in enumerate(assign) if a == k]
            index = torch.tensor(rows, dtype=torch.long, device=mask.device)
            cols = {name: value[index] for name, value in local.items()}
            cols["loss_weight"] = loss_weights(cols["response_mask"], agg_mode, tokens[k], seqs[k], norm_length)
            cols["token_weight"] = loss_weights(cols["response_mask"], "token-mean", tokens[k], seqs[k])
            sub = [local_lengths[r] for r in rows]
            micro = batching.cut(cols, sub)
            out.processed_tokens += sum(mb["tokens"].numel() for mb in micro) * batching.cp_size  # CP: a share
            out.real_tokens += sum(sub)
            out.add(train_step(model.chunks, model.optimizer, model.scheduler, micro, groups=groups,
                               loss_fn=loss_fn, with_labels=False))
    return out
