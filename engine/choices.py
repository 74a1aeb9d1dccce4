"""The names a user picks an algorithm's parts by, declared once as ``Literal`` types (no torch: the
configs import them, and so do the algorithms that implement each name)."""

from __future__ import annotations

from typing import Literal, get_args

#: ``actor.policy_loss``: the per-token policy loss (:data:`hyflow.algorithms.policy_losses.POLICY_LOSSES`)
PolicyLossName = Literal["vanilla", "gspo", "cispo"]
#: ``actor.loss_agg_mode``: how per-token losses become one number (:func:`hyflow.algorithms.losses.aggregation_weights`)
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
#: ``algorithm.kl_penalty``, ``actor.kl_loss_type``: the KL estimator (:func:`hyflow.algorithms.kl.kl_estimate`)
KLKind = Literal["k1", "k2", "k3", "abs", "low_var_kl"]
#: ``actor.rollout_correction.mode`` (:func:`hyflow.algorithms.rollout_correction.rollout_correction`)
CorrectionMode = Literal["off", "token_tis", "seq_tis", "seq_mis", "icepop"]

LOSS_AGG_MODES: tuple[str, ...] = get_args(AggMode)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLKind)
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
