"""Exact mode (``rollout.exact_logprobs``): the generator reports the training forward's log-probs.

The sampler's log-probs come from KV-cache decoding: one token per row and step, attention over
the cache, matrix products of other shapes than the training forward's. In exact arithmetic they
equal the training-layout log-probs; in floating point they differ by ~1e-5 (fp32). Exact mode
removes the gap after sampling: while the actor is still in its generation layout, the finished
sequences are scored again by a full-sequence forward that reproduces the training scoring
(:func:`hyflow.rl.step_losses.forward_score`) operation for operation:

* the same micro-batches: the rows, order and padded widths the old-log-prob forward cuts with
  ``batching_for(cfg, "reference", ...)``, since a row's result may depend on the shapes it is
  computed in (matrix-product blocking, attention over the padded width);
* the same modules: the generation model is the training ``GPTModel`` (the runner's cache
  attention is detached outside :meth:`ModelRunner.attach`), driven by Megatron's schedule;
* the same scorer (:class:`hyflow.rl.step_losses.logprob_scorer`: the fused output head at the
  response positions, or the full logits' log-softmax with ``actor.fused_output_layer=false``).

What changes is only where the layers run. Pipeline stages pass hidden states unchanged, so a
generation PP different from the training PP (and micro-DP) gives bit-identical log-probs, in
fp32 and bf16. A generation TP smaller than the training TP cannot: the row-parallel products
and the vocabulary normaliser sum partial results over the training TP ranks, a summation order
one rank does not reproduce (a generation-layout re-score stays at the sampler's ~5e-7 on the
tiny model; BENCHMARKS.md). There exact mode re-scores in the training layout instead, after
the reshard back (:func:`rescore_in_training_layout`): exact too, at the cost of the training
forward that ``actor.old_logprobs=rollout`` then saves. Which of the two a run takes is the
rollouts' declared capability (:class:`hyflow.roles.RolloutCapabilities`: ``exact_rescore`` in
the generation layout, else ``current_weights`` for the training layout; a pooled ``sync`` run,
whose generation pool samples with the weights the training pool holds, takes the second).

The micro-batches are dealt round-robin over the micro-DP replicas of the rank's training
data-parallel group (each replica scores ``1/R`` of them) and the per-row results summed over
the micro-DP group (each row is non-zero on exactly one replica: ``x + 0`` is exact).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyflow.rl.batch import MicroBatching, RolloutBatch, scatter_rows
from hyflow.rl.step_losses import forward_score, logprob_scorer
from hyflow.training.step import forward_backward


@torch.no_grad()
def rescore_in_generation_layout(model: torch.nn.Module, pgs, micro_dp_group, batch: RolloutBatch,
                                 batching: MicroBatching, vocab_size: int, temperature: float, *,
                                 train_mode: bool = False, fused: bool = True) -> torch.Tensor:
    """``[B, S]`` log-probs of ``batch``'s response tokens from the generation-layout ``model``
    (the hybrid engine's, in generation; ``pgs``: its process groups), cut into the micro-batches
    of ``batching`` (the training scoring's); 0 outside responses. Collective over the generation
    pipeline group and ``micro_dp_group``. ``train_mode``: the training model's train/eval mode,
    which the generation model takes for the forward. ``fused``: score as the training forward
    does with ``actor.fused_output_layer``."""
    columns = {"tokens": batch.tokens, "response_mask": batch.response_mask}
    micro = batching.cut(columns, batch.row_lengths())
    replicas = micro_dp_group.size() if micro_dp_group is not None else 1
    replica = micro_dp_group.rank() if replicas > 1 else 0
    mine = micro[replica::replicas]
    shape = tuple(batch.tokens.shape)
    result = torch.zeros(shape, dtype=torch.float32, device=batch.device)
    captured: list[torch.Tensor] = []

    score = logprob_scorer(vocab_size, pgs.tp, temperature, fused)  # the training scoring's own scorer

    def keep(output, mb):
        captured.append(score(output, mb).float())
        return captured[-1].new_zeros(()), {}

    keep.hidden_states = score.hidden_states

    was_training = model.training
    model.train(train_mode)
    try:
        if mine:  # every rank of a replica (all its stages and TP ranks) has the same micro-batches
            forward_backward([model], mine, loss_fn=keep, with_labels=False, forward_only=True, pgs=pgs)
    finally:
        model.train(was_training)
    if captured:
        result = scatter_rows(captured, mine, shape)
    pp = pgs.pp
    if pp.size() > 1:  # the last stage has the log-probs
        dist.broadcast(result, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
    if replicas > 1:
        dist.all_reduce(result, group=micro_dp_group)
    return torch.where(batch.response_mask > 0, result, torch.zeros((), dtype=result.dtype, device=result.device))


@torch.no_grad()
def rescore_in_training_layout(chunks, groups, batch: RolloutBatch, batching: MicroBatching, vocab_size: int,
                               temperature: float, fused: bool = True) -> torch.Tensor:
    """``[B, S]`` log-probs of ``batch``'s response tokens by the training forward itself (the
    actor's ``chunks`` in its training layout, ``groups``); 0 outside responses."""
    columns = {"tokens": batch.tokens, "response_mask": batch.response_mask}
    micro = batching.cut(columns, batch.row_lengths())
    out = forward_score(chunks, micro, logprob_scorer(vocab_size, groups.pgs.tp, temperature, fused), groups,
                        tuple(batch.tokens.shape))
    return torch.where(batch.response_mask > 0, out, torch.zeros((), dtype=out.dtype, device=out.device))
