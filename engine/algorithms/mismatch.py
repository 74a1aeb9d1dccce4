r"""Training-generation mismatch: how far the sampler's log-probs are from the trainer's.

The generator reports :math:`\log\mu(y_t)` for every token it samples; the training-layout
forward on the same weights gives :math:`\log\pi(y_t)`. In exact arithmetic they are equal;
kernels, reduction orders, layouts and precisions make them differ. With
:math:`\delta_t = \log\pi(y_t) - \log\mu(y_t)` over response tokens:

* ``rollout/logprob_diff_max``, ``rollout/logprob_diff_mean``: :math:`\max|\delta|`, mean :math:`|\delta|`;
* ``rollout/logprob_diff_frac_above``: the fraction of tokens with :math:`|\delta| >` ``threshold``
  (``1e-3`` by default);
* ``rollout_corr/kl``: :math:`\mathrm{mean}(-\delta)`, k1 estimate of
  :math:`\mathrm{KL}(\mu\,\|\,\pi)` (the samples come from :math:`\mu`);
* ``rollout_corr/k3_kl``: :math:`\mathrm{mean}(e^{\delta} - \delta - 1)`, the k3 estimate of the same
  KL (non-negative, no clamping);
* per sequence, with :math:`\Delta_i = \sum_t\delta_{i,t}` the log of the sequence ratio
  :math:`\pi(y_i)/\mu(y_i)`: ``rollout_corr/seq_log_ratio_mean``, ``..._abs_mean``, ``..._abs_max``
  and ``..._std`` over non-empty sequences.

:func:`mismatch_row_stats` returns per-row sums / maxima (sum them over data-parallel ranks with
:func:`hyflow.algorithms.masked.pack_row_stats`); :func:`mismatch_metrics` turns the totals
into the metric dict.
"""
from __future__ import annotations

import math

import torch

__all__ = ["mismatch_row_stats", "mismatch_metrics"]


def mismatch_row_stats(train_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
                       threshold: float = 1e-3) -> dict[str, torch.Tensor]:
    """Per-row statistics ``[B]`` of :math:`\\delta = \\log\\pi - \\log\\mu` over response tokens.

    Keys (sums unless the name ends in ``_max``): ``tokens``, ``abs_diff_sum``, ``abs_diff_max``,
    ``above_threshold`` (count), ``k1_sum`` (of :math:`-\\delta`), ``k3_sum``, ``seqs`` (1 for a
    non-empty row), ``seq_log_ratio_sum``, ``seq_log_ratio_abs_sum``, ``seq_log_ratio_sq_sum``,
    ``seq_log_ratio_abs_max``. Computed in float64; padding (even NaN) is ignored.
    """
    if train_logp.shape != rollout_logp.shape or train_logp.shape != response_mask.shape:
        raise ValueError(f"train_logp {tuple(train_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have one shape [B, S]")
    keep = response_mask.to(device=train_logp.device) != 0
    zero = torch.zeros((), dtype=torch.float64, device=train_logp.device)
    delta = torch.where(keep, train_logp.double() - rollout_logp.to(train_logp.device).double(), zero)
    absd = delta.abs()
    k3 = torch.where(keep, torch.expm1(delta) - delta, zero)
    seq = delta.sum(dim=-1)
    nonempty = keep.any(dim=-1).double()
    return {
        "tokens": keep.double().sum(dim=-1),
        "abs_diff_sum": absd.sum(dim=-1),
        "abs_diff_max": absd.amax(dim=-1) if delta.shape[-1] else torch.zeros_like(seq),
        "above_threshold": (keep & (absd > threshold)).double().sum(dim=-1),
        "k1_sum": (-delta).sum(dim=-1),
        "k3_sum": k3.sum(dim=-1),
        "seqs": nonempty,
        "seq_log_ratio_sum": seq,
        "seq_log_ratio_abs_sum": seq.abs(),
        "seq_log_ratio_sq_sum": seq.square(),
        "seq_log_ratio_abs_max": seq.abs(),
    }


def mismatch_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Metric dict from :func:`mismatch_row_stats` totals (summed / maxed over every row of
    every rank). Means over zero tokens or sequences are ``0``."""
    tokens, seqs = totals["tokens"], totals["seqs"]
    per_tok = (lambda v: v / tokens) if tokens else (lambda v: 0.0)  # noqa: E731
    per_seq = (lambda v: v / seqs) if seqs else (lambda v: 0.0)  # noqa: E731
    seq_mean = per_seq(totals["seq_log_ratio_sum"])
    seq_var = per_seq(totals["seq_log_ratio_sq_sum"]) - seq_mean ** 2
    if seqs > 1:
        seq_var *= seqs / (seqs - 1)
    return {
        "rollout/logprob_diff_max": totals["abs_diff_max"],
        "rollout/logprob_diff_mean": per_tok(totals["abs_diff_sum"]),
        "rollout/logprob_diff_frac_above": per_tok(totals["above_threshold"]),
        "rollout_corr/kl": per_tok(totals["k1_sum"]),
        "rollout_corr/k3_kl": per_tok(totals["k3_sum"]),
        "rollout_corr/seq_log_ratio_mean": seq_mean,
        "rollout_corr/seq_log_ratio_abs_mean": per_seq(totals["seq_log_ratio_abs_sum"]),
        "rollout_corr/seq_log_ratio_abs_max": totals["seq_log_ratio_abs_max"],
        "rollout_corr/seq_log_ratio_std": math.sqrt(max(seq_var, 0.0)),
    }
