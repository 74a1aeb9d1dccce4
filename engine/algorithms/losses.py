r"""Policy, value, entropy and preference losses.

Token-level losses are ``[B, T]`` matrices reduced by :func:`aggregate_loss` under a
``response_mask``; padding (mask ``0``) never contributes, even when it holds NaN/inf.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F

from hyflow.algorithms.masked import masked_mean, masked_sum

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

__all__ = [
    "AggMode",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "ppo_policy_loss",
    "value_loss",
    "entropy_from_logits",
    "entropy_bonus",
    "DPO_KINDS",
    "dpo_loss",
    "kto_loss",
]

_LOG_RATIO_CLAMP = 20.0


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "token-mean",
    norm_length: Optional[float] = None,
) -> torch.Tensor:
    r"""Reduce a ``[B, T]`` token loss to a scalar. With :math:`m_{b,t}` the mask,
    :math:`S = \{b : \sum_t m_{b,t} > 0\}` the non-empty sequences and
    :math:`L` = ``norm_length`` (default ``T = mask.shape[-1]``):

    * ``token-mean``: :math:`\sum_{b,t} m_{b,t}\ell_{b,t} / \sum_{b,t} m_{b,t}`
    * ``seq-mean-token-sum``: :math:`\frac{1}{|S|}\sum_{b\in S}\sum_t m_{b,t}\ell_{b,t}`
    * ``seq-mean-token-mean``: :math:`\frac{1}{|S|}\sum_{b\in S}
      \frac{\sum_t m_{b,t}\ell_{b,t}}{\sum_t m_{b,t}}`
    * ``seq-mean-token-sum-norm`` (Dr. GRPO): :math:`\frac{1}{|S|}\sum_{b\in S}
      \frac{1}{L}\sum_t m_{b,t}\ell_{b,t}`

    Sequences with no valid token (e.g. filler rows) are left out of the sequence mean.
    An all-empty mask gives ``0``.
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    nonempty = (mask != 0).any(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        horizon = float(mask.shape[-1] if norm_length is None else norm_length)
        per_seq = masked_sum(loss_mat, mask, dim=-1) / horizon
    return masked_mean(per_seq, nonempty)


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    agg_mode: AggMode = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""PPO clipped surrogate (Schulman et al., 2017), with decoupled clip range
    (DAPO "clip-higher", Yu et al., 2025) and optional dual clip (Ye et al., 2020).

    .. math::
        \rho = \exp(\operatorname{clamp}(\log\pi - \log\pi_{\text{old}}, -20, 20))

        \ell^{\text{clip}} = \max\!\big(-A\rho,\ -A\operatorname{clip}(\rho, 1-\epsilon_{\text{low}},
        1+\epsilon_{\text{high}})\big)

        \ell = \begin{cases}\min(\ell^{\text{clip}},\ -A\,c) & A < 0\ \text{and dual clip}\\
        \ell^{\text{clip}} & \text{otherwise}\end{cases}

    then ``loss = aggregate_loss(ell, mask, agg_mode)``. ``clip_ratio_high`` defaults to
    ``clip_ratio_low``; ``clip_ratio_c`` (must be ``> 1``) enables the dual clip.

    Stats (detached scalars, masked token means):

    * ``clip_frac``: fraction of tokens where the clipped branch was strictly larger, i.e. taken;
    * ``clip_frac_lower``: fraction of tokens where the dual-clip bound :math:`-Ac` was taken;
    * ``approx_kl``: :math:`\mathrm{mean}(\log\pi_{\text{old}} - \log\pi)` (k1);
    * ``ratio_mean``: :math:`\mathrm{mean}(\rho)`.
    """
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    log_ratio = torch.clamp(logp - old_logp, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_branch = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped_branch)
    clip_taken = clipped_branch > unclipped
    lower_taken = torch.zeros_like(clip_taken)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        bound = -advantages * clip_ratio_c
        lower_taken = (advantages < 0) & (bound < loss_mat)
        loss_mat = torch.where(lower_taken, bound, loss_mat)
    loss = aggregate_loss(loss_mat, mask, agg_mode)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(clip_taken.to(logp.dtype), mask),
            "clip_frac_lower": masked_mean(lower_taken.to(logp.dtype), mask),
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range_value: Optional[float] = None,
    agg_mode: AggMode = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Clipped value loss.

    .. math::
        V^{\text{clip}} = V_{\text{old}} + \operatorname{clip}(V - V_{\text{old}}, -c, c)

        \ell = \tfrac12 \max\!\big((V - R)^2,\ (V^{\text{clip}} - R)^2\big)

    ``clip_range_value=None`` disables clipping (:math:`\ell = \tfrac12 (V-R)^2`). Stats:
    ``vf_clipfrac``, the fraction of valid tokens where the clipped error was strictly larger.
    """
    unclipped = (values - returns).square()
    if clip_range_value is None:
        loss_mat = unclipped
        clip_taken = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
        clipped = (v_clip - returns).square()
        loss_mat = torch.maximum(unclipped, clipped)
        clip_taken = clipped > unclipped
    loss = 0.5 * aggregate_loss(loss_mat, mask, agg_mode)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean(clip_taken.to(values.dtype), mask)}
    return loss, stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    r"""Entropy of the softmax over the last dim, :math:`H = \log\sum_j e^{z_j} - \sum_j p_j z_j`.

    Computed in at least float32 (cast back to ``logits.dtype``); ``-inf`` logits (masked
    vocabulary entries) contribute nothing and yield no NaN, in value or gradient.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    z_finite = torch.where(torch.isneginf(z), torch.zeros((), dtype=z.dtype, device=z.device), z)
    return (lse.squeeze(-1) - (p * z_finite).sum(dim=-1)).to(logits.dtype)


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
    agg_mode: AggMode = "token-mean",
) -> torch.Tensor:
    r"""Aggregated entropy term :math:`c\cdot\operatorname{agg}(H)`; subtract it from the loss to
    reward exploration (``loss = pg_loss - entropy_bonus(H, mask, c)``)."""
    return coef * aggregate_loss(entropy, mask, agg_mode)


def _reduce(x: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    if reduction == "none":
        return x
    raise ValueError(f"unknown reduction {reduction!r}")


DPOKind = Literal["sigmoid", "ipo", "hinge"]
DPO_KINDS: tuple[str, ...] = ("sigmoid", "ipo", "hinge")


def dpo_loss(
    policy_chosen_logp: torch.Tensor,
    policy_rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    kind: DPOKind = "sigmoid",
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Direct Preference Optimisation (Rafailov et al., 2023) and its variants on per-pair
    sequence log-probs ``[B]`` of the chosen (:math:`y_w`) and rejected (:math:`y_l`) completions.

    With the log-ratio margin
    :math:`h = (\log\pi(y_w) - \log\pi_{\text{ref}}(y_w)) - (\log\pi(y_l) - \log\pi_{\text{ref}}(y_l))`:

    * ``sigmoid`` (DPO, eq. 7): :math:`\ell = -(1-\varepsilon)\log\sigma(\beta h) - \varepsilon\log\sigma(-\beta h)`;
      :math:`\varepsilon` = ``label_smoothing`` > 0 is conservative DPO (cDPO, Mitchell 2023: labels
      flipped with probability :math:`\varepsilon`);
    * ``ipo`` (IPO, Azar et al., 2023, eq. 17 with :math:`\tau` = ``beta``): :math:`\ell = (h - \frac{1}{2\beta})^2`
      on the sequence log-probs as the paper writes it (TRL divides them by the completion length);
    * ``hinge`` (SLiC-HF, Zhao et al., 2023, calibration loss with :math:`\delta = 1/\beta`):
      :math:`\ell = \max(0, 1 - \beta h)`.

    ``label_smoothing`` applies to ``sigmoid`` only. Reference-free DPO passes zeros as the
    reference log-probs. Returns ``(loss, chosen_rewards, rejected_rewards)`` with the implicit
    rewards :math:`\beta(\log\pi(y) - \log\pi_{\text{ref}}(y))` per pair (detached) and the loss
    reduced by ``reduction``.
    """
    chosen = policy_chosen_logp - ref_chosen_logp
    rejected = policy_rejected_logp - ref_rejected_logp
    h = chosen - rejected
    if kind == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).square()
    elif kind == "hinge":
        losses = torch.relu(1.0 - beta * h)
    else:
        raise ValueError(f"unknown DPO kind {kind!r}; expected one of {DPO_KINDS}")
    return _reduce(losses, reduction), (beta * chosen).detach(), (beta * rejected).detach()


def kto_loss(
    policy_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    is_desirable: torch.Tensor,
    kl_ref_point: torch.Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> torch.Tensor:
    r"""Kahneman-Tversky Optimisation (Ethayarajh et al., 2024, eq. 8) on unpaired examples ``[B]``.

    With :math:`r = \log\pi(y) - \log\pi_{\text{ref}}(y)` and reference point
    :math:`z_0 = \max(0, \mathrm{KL})` (detached; the paper estimates the KL as the mean of
    :math:`\log\pi(y'|x) - \log\pi_{\text{ref}}(y'|x)` over mismatched pairs: a prompt with another
    example's completion), the value :math:`v = \lambda_D\sigma(\beta(r - z_0))` (desirable) or
    :math:`\lambda_U\sigma(\beta(z_0 - r))` (undesirable) and :math:`\ell = \lambda_y - v`:

    .. math::
        \ell = \begin{cases}
        \lambda_D\,(1 - \sigma(\beta (r - z_0))) & y\ \text{desirable}\\
        \lambda_U\,(1 - \sigma(\beta (z_0 - r))) & y\ \text{undesirable}
        \end{cases}

    reduced over all examples by ``reduction``.
    """
    r = policy_logp - ref_logp
    z0 = torch.clamp(kl_ref_point.detach().to(r.dtype), min=0.0)
    desirable = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0)))
    undesirable = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r)))
    losses = torch.where(is_desirable.to(torch.bool), desirable, undesirable)
    return _reduce(losses, reduction)
