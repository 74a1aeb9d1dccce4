r"""Advantage estimators.

Shapes: ``B`` sequences, ``T`` response positions. ``response_mask`` is ``[B, T]`` (bool, int or
float) and marks real response tokens; masked-out positions (right padding, left padding or
interior holes) are skipped: they are assigned ``0`` and, for the recursive estimators, the
recursion jumps over them as if they were not there. Outcome estimators take one scalar
``scores[B]`` per sequence and broadcast the advantage over its valid tokens.

``group_ids`` identify the prompt each sample was drawn for: an integer tensor ``[B]`` or a
sequence of ``B`` hashables (strings, tuples, ...). Groups may have different sizes and need
not be contiguous.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from hyflow.algorithms.kl import apply_kl_penalty, kl_estimate
from hyflow.algorithms.masked import Reduce, masked_mean, masked_whiten, scatter_to_last_token

GroupIds = Union[torch.Tensor, Sequence[Hashable]]

__all__ = [
    "GroupIds",
    "group_index",
    "gae",
    "grpo_outcome",
    "grpo_passk",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "Advantages",
    "compute_advantages",
]


def group_index(group_ids: GroupIds, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map ``group_ids`` to dense indices ``0..G-1``. Returns ``(index[B] long, G)``."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError("group_ids tensor must be 1-D")
        _, inv = torch.unique(group_ids, return_inverse=True)
        inv = inv.to(device=device if device is not None else group_ids.device, dtype=torch.long)
        return inv, int(inv.max().item()) + 1 if inv.numel() else 0
    table: dict[Hashable, int] = {}
    idx = [table.setdefault(g, len(table)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long, device=device), len(table)


def _group_stats(
    scores: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(group size, group sum, group mean, group is constant)``, each ``[B]``.

    The last flag (bool) marks groups whose scores are all identical, so that callers can
    return an exact ``0`` instead of a rounding residue of ``s - mean``.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got {tuple(scores.shape)}")
    inv, n_groups = group_index(group_ids, device=scores.device)
    if inv.shape[0] != scores.shape[0]:
        raise ValueError(f"group_ids has {inv.shape[0]} entries, scores has {scores.shape[0]}")
    buf = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = buf.index_add(0, inv, torch.ones_like(scores))
    total = buf.index_add(0, inv, scores)
    gmax = buf.scatter_reduce(0, inv, scores, reduce="amax", include_self=False)
    gmin = buf.scatter_reduce(0, inv, scores, reduce="amin", include_self=False)
    return count[inv], total[inv], (total / count)[inv], (gmax == gmin)[inv]


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``per_seq[B] -> [B, T]`` on valid tokens, ``0`` on padding."""
    m = response_mask.to(device=per_seq.device) != 0
    return torch.where(m, per_seq.unsqueeze(-1), torch.zeros((), dtype=per_seq.dtype, device=per_seq.device))


def _reverse_scan(
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """Backward recursion over valid tokens only (see :func:`gae`); ``values=None`` gives return-to-go."""
    B, T = token_rewards.shape
    keep = response_mask.to(device=token_rewards.device) != 0
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    rewards = torch.where(keep, token_rewards, zero)
    vals = torch.where(keep, values, zero) if values is not None else torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    carry = torch.zeros_like(next_value)
    out = torch.zeros_like(rewards)
    for t in range(T - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        step = delta + gamma * lam * carry
        k = keep[:, t]
        out[:, t] = torch.where(k, step, zero)
        carry = torch.where(k, step, carry)
        next_value = torch.where(k, vals[:, t], next_value)
    return out


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten_advantages: bool = False,
    reduce: Reduce = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Generalised Advantage Estimation (Schulman et al., 2016).

    Over the valid tokens :math:`t_1 < \dots < t_n` of a row (padding is skipped, so the
    "next" token of :math:`t_k` is :math:`t_{k+1}`; after the last one the episode ends):

    .. math::
        \delta_k = r_{t_k} + \gamma V_{t_{k+1}} - V_{t_k},\qquad V_{t_{n+1}} = 0

        A_{t_k} = \delta_k + \gamma\lambda A_{t_{k+1}},\qquad A_{t_{n+1}} = 0

        R_{t_k} = A_{t_k} + V_{t_k}

    Padding positions get ``A = R = 0`` and their rewards/values (even NaN) are ignored.
    ``returns`` are always computed from the raw advantages; with ``whiten_advantages`` the
    advantages are then normalised by :func:`masked_whiten` over all valid tokens of the batch
    (of every data-parallel rank's part of it with ``reduce``, see :data:`~hyflow.algorithms.masked.Reduce`).

    Returns ``(advantages[B, T], returns[B, T])``.
    """
    if token_rewards.shape != values.shape or token_rewards.dim() != 2:
        raise ValueError("token_rewards and values must both be [B, T]")
    keep = response_mask.to(device=token_rewards.device) != 0
    advantages = _reverse_scan(token_rewards, values, response_mask, gamma, lam)
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    returns = torch.where(keep, advantages + values, zero)
    if whiten_advantages:
        advantages = masked_whiten(advantages, response_mask, reduce=reduce)
    return advantages, returns


def grpo_outcome(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""GRPO outcome advantage (Shao et al., 2024), one value per sequence.

    For sample :math:`i` in group :math:`g` of size :math:`n_g`:

    .. math::
        \mu_g = \frac{1}{n_g}\sum_{j\in g} s_j,\qquad
        \sigma_g = \sqrt{\frac{1}{n_g-1}\sum_{j\in g}(s_j-\mu_g)^2}

        A_i = \frac{s_i - \mu_g}{\sigma_g + \epsilon}\quad(\texttt{norm\_by\_std}),\qquad
        A_i = s_i - \mu_g\quad(\text{Dr. GRPO, Liu et al., 2025})

    A group of size 1 gets :math:`A = 0`; identical scores give exactly ``0`` (no NaN).
    Returns ``[B, T]``: :math:`A_i` on every valid token of sequence :math:`i`, ``0`` elsewhere.
    """
    count, _, mean, constant = _group_stats(scores, group_ids)
    centered = scores - mean
    if norm_by_std:
        inv, n_groups = group_index(group_ids, device=scores.device)
        sq = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inv, centered ** 2)[inv]
        std = torch.sqrt(sq / torch.clamp(count - 1, min=1))
        centered = centered / (std + eps)
    adv = torch.where((count > 1) & ~constant, centered, torch.zeros_like(centered))
    return _broadcast(adv, response_mask)


def grpo_passk(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""Pass@k advantage in GRPO form (arXiv:2503.19595): only the best response of each
    group is credited, with its margin over the group's second best (the gain of the group's
    max reward that this response alone brings).

    For group :math:`g` with scores sorted :math:`s_{(1)} \ge s_{(2)} \ge \dots`:

    .. math::
        A_{i^*} = \frac{s_{(1)} - s_{(2)}}{\sigma_g + \epsilon}\quad(\texttt{norm\_by\_std};\
        \text{else no division}),\qquad A_i = 0\ \text{for}\ i \ne i^*

    :math:`i^*` is the first (lowest-index) row holding the maximum, :math:`\sigma_g` the
    unbiased standard deviation of the group. A group of size 1 gets :math:`A = 0`.
    Returns ``[B, T]`` broadcast over valid tokens.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got {tuple(scores.shape)}")
    inv, n_groups = group_index(group_ids, device=scores.device)
    count, _, mean, _ = _group_stats(scores, group_ids)
    buf = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    gmax = buf.scatter_reduce(0, inv, scores, reduce="amax", include_self=False)
    rows = torch.arange(scores.shape[0], device=scores.device)
    holders = torch.where(scores == gmax[inv], rows, torch.full_like(rows, scores.shape[0]))
    best = torch.full((n_groups,), scores.shape[0], dtype=torch.long, device=scores.device).scatter_reduce(
        0, inv, holders, reduce="amin")
    is_best = rows == best[inv]
    others = torch.where(is_best, torch.full_like(scores, float("-inf")), scores)
    second = buf.scatter_reduce(0, inv, others, reduce="amax", include_self=False)
    margin = gmax[inv] - second[inv]
    if norm_by_std:
        sq = buf.index_add(0, inv, (scores - mean) ** 2)[inv]
        margin = margin / (torch.sqrt(sq / torch.clamp(count - 1, min=1)) + eps)
    adv = torch.where(is_best & (count > 1), margin, torch.zeros_like(scores))
    return _broadcast(adv, response_mask)


def rloo(scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor) -> torch.Tensor:
    r"""REINFORCE Leave-One-Out (Kool et al., 2019; Ahmadian et al., 2024).

    .. math::
        A_i = s_i - \frac{1}{n_g - 1}\sum_{j\in g, j\ne i} s_j
            = \frac{n_g}{n_g-1}\,(s_i - \mu_g)

    A group of size 1 has no baseline and gets :math:`A = 0`. Returns ``[B, T]``.
    """
    count, total, _, constant = _group_stats(scores, group_ids)
    baseline = (total - scores) / torch.clamp(count - 1, min=1)
    adv = torch.where((count > 1) & ~constant, scores - baseline, torch.zeros_like(scores))
    return _broadcast(adv, response_mask)


def reinforce_pp(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    reduce: Reduce = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""REINFORCE++ (Hu, 2025): discounted return-to-go, whitened over the batch.

    Over the valid tokens :math:`t_1<\dots<t_n` of a row (padding skipped):

    .. math::
        G_{t_k} = r_{t_k} + \gamma\, G_{t_{k+1}},\qquad G_{t_{n+1}} = 0

        A = \operatorname{whiten}(G)\ \text{over all valid tokens of the batch}

    Returns ``(advantages[B, T], returns[B, T])`` where ``returns`` is the raw :math:`G`.
    """
    if token_rewards.dim() != 2:
        raise ValueError("token_rewards must be [B, T]")
    returns = _reverse_scan(token_rewards, None, response_mask, gamma, 1.0)
    return masked_whiten(returns, response_mask, reduce=reduce), returns


def reinforce_pp_baseline(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    reduce: Reduce = None,
) -> torch.Tensor:
    r"""REINFORCE++ with a group-mean baseline.

    .. math::
        \tilde A_{i,t} = s_i - \mu_{g(i)}\ \text{on valid tokens},\qquad
        A = \operatorname{whiten}(\tilde A)\ \text{over all valid tokens of the batch}

    (a size-1 group has :math:`\tilde A = 0` before whitening). Returns ``[B, T]``.
    """
    _, _, mean, constant = _group_stats(scores, group_ids)
    centered = torch.where(constant, torch.zeros_like(scores), scores - mean)
    return masked_whiten(_broadcast(centered, response_mask), response_mask, reduce=reduce)


def remax(scores: torch.Tensor, greedy_scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    r"""ReMax (Li et al., 2023): the greedy decode's score is the baseline.

    .. math:: A_i = s_i - s_i^{\text{greedy}}

    Returns ``[B, T]`` broadcast over valid tokens.
    """
    if scores.shape != greedy_scores.shape or scores.dim() != 1:
        raise ValueError("scores and greedy_scores must both be [B]")
    return _broadcast(scores - greedy_scores, response_mask)


# ------------------------------------------------------- the configured estimator


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B, S]
    returns: Optional[torch.Tensor]  # [B, S] (GAE / REINFORCE++), else None
    token_rewards: torch.Tensor  # [B, S] reward actually optimised (KL-penalised if configured)
    kl: float  # mean per-token KL(actor || reference) on response tokens


def compute_advantages(alg_cfg: Any, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                       old_logp: torch.Tensor, ref_logp: Optional[torch.Tensor],
                       values: Optional[torch.Tensor], kl_coef: float,
                       greedy_scores: Optional[torch.Tensor] = None, reduce: Reduce = None) -> Advantages:
    """Advantages for a rollout batch (all tensors [B, S] except scores / group ids [B]), the way an
    ``AlgorithmConfig`` asks: the KL penalty in the reward when configured (coefficient ``kl_coef``),
    then the configured estimator.

    ``greedy_scores`` [B] (ReMax): the score of the greedy response to each row's prompt, the
    baseline subtracted from the row's (KL-penalised, when configured) outcome. ``reduce`` sums a
    tensor over the data-parallel ranks holding the rest of the batch: batch-wide statistics (the
    whitening of GAE / REINFORCE++, the KL mean) then equal those of the whole batch on one rank.
    Group estimators need no communication: a prompt's samples are on one rank.
    """
    kl_tokens = kl_estimate(old_logp, ref_logp, alg_cfg.kl_penalty) if ref_logp is not None else None
    kl_mean = float(masked_mean(kl_tokens, mask, reduce=reduce)) if kl_tokens is not None else 0.0
    if alg_cfg.use_kl_in_reward and ref_logp is not None:
        token_rewards = apply_kl_penalty(scores, old_logp, ref_logp, mask, kl_coef, alg_cfg.kl_penalty)
    else:
        token_rewards = scatter_to_last_token(scores, mask)
    outcome = (token_rewards * mask).sum(dim=-1)  # per-sequence reward incl. any KL penalty
    name = alg_cfg.adv_estimator
    returns = None
    if name == "gae":
        adv, returns = gae(token_rewards, values, mask, alg_cfg.gamma, alg_cfg.lam, whiten_advantages=True,
                           reduce=reduce)
    elif name in ("grpo", "dr_grpo"):
        norm = alg_cfg.norm_adv_by_std_in_grpo and name == "grpo"
        adv = grpo_outcome(outcome, group_ids, mask, norm_by_std=norm)
    elif name == "grpo_passk":
        adv = grpo_passk(outcome, group_ids, mask, norm_by_std=alg_cfg.norm_adv_by_std_in_grpo)
    elif name == "rloo":
        adv = rloo(outcome, group_ids, mask)
    elif name == "reinforce_plus_plus":
        adv, returns = reinforce_pp(token_rewards, mask, alg_cfg.gamma, reduce=reduce)
    elif name == "reinforce_plus_plus_baseline":
        adv = reinforce_pp_baseline(outcome, group_ids, mask, reduce=reduce)
    elif name == "remax":
        if greedy_scores is None:
            raise ValueError("remax needs greedy_scores: the scores of each prompt's greedy response")
        adv = remax(outcome, greedy_scores.to(outcome), mask)
    else:
        raise ValueError(f"unknown advantage estimator {name!r}")
    return Advantages(advantages=adv.float(), returns=None if returns is None else returns.float(),
                      token_rewards=token_rewards, kl=kl_mean)
