"""Per-micro-batch losses and forward-only scoring for the actor and critic.

Each function here is a small closure handed to :func:`hyflow.training.step.forward_backward`
(which runs Megatron's pipeline schedule), so the same code works at any TP x PP. Logits
stay vocab-parallel: log-probs and entropy come from :mod:`hyflow.training.logprobs`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hyflow.algorithms import aggregate_loss, kl_estimate, ppo_policy_loss, value_loss
from hyflow.training.logprobs import shifted_entropy, shifted_token_logprobs
from hyflow.training.step import Batch, forward_backward


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the distribution the rollout sampled from: divided by the sampling temperature
    (the engine's log-probs are ``log_softmax(logits / T)``; T = 0, greedy, and T = 1 leave them)."""
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def policy_loss_fn(actor_cfg, vocab_size: int, tp_group, temperature: float = 1.0, norm_length=None):
    """PPO clipped policy loss (+ entropy bonus, + KL loss to the reference) of the policy at the
    rollout's sampling ``temperature``; ``norm_length``: the run's constant normaliser of
    ``seq-mean-token-sum-norm`` (``RLJobConfig.loss_norm_length``)."""

    def loss(logits: torch.Tensor, batch: Batch):
        logits = tempered(logits, temperature)
        mask = batch["response_mask"]
        logp = shifted_token_logprobs(logits, batch["tokens"], vocab_size, tp_group)
        pg, stats = ppo_policy_loss(
            logp, batch["old_logp"], batch["advantages"], mask,
            clip_ratio_low=actor_cfg.clip_ratio_low, clip_ratio_high=actor_cfg.clip_ratio_high,
            clip_ratio_c=actor_cfg.clip_ratio_c, agg_mode=actor_cfg.loss_agg_mode, norm_length=norm_length)
        entropy = aggregate_loss(shifted_entropy(logits, vocab_size, tp_group), mask, actor_cfg.loss_agg_mode,
                                 norm_length)
        total = pg - actor_cfg.entropy_coeff * entropy
        out = {"actor/pg_loss": pg.detach().clone(), "actor/entropy": entropy.detach().clone(),
               "actor/clip_frac": stats["clip_frac"], "actor/approx_kl": stats["approx_kl"]}
        if actor_cfg.use_kl_loss:
            kl = aggregate_loss(kl_estimate(logp, batch["ref_logp"], actor_cfg.kl_loss_type), mask,
                                actor_cfg.loss_agg_mode, norm_length)
            total = total + actor_cfg.kl_loss_coef * kl
            out["actor/kl_loss"] = kl.detach().clone()
        return total, out

    return loss


def value_loss_fn(critic_cfg, agg_mode: str, norm_length=None):
    """Clipped value loss; the critic's scalar head output is [b, s, 1]."""

    def loss(output: torch.Tensor, batch: Batch):
        values = shifted_values(output)
        vl, stats = value_loss(values, batch["old_values"], batch["returns"], batch["response_mask"],
                               clip_range_value=critic_cfg.cliprange_value, agg_mode=agg_mode,
                               norm_length=norm_length)
        return vl, {"critic/value_loss": vl.detach().clone(), "critic/vf_clipfrac": stats["vf_clipfrac"]}

    return loss


def shifted_values(output: torch.Tensor) -> torch.Tensor:
    """V(state before token i) aligned to token i: the head's output at position i-1."""
    v = output.squeeze(-1).float()
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


def forward_score(chunks: Sequence[torch.nn.Module], micro: Sequence[Batch], score, pgs) -> torch.Tensor:
    """Run ``score(output, batch) -> [b, s]`` forward-only; return [sum b, s] on every rank."""
    captured: list[torch.Tensor] = []

    def keep(output: torch.Tensor, batch: Batch):
        with torch.no_grad():
            captured.append(score(output, batch).float())
        return output.new_zeros(()), {}

    with torch.no_grad():
        forward_backward(chunks, micro, loss_fn=keep, with_labels=False, forward_only=True)
    result = torch.cat(captured) if captured else None
    pp = pgs.pp
    if dist.get_world_size(pp) > 1:
        shape = (sum(mb["tokens"].shape[0] for mb in micro), micro[0]["tokens"].shape[1])
        if result is None:
            result = torch.empty(shape)
        dist.broadcast(result, src=dist.get_global_rank(pp, dist.get_world_size(pp) - 1), group=pp)
    return result


def logprob_scorer(vocab_size: int, tp_group, temperature: float = 1.0):
    return lambda logits, batch: shifted_token_logprobs(tempered(logits, temperature), batch["tokens"],
                                                        vocab_size, tp_group)


def value_scorer():
    return lambda output, batch: shifted_values(output)
