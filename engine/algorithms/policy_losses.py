r"""Per-token policy losses: vanilla PPO, GSPO and CISPO, selectable by name.

Every function here has one signature (see :data:`POLICY_LOSSES`)::

    loss_fn(logp, old_logp, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=None,
            clip_ratio_c=None, is_weights=None) -> (loss [B, S], stats)

* inputs are ``[B, S]`` with one sequence per row; ``response_mask`` marks its response tokens;
* ``loss`` is the **per-token** loss, ``0`` on masked positions (even where the inputs hold
  NaN/inf there, in value and gradient). It is not aggregated: the caller reduces it with
  :func:`hyflow.algorithms.losses.aggregation_weights` and a denominator summed over every
  data-parallel rank;
* ``stats`` are detached per-token tensors ``[B, S]`` (``0`` on masked positions), to be reduced
  as masked means over response tokens by the caller: ``clip_frac`` (1 where the clipped branch
  was taken), ``clip_frac_lower`` (1 where the dual-clip bound was taken), ``approx_kl``
  (:math:`\log\pi_{\text{old}} - \log\pi`, k1) and ``ratio`` (the ratio the loss used);
* ``is_weights`` (optional, ``[B, S]``): rollout-correction importance weights
  (:func:`hyflow.algorithms.rollout_correction.rollout_correction`), multiplied into the
  per-token loss as constants (never differentiated).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = [
    "PolicyLossFn",
    "POLICY_LOSSES",
    "get_policy_loss",
    "vanilla_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
]

LOG_RATIO_CLAMP = 20.0

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _clean(mask: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(keep, x_1, ...)``: the bool mask and each ``x`` with masked positions set to ``0``.

    ``torch.where`` (not a product) so NaN/inf padding reaches neither values nor gradients.
    """
    keep = mask.to(device=xs[0].device) != 0
    zero = torch.zeros((), dtype=xs[0].dtype, device=xs[0].device)
    return (keep,) + tuple(torch.where(keep, x, zero) for x in xs)


def _finish(keep: torch.Tensor, loss: torch.Tensor, is_weights: Optional[torch.Tensor],
            **stats: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if is_weights is not None:
        loss = loss * torch.where(keep, is_weights.detach().to(loss.dtype), zero)
    loss = torch.where(keep, loss, zero)
    out = {k: torch.where(keep, v.detach().to(loss.dtype), zero) for k, v in stats.items()}
    return loss, out


def _bounds(clip_ratio_low: float, clip_ratio_high: Optional[float]) -> tuple[float, float]:
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    if clip_ratio_low < 0 or high < 0:
        raise ValueError(f"clip ratios must be >= 0, got low={clip_ratio_low}, high={high}")
    return 1.0 - clip_ratio_low, 1.0 + high


def vanilla_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""PPO clipped surrogate per token (Schulman et al., 2017), with decoupled clip range
    (DAPO "clip-higher", Yu et al., 2025) and optional dual clip (Ye et al., 2020).

    .. math::
        \rho = \exp(\operatorname{clamp}(\log\pi - \log\pi_{\text{old}}, -20, 20))

        \ell^{\text{clip}} = \max\!\big(-A\rho,\ -A\operatorname{clip}(\rho, 1-\epsilon_{\text{low}},
        1+\epsilon_{\text{high}})\big)

        \ell = \begin{cases}\min(\ell^{\text{clip}},\ -A\,c) & A < 0\ \text{and dual clip}\\
        \ell^{\text{clip}} & \text{otherwise}\end{cases}

    times ``is_weights`` when given. ``clip_ratio_high`` defaults to ``clip_ratio_low``;
    ``clip_ratio_c`` (``> 1``) enables the dual clip.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    low, high = _bounds(clip_ratio_low, clip_ratio_high)
    keep, logp, old_logp, advantages = _clean(response_mask, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_branch = -advantages * torch.clamp(ratio, low, high)
    loss = torch.maximum(unclipped, clipped_branch)
    clip_taken = clipped_branch > unclipped
    lower_taken = torch.zeros_like(clip_taken)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        lower_taken = (advantages < 0) & (bound < loss)
        loss = torch.where(lower_taken, bound, loss)
    return _finish(keep, loss, is_weights, clip_frac=clip_taken, clip_frac_lower=lower_taken,
                   approx_kl=-log_ratio, ratio=ratio)


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: Optional[float] = 4e-4,
    clip_ratio_c: Optional[float] = None,
    is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Group Sequence Policy Optimization (Zheng et al., 2025), in its GSPO-token form.

    The sequence ratio is the geometric mean of the token ratios of sequence :math:`i`
    (:math:`|y_i|` response tokens):

    .. math::
        s_i = \Big(\frac{\pi(y_i)}{\pi_{\text{old}}(y_i)}\Big)^{1/|y_i|}
            = \exp\Big(\frac{1}{|y_i|}\sum_t \log\frac{\pi(y_{i,t})}{\pi_{\text{old}}(y_{i,t})}\Big)

        s_{i,t} = \operatorname{sg}[s_i]\cdot\frac{\pi(y_{i,t})}{\operatorname{sg}[\pi(y_{i,t})]}

        \ell_{i,t} = \max\!\big(-A_{i,t}\, s_{i,t},\ -A_{i,t}\operatorname{clip}(s_{i,t},
        1-\epsilon_{\text{low}}, 1+\epsilon_{\text{high}})\big)

    :math:`s_{i,t}` equals :math:`s_i` in value; with a sequence-level advantage and the
    ``seq-mean-token-mean`` aggregation its gradient is exactly the gradient of GSPO's
    sequence objective :math:`\frac1G\sum_i\min(s_iA_i, \operatorname{clip}(s_i)A_i)`.
    The detached log sequence ratio is clamped to ``[-20, 20]`` (no effect on gradients).
    The paper's clip ranges are tiny (``3e-4`` / ``4e-4``) because :math:`s_i` is a
    per-token geometric mean. There is no dual clip (``clip_ratio_c`` must be None).
    """
    if clip_ratio_c is not None:
        raise ValueError("GSPO has no dual clip: clip_ratio_c must be None")
    low, high = _bounds(clip_ratio_low, clip_ratio_high)
    keep, logp, old_logp, advantages = _clean(response_mask, logp, old_logp, advantages)
    count = keep.sum(dim=-1).clamp(min=1).to(logp.dtype)
    seq_log_ratio = (logp - old_logp).sum(dim=-1) / count  # [B]
    anchor = torch.clamp(seq_log_ratio.detach(), min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(logp - logp.detach() + anchor.unsqueeze(-1))  # value s_i, gradient of s_{i,t}
    unclipped = -advantages * ratio
    clipped_branch = -advantages * torch.clamp(ratio, low, high)
    loss = torch.maximum(unclipped, clipped_branch)
    return _finish(keep, loss, is_weights, clip_frac=clipped_branch > unclipped,
                   clip_frac_lower=torch.zeros_like(keep), approx_kl=old_logp - logp, ratio=ratio)


def cispo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

    .. math::
        \hat r = \operatorname{clip}(\rho,\ 1-\epsilon_{\text{low}},\ 1+\epsilon_{\text{high}}),
        \qquad \ell = -\operatorname{sg}[\hat r]\, A\, \log\pi

    Unlike PPO, a token whose ratio is clipped keeps its gradient
    :math:`-\hat r A\,\nabla\log\pi`; only the weight is bounded. The paper bounds the weight
    from above only: ``clip_ratio_low >= 1`` removes the lower bound. No dual clip.
    """
    if clip_ratio_c is not None:
        raise ValueError("CISPO has no dual clip: clip_ratio_c must be None")
    low, high = _bounds(clip_ratio_low, clip_ratio_high)
    keep, logp, old_logp, advantages = _clean(response_mask, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, min=max(low, 0.0), max=high).detach()
    loss = -weight * advantages * logp
    return _finish(keep, loss, is_weights, clip_frac=weight != ratio.detach(),
                   clip_frac_lower=torch.zeros_like(keep), approx_kl=-log_ratio, ratio=ratio)


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": vanilla_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    """The per-token policy loss called ``name`` (``actor.policy_loss``)."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; expected one of {sorted(POLICY_LOSSES)}") from None
