"""Sequence log-probs and the per-micro-batch DPO / KTO losses of the preference jobs.

Each loss is a closure handed to :func:`hyflow.training.step.train_step` (Megatron's pipeline
schedule), so the same code runs at any TP x PP. The closures take the model's last hidden states
(:mod:`hyflow.training.output_head`, ``hidden_states = True``) and apply the output layer to the
completion positions only, in blocks (no ``[b, s, V/tp]`` logits nor their float32 copy); sequence
log-probs are the sums of those token log-probs. A DPO micro-batch holds whole pairs, the
chosen and rejected rows of a pair side by side (rows ``c0 r0 c1 r1 ...``), so both go through
one forward.

Normalisation: the step's loss is the mean over every pair (example) of the global batch,
whatever the layout and micro-batch split: a micro-batch returns its *contribution*, ``sum of its
pairs' losses / global pairs`` (:func:`loss_scale`), and :func:`hyflow.training.step.train_step`
undoes the averaging Megatron's schedule and DDP apply on top. The closures also keep their rows' policy log-probs (detached) for the
step's metrics.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hyflow.algorithms import dpo_loss, kto_loss, masked_sum
from hyflow.training.logprobs import shifted_token_logprobs
from hyflow.training.output_head import Hidden, response_logprobs_entropy
from hyflow.training.step import Batch, forward_backward


def sequence_logprobs(output, batch: Batch, vocab_size: int, tp_group) -> torch.Tensor:
    """[rows] sum of log p(token) over each row's completion tokens (``completion_mask``), from the
    last hidden states (:class:`Hidden`: the fused output head) or from full logits."""
    mask = batch["completion_mask"]
    if isinstance(output, Hidden):
        logp, _ = response_logprobs_entropy(output, batch["tokens"], mask > 0, vocab_size, tp_group)
    else:
        logp = shifted_token_logprobs(output, batch["tokens"], vocab_size, tp_group)
    return masked_sum(logp, mask, dim=-1)


def _on_hidden_states(loss):
    """Mark a loss closure as taking :class:`Hidden` (the schedule then skips the output layer)."""
    loss.hidden_states = True
    return loss


def loss_scale(global_count: int) -> float:
    """Factor on a micro-batch's summed loss that makes it its contribution to the mean over
    ``global_count`` pairs / examples of the step."""
    return 1.0 / global_count


def chosen_nll(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """[pairs] RPO's NLL term: each chosen response's token-mean negative log-likelihood, from its
    summed log-prob and its token count (an empty response counts as one token: NLL 0)."""
    return -chosen_logps / chosen_tokens.to(chosen_logps.dtype).clamp(min=1)


def completion_tokens(batch: Batch) -> torch.Tensor:
    """[rows] completion tokens of each row (the tokens :func:`sequence_logprobs` sums over)."""
    return batch["completion_mask"].sum(dim=-1)


def dpo_loss_fn(algo, vocab_size: int, tp_group, scale: float):
    """(loss closure, list the closure appends each micro-batch's [2b] policy log-probs to).

    With ``algo.rpo_alpha`` > 0 a pair's loss is RPO's: the DPO loss + rpo_alpha * :func:`chosen_nll`
    (a per-pair term, so the sum * ``scale`` stays its exact share of the global-batch mean)."""
    captured: list[torch.Tensor] = []

    def loss(output, batch: Batch):
        seq = sequence_logprobs(output, batch, vocab_size, tp_group)
        policy, ref = seq.view(-1, 2), batch["ref_logps"].view(-1, 2)
        losses, _, _ = dpo_loss(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], beta=algo.beta,
                                label_smoothing=algo.label_smoothing, kind=algo.loss_type, reduction="none")
        if algo.rpo_alpha:
            losses = losses + algo.rpo_alpha * chosen_nll(policy[:, 0], completion_tokens(batch).view(-1, 2)[:, 0])
        captured.append(seq.detach().float())
        return losses.sum() * scale, {}

    return _on_hidden_states(loss), captured


def kto_loss_fn(algo, vocab_size: int, tp_group, scale: float, kl_ref_point: torch.Tensor):
    """(loss closure, list of each micro-batch's [b] policy log-probs); ``kl_ref_point`` is z0."""
    captured: list[torch.Tensor] = []

    def loss(output, batch: Batch):
        seq = sequence_logprobs(output, batch, vocab_size, tp_group)
        losses = kto_loss(seq, batch["ref_logps"], batch["label"], kl_ref_point, beta=algo.beta,
                          desirable_weight=algo.desirable_weight, undesirable_weight=algo.undesirable_weight,
                          reduction="none")
        captured.append(seq.detach().float())
        return losses.sum() * scale, {}

    return _on_hidden_states(loss), captured


def from_last_stage(captured: Sequence[torch.Tensor], n_rows: int, groups) -> torch.Tensor:
    """[n_rows] values the last pipeline stage captured, on every stage of the pipeline."""
    out = torch.cat(list(captured)) if captured else torch.empty(n_rows, dtype=torch.float32, device=groups.device)
    pp = groups.pgs.pp
    if dist.get_world_size(pp) > 1:
        out = out.to(groups.device).contiguous()
        dist.broadcast(out, src=dist.get_global_rank(pp, dist.get_world_size(pp) - 1), group=pp)
    return out


def score_sequences(chunks: Sequence[torch.nn.Module], micro: Sequence[Batch], vocab_size: int, groups) -> torch.Tensor:
    """Forward-only sequence log-probs of ``micro``'s rows, [sum of rows], on every rank."""
    captured: list[torch.Tensor] = []
    tp_group = groups.pgs.tp

    @_on_hidden_states
    def keep(output, batch: Batch):
        captured.append(sequence_logprobs(output, batch, vocab_size, tp_group).float())
        return torch.zeros((), device=batch["tokens"].device), {}

    with torch.no_grad():
        forward_backward(chunks, micro, loss_fn=keep, with_labels=False, forward_only=True)
    return from_last_stage(captured, sum(mb["tokens"].shape[0] for mb in micro), groups)
