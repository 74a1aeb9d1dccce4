"""RL post-training algorithms as small pure tensor functions.

* :mod:`.masked` -- masked reductions and whitening shared by everything else;
* :mod:`.advantages` -- GAE, GRPO / Dr. GRPO, GRPO pass@k, RLOO, REINFORCE++ (+ baseline), ReMax;
* :mod:`.kl` -- per-token KL estimators, KL coefficient controllers, KL reward penalty;
* :mod:`.losses` -- loss aggregation (per-rank weights), the value loss, DPO / IPO / hinge, KTO;
* :mod:`.policy_losses` -- per-token policy losses: vanilla PPO, GSPO, CISPO;
* :mod:`.rollout_correction` -- IS weights / masks for the sampler-trainer gap (TIS, MIS, IcePop);
* :mod:`.mismatch` -- sampler vs trainer log-prob mismatch metrics;
* :mod:`.dapo` -- dynamic sampling (groups with reward variance) and overlong reward shaping.

Registries: ``ADV_ESTIMATORS`` maps an estimator name to its function (signatures differ:
token-level estimators return ``(advantages, returns)``, outcome estimators ``advantages``);
``POLICY_LOSSES`` maps ``actor.policy_loss`` names to per-token losses with one signature;
``LOSS_AGG_MODES``, ``KL_ESTIMATORS`` and ``CORRECTION_MODES`` list the valid mode / kind strings.
Differences from verl's conventions are listed in ``docs/algorithms.md``.
"""
from __future__ import annotations

import functools
from typing import Callable

from hyflow.algorithms.advantages import (
    GroupIds,
    gae,
    group_index,
    grpo_outcome,
    grpo_passk,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from hyflow.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
)
from hyflow.algorithms.dapo import groups_with_signal, overlong_penalty
from hyflow.algorithms.losses import (
    DPO_KINDS,
    LOSS_AGG_MODES,
    aggregation_weights,
    dpo_loss,
    kto_loss,
    value_token_loss,
)
from hyflow.algorithms.masked import (
    last_token_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    pack_row_stats,
    scatter_to_last_token,
    unpack_row_stats,
)
from hyflow.algorithms.mismatch import mismatch_metrics, mismatch_row_stats
from hyflow.algorithms.policy_losses import (
    POLICY_LOSSES,
    cispo_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    vanilla_policy_loss,
)
from hyflow.algorithms.rollout_correction import (
    CORRECTION_MODES,
    RolloutCorrection,
    rollout_correction,
    rollout_correction_metrics,
)

ADV_ESTIMATORS: dict[str, Callable] = {
    "gae": gae,
    "grpo": grpo_outcome,
    "dr_grpo": functools.partial(grpo_outcome, norm_by_std=False),
    "grpo_passk": grpo_passk,
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_pp,
    "reinforce_plus_plus_baseline": reinforce_pp_baseline,
    "remax": remax,
}

__all__ = [
    "ADV_ESTIMATORS",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "CORRECTION_MODES",
    "GroupIds",
    "group_index",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "last_token_index",
    "scatter_to_last_token",
    "gae",
    "grpo_outcome",
    "grpo_passk",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "kl_estimate",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "aggregation_weights",
    "value_token_loss",
    "get_policy_loss",
    "vanilla_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "RolloutCorrection",
    "rollout_correction",
    "rollout_correction_metrics",
    "mismatch_row_stats",
    "mismatch_metrics",
    "pack_row_stats",
    "unpack_row_stats",
    "groups_with_signal",
    "overlong_penalty",
    "DPO_KINDS",
    "dpo_loss",
    "kto_loss",
]
