r"""KL-divergence estimators, KL coefficient controllers and the KL reward penalty.

Per-token estimators of :math:`\mathrm{KL}(\pi\,\|\,\pi_{\text{ref}})` from samples
:math:`y\sim\pi` (Schulman, "Approximating KL Divergence", 2020). With
:math:`\ell = \log\pi(y) - \log\pi_{\text{ref}}(y)`:

* ``k1``: :math:`\ell` (unbiased, can be negative)
* ``abs``: :math:`|\ell|`
* ``k2``: :math:`\tfrac12\ell^2` (low variance, biased)
* ``k3``: :math:`e^{-\ell} + \ell - 1` (unbiased, always :math:`\ge 0`)
* ``low_var_kl``: k3 with :math:`\ell` clamped to :math:`[-20, 20]` before the exponential and
  the result clamped to :math:`[-c, c]` (``c = 10`` by default)
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from hyflow.algorithms.masked import scatter_to_last_token
from hyflow.choices import KL_ESTIMATORS, KLKind


__all__ = [
    "KLKind",
    "KL_ESTIMATORS",
    "kl_estimate",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "make_kl_controller",
]


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: KLKind = "k1",
    clamp: Optional[float] = 10.0,
) -> torch.Tensor:
    r"""Per-token KL estimate (see the module table); same shape and dtype as ``logp``.

    ``k3`` is :math:`e^{r} - r - 1` with :math:`r = \log\pi_{\text{ref}} - \log\pi`.
    ``clamp`` bounds the ``low_var_kl`` result to ``[-clamp, clamp]`` (``None``: no bound);
    it does not affect the other kinds.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        r = -log_ratio
        return torch.expm1(r) - r
    if kind == "low_var_kl":
        r = torch.clamp(-log_ratio, min=-20.0, max=20.0)
        kl = torch.expm1(r) - r
        return kl if clamp is None else torch.clamp(kl, min=-clamp, max=clamp)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op (kept for a uniform interface)."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    r"""Proportional KL controller (Ziegler et al., 2019, "Fine-Tuning LMs from Human Preferences").

    .. math::
        e_t = \operatorname{clip}\!\left(\frac{\mathrm{KL}_t}{\mathrm{KL}_{\text{target}}} - 1,
              -0.2,\ 0.2\right),\qquad
        \beta_{t+1} = \beta_t\left(1 + e_t\,\frac{n_{\text{steps}}}{\text{horizon}}\right)
    """

    ERROR_CLIP = 0.2

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError("target and horizon must be positive")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Apply one controller step and return the new coefficient."""
        error = min(max(float(current_kl) / self.target - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def apply_kl_penalty(
    token_scores_or_outcome: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: KLKind = "k1",
) -> torch.Tensor:
    r"""Token rewards with a per-token KL penalty folded in.

    .. math:: r_t = s_t - \beta\,\widehat{\mathrm{KL}}_t\quad\text{on valid tokens},\qquad r_t = 0\ \text{on padding}

    ``token_scores_or_outcome`` is either token scores ``[B, T]`` or one outcome score per
    sequence ``[B]``, which is placed on the last valid response token (a row with no valid
    token drops its score). Returns ``[B, T]`` in the scores' dtype.
    """
    if token_scores_or_outcome.dim() == 1:
        scores = scatter_to_last_token(token_scores_or_outcome, mask)
    elif token_scores_or_outcome.shape == logp.shape:
        scores = token_scores_or_outcome
    else:
        raise ValueError("scores must be [B] (outcome) or the shape of logp [B, T]")
    kl = kl_estimate(logp, ref_logp, kind).to(scores.dtype)
    keep = mask.to(device=scores.device) != 0
    return torch.where(keep, scores - coef * kl, torch.zeros((), dtype=scores.dtype, device=scores.device))


def make_kl_controller(alg_cfg: Any):
    """The KL coefficient controller an ``AlgorithmConfig`` asks for (``kl_ctrl.type``)."""
    ctrl = alg_cfg.kl_ctrl
    if ctrl.type == "adaptive":
        return AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    return FixedKLController(ctrl.kl_coef)
