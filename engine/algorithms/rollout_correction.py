r"""Rollout correction: importance weights and masks for tokens the trainer did not sample.

The sampler draws :math:`y \sim \mu` (the generator: other kernels, layout, precision, or a
stale policy); PPO's ratio is taken against :math:`\pi_{\text{old}}`, the training-layout
forward. Importance sampling corrects the gap with :math:`\rho_t = \pi_{\text{old}}(y_t) /
\mu(y_t) = \exp(\log\pi_{\text{old}} - \log\mu)` (log-ratios clamped to ``[-20, 20]``). Modes
(``actor.rollout_correction.mode``):

* ``token_tis`` -- truncated IS per token: :math:`w_t = \min(\rho_t, C)`;
* ``seq_tis`` -- truncated IS per sequence: :math:`w_{i,t} = \min(\prod_t\rho_{i,t}, C)`;
* ``seq_mis`` -- masked IS per sequence: sequences whose ratio :math:`\prod_t\rho_{i,t}` leaves
  ``[low, high]`` are dropped from the loss (mask ``0``); kept ones are weighted by their ratio;
* ``icepop`` -- two-sided token masking (IcePop): tokens whose :math:`\rho_t` leaves
  ``[low, high]`` are dropped; kept tokens are weighted by :math:`\rho_t`;
* ``off`` -- weights ``1``, mask unchanged.

Weights are constants for the loss (detached): the per-token policy losses multiply them in
(``is_weights=``). Stats are per-row sums / maxima (see
:func:`hyflow.algorithms.masked.pack_row_stats`); :func:`rollout_correction_metrics` turns the
totals into ``rollout_corr/*`` metrics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hyflow.choices import CORRECTION_MODES, CorrectionMode

__all__ = ["CORRECTION_MODES", "RolloutCorrection", "rollout_correction", "rollout_correction_metrics"]

_LOG_CLAMP = 20.0


@dataclass
class RolloutCorrection:
    """Result of :func:`rollout_correction`.

    Attributes:
        weights: ``[B, S]`` detached IS weights, ``0`` where ``mask`` is ``0``.
        mask: ``[B, S]`` the response mask with dropped tokens / sequences set to ``0``
            (same dtype as the input mask); aggregate the loss with it.
        stats: per-row ``[B]`` float64 sums (maxima for ``*_max``): ``tokens`` (response tokens
            before correction), ``kept_tokens``, ``weight_sum`` and ``weight_max`` (over kept
            tokens), ``truncated_tokens`` (kept tokens whose ratio exceeded the cap), ``seqs``
            (1 per non-empty row), ``masked_seqs`` (1 where the correction dropped any token).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    stats: dict[str, torch.Tensor]


def rollout_correction(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
                       mode: CorrectionMode = "token_tis", cap: float = 2.0, low: float = 0.5,
                       high: float = 2.0) -> RolloutCorrection:
    """IS weights, corrected mask and stats for one batch (see the module docstring).

    ``old_logp`` is the training-layout forward's log-probs (:math:`\\pi_{\\text{old}}`),
    ``rollout_logp`` the sampler's (:math:`\\mu`), both ``[B, S]`` aligned to the tokens they
    score. ``cap`` is :math:`C` of the TIS modes; ``[low, high]`` the band of ``seq_mis`` and
    ``icepop``.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r}; expected one of {CORRECTION_MODES}")
    if old_logp.shape != rollout_logp.shape or old_logp.shape != response_mask.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have one shape [B, S]")
    if cap <= 0 or not 0 <= low < high:
        raise ValueError(f"need cap > 0 and 0 <= low < high, got cap={cap}, low={low}, high={high}")
    dev = old_logp.device
    keep = response_mask.to(device=dev) != 0
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    with torch.no_grad():
        log_ratio = torch.where(keep, old_logp.detach().double() - rollout_logp.detach().to(dev).double(), zero)
        if mode in ("seq_tis", "seq_mis"):
            seq = torch.clamp(log_ratio.sum(dim=-1, keepdim=True), -_LOG_CLAMP, _LOG_CLAMP)
            ratio = torch.exp(seq).expand_as(log_ratio)
        else:
            ratio = torch.exp(torch.clamp(log_ratio, -_LOG_CLAMP, _LOG_CLAMP))
        kept = keep
        truncated = torch.zeros_like(keep)
        if mode == "off":
            weights = torch.ones_like(ratio)
        elif mode in ("token_tis", "seq_tis"):
            truncated = keep & (ratio > cap)
            weights = torch.clamp(ratio, max=cap)
        else:  # seq_mis, icepop: drop what leaves the band, weight the rest by its ratio
            kept = keep & (ratio >= low) & (ratio <= high)
            weights = ratio
        weights = torch.where(kept, weights, zero)
        out_mask = torch.where(kept, response_mask.to(dev), torch.zeros((), dtype=response_mask.dtype, device=dev))
        dropped = keep & ~kept
        stats = {
            "tokens": keep.double().sum(dim=-1),
            "kept_tokens": kept.double().sum(dim=-1),
            "weight_sum": weights.sum(dim=-1),
            "weight_max": weights.amax(dim=-1) if weights.shape[-1] else weights.sum(dim=-1),
            "truncated_tokens": truncated.double().sum(dim=-1),
            "seqs": keep.any(dim=-1).double(),
            "masked_seqs": dropped.any(dim=-1).double(),
        }
    return RolloutCorrection(weights=weights.to(old_logp.dtype), mask=out_mask, stats=stats)


def rollout_correction_metrics(totals: dict[str, float]) -> dict[str, float]:
    """``rollout_corr/*`` metrics from :class:`RolloutCorrection` stats totals (summed / maxed
    over every row of every rank)."""
    tokens, kept, seqs = totals["tokens"], totals["kept_tokens"], totals["seqs"]
    return {
        "rollout_corr/rollout_is_mean": totals["weight_sum"] / kept if kept else 0.0,
        "rollout_corr/rollout_is_max": totals["weight_max"],
        "rollout_corr/rollout_is_ratio_fraction_high": totals["truncated_tokens"] / kept if kept else 0.0,
        "rollout_corr/rollout_rs_masked_fraction": (tokens - kept) / tokens if tokens else 0.0,
        "rollout_corr/rollout_rs_seq_masked_fraction": totals["masked_seqs"] / seqs if seqs else 0.0,
    }
