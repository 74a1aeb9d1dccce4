"""From scores and per-token log-probs/values to advantages, the way the config asks.

One function, :func:`compute_advantages`, so the trainer's loop reads as a dataflow:
it applies the KL penalty to the reward when configured (fixed or adaptive
coefficient), then the configured estimator from :mod:`hyflow.algorithms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hyflow.algorithms import (AdaptiveKLController, FixedKLController, apply_kl_penalty, gae,
                               grpo_outcome, kl_estimate, masked_mean, reinforce_pp,
                               reinforce_pp_baseline, remax, rloo, scatter_to_last_token)


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B, S]
    returns: Optional[torch.Tensor]  # [B, S] (GAE / REINFORCE++), else None
    token_rewards: torch.Tensor  # [B, S] reward actually optimised (KL-penalised if configured)
    kl: float  # mean per-token KL(actor || reference) on response tokens


def make_kl_controller(alg_cfg):
    ctrl = alg_cfg.kl_ctrl
    if ctrl.type == "adaptive":
        return AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    return FixedKLController(ctrl.kl_coef)


def compute_advantages(alg_cfg, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                       old_logp: torch.Tensor, ref_logp: Optional[torch.Tensor],
                       values: Optional[torch.Tensor], kl_ctrl,
                       greedy_scores: Optional[torch.Tensor] = None) -> Advantages:
    """Advantages for a rollout batch (all tensors [B, S] except scores / group ids [B]).

    ``greedy_scores`` [B] (ReMax): the score of the greedy response to each row's prompt,
    the baseline subtracted from the row's (KL-penalised, when configured) outcome.
    """
    kl_tokens = kl_estimate(old_logp, ref_logp, alg_cfg.kl_penalty) if ref_logp is not None else None
    kl_mean = float(masked_mean(kl_tokens, mask)) if kl_tokens is not None else 0.0
    if alg_cfg.use_kl_in_reward and ref_logp is not None:
        token_rewards = apply_kl_penalty(scores, old_logp, ref_logp, mask, kl_ctrl.value, alg_cfg.kl_penalty)
    else:
        token_rewards = scatter_to_last_token(scores, mask)
    outcome = (token_rewards * mask).sum(dim=-1)  # per-sequence reward incl. any KL penalty
    name = alg_cfg.adv_estimator
    returns = None
    if name == "gae":
        adv, returns = gae(token_rewards, values, mask, alg_cfg.gamma, alg_cfg.lam, whiten_advantages=True)
    elif name in ("grpo", "dr_grpo"):
        norm = alg_cfg.norm_adv_by_std_in_grpo and name == "grpo"
        adv = grpo_outcome(outcome, group_ids, mask, norm_by_std=norm)
    elif name == "rloo":
        adv = rloo(outcome, group_ids, mask)
    elif name == "reinforce_plus_plus":
        adv, returns = reinforce_pp(token_rewards, mask, alg_cfg.gamma)
    elif name == "reinforce_plus_plus_baseline":
        adv = reinforce_pp_baseline(outcome, group_ids, mask)
    elif name == "remax":
        if greedy_scores is None:
            raise ValueError("remax needs greedy_scores: the scores of each prompt's greedy response")
        adv = remax(outcome, greedy_scores.to(outcome), mask)
    else:
        raise ValueError(f"unknown advantage estimator {name!r}")
    return Advantages(advantages=adv.float(), returns=None if returns is None else returns.float(),
                      token_rewards=token_rewards, kl=kl_mean)
