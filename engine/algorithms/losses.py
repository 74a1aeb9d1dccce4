r"""Loss aggregation, the value loss and the preference losses (pure math).

Token-level losses are ``[B, T]`` matrices reduced under a ``response_mask`` by the per-token
weights of :func:`aggregation_weights` (``sum(w * x) / d``, with ``d`` summed over data-parallel
ranks); padding (mask ``0``) never contributes, even when it holds NaN/inf. The per-token policy
losses (vanilla PPO, GSPO, CISPO) live in :mod:`.policy_losses`; the RL step's loss objects that
apply them to model outputs in :mod:`hyflow.rl.step_losses`.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F

from hyflow.choices import LOSS_AGG_MODES, AggMode


__all__ = [
    "AggMode",
    "LOSS_AGG_MODES",
    "aggregation_weights",
    "value_token_loss",
    "DPO_KINDS",
    "dpo_loss",
    "kto_loss",
]


def _norm_length(norm_length: Optional[float]) -> float:
    if norm_length is None or norm_length <= 0:
        raise ValueError(
            f"seq-mean-token-sum-norm needs a positive constant norm_length (got {norm_length}): pass the "
            "response budget (rollout.max_new_tokens) or actor.loss_scale_factor, never a batch's width")
    return float(norm_length)


def aggregation_weights(
    mask: torch.Tensor,
    mode: AggMode = "token-mean",
    norm_length: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Per-token weights ``w [B, T]`` and this batch's denominator ``d`` (a scalar) such that
    the mask-aware aggregation of ``x`` is ``(w * x).sum() / d`` (``0`` when ``d = 0``).

    Over data-parallel ranks (or micro-batches) the aggregation of the whole batch is
    :math:`\sum_{\text{ranks}}\sum w\,x / \sum_{\text{ranks}} d`: ``w`` depends only on each
    row, so sum ``d`` over all ranks first (an all-reduce of one number) and divide every
    rank's :math:`\sum w\,x` by it. ``d`` is the number of valid tokens (``token-mean``) or of
    non-empty sequences (the ``seq-mean-*`` modes); ``w`` is ``m``, ``m``,
    :math:`m / \sum_t m` and :math:`m / L` for the four modes. ``w`` is ``0`` on padding.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    keep = mask != 0
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    m = torch.where(keep, mask.to(dtype), torch.zeros((), dtype=dtype, device=mask.device))
    if mode == "token-mean":
        return m, m.sum()
    count = keep.any(dim=-1).sum().to(m.dtype)
    if mode == "seq-mean-token-sum":
        return m, count
    if mode == "seq-mean-token-mean":
        row = m.sum(dim=-1, keepdim=True)
        return m / torch.where(row != 0, row, torch.ones_like(row)), count
    return m / _norm_length(norm_length), count


def value_token_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range_value: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Clipped value loss per token (``[B, T]``, ``0`` on padding, NaN-safe there).

    .. math::
        V^{\text{clip}} = V_{\text{old}} + \operatorname{clip}(V - V_{\text{old}}, -c, c)

        \ell = \tfrac12 \max\!\big((V - R)^2,\ (V^{\text{clip}} - R)^2\big)

    ``clip_range_value=None`` disables clipping (:math:`\ell = \tfrac12 (V-R)^2`). Stats
    (detached ``[B, T]``): ``vf_clipfrac``, 1 where the clipped error was strictly larger.
    """
    keep = mask.to(device=values.device) != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values, old_values, returns = (torch.where(keep, x, zero) for x in (values, old_values, returns))
    unclipped = (values - returns).square()
    if clip_range_value is None:
        loss_mat = unclipped
        clip_taken = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
        clipped = (v_clip - returns).square()
        loss_mat = torch.maximum(unclipped, clipped)
        clip_taken = clipped > unclipped
    return 0.5 * loss_mat, {"vf_clipfrac": (clip_taken & keep).to(values.dtype)}


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
