"""The RL step's loss objects (the actor's :class:`PolicyLoss`, the critic's :class:`ValueLoss`) and forward-only
scoring, per micro-batch; the math they apply is :mod:`hyflow.algorithms` (policy losses, aggregation).

The losses are callables handed to :func:`hyflow.training.step.train_step` (Megatron's pipeline
schedule), so the same code runs at any TP x PP. Logits stay vocab-parallel: log-probs and entropy
come from :mod:`hyflow.training.logprobs`. The actor's losses and log-prob scorer take the model's
last hidden states (:mod:`hyflow.training.output_head`) and apply the output layer to the response
positions only, in chunks, never holding [B, S, V] float32 logits; ``fused=False`` keeps the
full-logits path (the reference the tests compare against).

Every micro-batch carries two per-token weights computed once per mini-batch from counts over all
data-parallel ranks (:func:`loss_weights`): ``loss_weight`` realises ``actor.loss_agg_mode``
(token-mean, seq-mean-token-sum, ...), ``token_weight`` is the token mean used for statistics such
as the clip fraction. A micro-batch's loss is ``sum(per-token loss * loss_weight)``: summed over
micro-batches and ranks it is exactly the aggregated loss of the whole mini-batch, however the rows
were grouped or packed.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hyflow.algorithms import kl_estimate
from hyflow.algorithms.losses import aggregation_weights, value_token_loss
from hyflow.algorithms.policy_losses import get_policy_loss
from hyflow.training.logprobs import (shifted_entropy, shifted_token_logprobs, vocab_parallel_entropy,
                                      vocab_parallel_logprobs)
from hyflow.training.output_head import Hidden, label_logprobs_entropy, response_logprobs_entropy
from hyflow.training.step import Batch, explicit_pgs, forward_backward

from hyflow.models.context_parallel import to_token_aligned
from hyflow.rl.batch import scatter_rows


def loss_weights(mask: torch.Tensor, mode: str, tokens: torch.Tensor, seqs: torch.Tensor,
                 norm_length: Optional[float] = None) -> torch.Tensor:
    """Per-token weights turning a ``[B, S]`` per-token loss into its share of the aggregated loss.

    ``tokens`` / ``seqs``: response tokens / non-empty sequences of the whole mini-batch (every
    data-parallel rank), broadcastable against ``[B, 1]``: the denominator of
    :func:`hyflow.algorithms.losses.aggregation_weights` summed over ranks. ``norm_length``: the
    constant per-sequence normaliser of ``seq-mean-token-sum-norm`` (Dr. GRPO).
    """
    w, _ = aggregation_weights(mask.float(), mode, norm_length)
    return w / (tokens if mode == "token-mean" else seqs).clamp(min=1)


def minibatch_counts(mask: torch.Tensor, assignment: torch.Tensor, count: int, dp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """Response tokens and non-empty sequences of each of ``count`` mini-batches over every
    data-parallel rank: ``assignment`` [B] is each local row's mini-batch. One all-reduce."""
    sums = torch.zeros(2, count, dtype=torch.float64, device=mask.device)
    per_row = mask.sum(dim=-1, dtype=torch.float64)
    sums[0].index_add_(0, assignment, per_row)
    sums[1].index_add_(0, assignment, (per_row > 0).double())
    if dp_group is not None and dp_group.size() > 1:
        dist.all_reduce(sums, group=dp_group)
    return sums[0].float(), sums[1].float()


def token_logprobs(logits: torch.Tensor, batch: Batch, vocab: int, tp_group, temperature: float) -> torch.Tensor:
    """Per-token log-probs aligned like the batch's columns: of ``labels`` at each position in a
    context-parallel share (label-aligned, :func:`hyflow.models.context_parallel.shard_micro_batch`),
    else of each token from the previous position's logits."""
    if "labels" in batch:
        return vocab_parallel_logprobs(logits, batch["labels"], vocab, tp_group, temperature)
    return shifted_token_logprobs(logits, batch["tokens"], vocab, tp_group, temperature)


def token_entropy(logits: torch.Tensor, batch: Batch, vocab: int, tp_group, temperature: float) -> torch.Tensor:
    """Entropy of the distribution that produced each column's token (see :func:`token_logprobs`)."""
    if "labels" in batch:
        return vocab_parallel_entropy(logits, vocab, tp_group, temperature)
    return shifted_entropy(logits, vocab, tp_group, temperature)


def hidden_scores(hidden: Hidden, batch: Batch, scored: torch.Tensor, vocab: int, tp_group,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of the fused output head at the ``scored`` positions, aligned like
    :func:`token_logprobs` (label-aligned in a context-parallel share)."""
    if "labels" in batch:
        return label_logprobs_entropy(hidden, batch["labels"], scored, vocab, tp_group, temperature)
    return response_logprobs_entropy(hidden, batch["tokens"], scored, vocab, tp_group, temperature)


class PolicyLoss:
    """The policy loss ``actor.policy_loss`` (PPO clip, GSPO or CISPO; times the rollout-correction
    weights ``is_weights`` when the batch has them) + entropy bonus + KL loss to the reference, of
    the policy at the rollout's sampling ``temperature``; statistics with verl's names."""

    def __init__(self, actor_cfg, vocab_size: int, tp_group, temperature: float = 1.0, fused: bool = True) -> None:
        self.cfg, self.vocab, self.tp_group, self.temperature = actor_cfg, vocab_size, tp_group, temperature
        self.hidden_states = fused  # the schedule then hands us Hidden, not logits
        self.policy_loss = get_policy_loss(actor_cfg.policy_loss)
        self.names = ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                      "actor/ppo_kl") + (("actor/kl_loss",) if actor_cfg.use_kl_loss else ())

    def _scores(self, output, batch: Batch):
        """(log-probs, entropy) [b, s]; entropy carries a graph only with an entropy bonus."""
        T = self.temperature
        if isinstance(output, Hidden):
            scored = batch["response_mask"] > 0
            logp, ent = hidden_scores(output, batch, scored, self.vocab, self.tp_group, T)
            # unscored positions: ratio 1 (their loss weight is 0; this keeps them finite)
            logp = torch.where(scored, logp, batch["old_logp"].to(logp.dtype))
            return logp, ent if self.cfg.entropy_coeff else ent.detach()
        logp = token_logprobs(output, batch, self.vocab, self.tp_group, T)
        if self.cfg.entropy_coeff:
            return logp, token_entropy(output, batch, self.vocab, self.tp_group, T)
        with torch.no_grad():  # a metric only: no graph through the vocabulary
            return logp, token_entropy(output.detach(), batch, self.vocab, self.tp_group, T)

    def __call__(self, output, batch: Batch):
        cfg = self.cfg
        logp, ent = self._scores(output, batch)
        loss_mat, tok = self.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["response_mask"],
                                         clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                                         clip_ratio_c=cfg.clip_ratio_c, is_weights=batch.get("is_weights"))
        w, tw = batch["loss_weight"], batch["token_weight"]
        pg = (loss_mat * w).sum()
        total = pg
        entropy = (ent * w).sum()
        if cfg.entropy_coeff:
            total = total - cfg.entropy_coeff * entropy
        stats = {"actor/pg_loss": pg.detach(), "actor/entropy": entropy.detach(),
                 "actor/pg_clipfrac": (tok["clip_frac"] * tw).sum(),
                 "actor/pg_clipfrac_lower": (tok["clip_frac_lower"] * tw).sum(), "actor/ppo_kl": (tok["approx_kl"] * tw).sum()}
        if cfg.use_kl_loss:
            kl = (kl_estimate(logp, batch["ref_logp"], cfg.kl_loss_type) * w).sum()
            total = total + cfg.kl_loss_coef * kl
            stats["actor/kl_loss"] = kl.detach()
        return total, stats


class ValueLoss:
    """Clipped value loss of the critic's scalar head ([b, s, 1])."""

    names = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")

    def __init__(self, critic_cfg) -> None:
        self.cfg = critic_cfg

    def __call__(self, output: torch.Tensor, batch: Batch):
        values = token_values(output, batch)
        loss_mat, tok = value_token_loss(values, batch["old_values"], batch["returns"], batch["response_mask"],
                                         self.cfg.cliprange_value)
        vl = (loss_mat * batch["loss_weight"]).sum()
        tw = batch["token_weight"]
        return vl, {"critic/vf_loss": vl.detach(), "critic/vf_clipfrac": (tok["vf_clipfrac"] * tw).sum(),
                    "critic/vpred_mean": (values.detach() * tw).sum()}


def shifted_values(output: torch.Tensor) -> torch.Tensor:
    """V(state before token i) aligned to token i: the head's output at position i-1."""
    v = output.squeeze(-1).float()
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


def token_values(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Values aligned like the batch's columns: the head's output itself in a label-aligned
    context-parallel share, else :func:`shifted_values`."""
    return output.squeeze(-1).float() if "labels" in batch else shifted_values(output)


#: score(output, micro-batch) -> [b, s]; a scorer with ``predicts_next = True`` returns, for a
#: context-parallel share, label-aligned values (position i: token i + 1) that forward_score shifts back
Scorer = Callable[[torch.Tensor, Batch], torch.Tensor]


def forward_score(chunks: Sequence[torch.nn.Module], micro: Sequence[Batch], score: Scorer, groups,
                  shape: tuple[int, int]) -> torch.Tensor:
    """Run ``score(output, micro-batch) -> [b, s]`` forward-only over ``micro``; return the per-row
    ``[B, S]`` result (``shape``) on every rank of the model's pipeline."""
    captured: list[torch.Tensor] = []
    predicts_next = getattr(score, "predicts_next", False)

    def keep(output, batch: Batch):
        value = score(output, batch).float()
        if batch.get("cp_split"):  # this CP rank's share of each sequence -> the whole sequence
            value = to_token_aligned(value, groups.pgs.cp, predicts_next)
        captured.append(value)
        return value.new_zeros(()), {}

    keep.hidden_states = getattr(score, "hidden_states", False)

    with torch.no_grad():
        forward_backward(chunks, micro, loss_fn=keep, with_labels=False, forward_only=True, pgs=explicit_pgs(groups))
    if captured:
        result = scatter_rows(captured, micro, shape)
    else:  # not the last stage: the broadcast fills it
        result = torch.empty(shape, dtype=torch.float32, device=groups.device)
    pp = groups.pgs.pp
    if pp.size() > 1:
        dist.broadcast(result, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
    return result


class logprob_scorer:
    """Scorer of log p(token) under the actor; with ``fused`` (default) from the last hidden states,
    only at the batch's ``response_mask`` positions when it has one (0 elsewhere)."""

    predicts_next = True  # under CP a position holds the log-prob of its label (the next token)

    def __init__(self, vocab_size: int, tp_group, temperature: float = 1.0, fused: bool = True) -> None:
        self.vocab, self.tp_group, self.temperature, self.hidden_states = vocab_size, tp_group, temperature, fused

    def __call__(self, output, batch: Batch) -> torch.Tensor:
        if isinstance(output, Hidden):  # every position when the batch names no responses
            mask = batch.get("response_mask")
            scored = mask > 0 if mask is not None else torch.ones_like(batch["tokens"], dtype=torch.bool)
            return hidden_scores(output, batch, scored, self.vocab, self.tp_group, self.temperature)[0]
        return token_logprobs(output, batch, self.vocab, self.tp_group, self.temperature)


def value_scorer() -> Scorer:
    def score(output: torch.Tensor, batch: Batch) -> torch.Tensor:
        return token_values(output, batch)

    score.predicts_next = True
    return score
