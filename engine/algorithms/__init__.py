"""RL post-training algorithms as small pure tensor functions.

* :mod:`.masked` -- masked reductions and whitening shared by everything else;
* :mod:`.advantages` -- GAE, GRPO / Dr. GRPO, RLOO, REINFORCE++ (+ baseline), ReMax;
* :mod:`.kl` -- per-token KL estimators, KL coefficient controllers, KL reward penalty;
* :mod:`.losses` -- loss aggregation, PPO policy / value losses, entropy, DPO / IPO / hinge, KTO.

Registries: ``ADV_ESTIMATORS`` maps an estimator name to its function (signatures differ:
token-level estimators return ``(advantages, returns)``, outcome estimators ``advantages``);
``LOSS_AGG_MODES`` and ``KL_ESTIMATORS`` list the valid mode / kind strings.
"""
from __future__ import annotations

import functools
from typing import Callable

from hyflow.algorithms.advantages import (
    GroupIds,
    gae,
    group_index,
    grpo_outcome,
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
from hyflow.algorithms.losses import (
    DPO_KINDS,
    LOSS_AGG_MODES,
    aggregate_loss,
    dpo_loss,
    entropy_bonus,
    entropy_from_logits,
    kto_loss,
    ppo_policy_loss,
    value_loss,
)
from hyflow.algorithms.masked import (
    last_token_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    scatter_to_last_token,
)

ADV_ESTIMATORS: dict[str, Callable] = {
    "gae": gae,
    "grpo": grpo_outcome,
    "dr_grpo": functools.partial(grpo_outcome, norm_by_std=False),
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_pp,
    "reinforce_plus_plus_baseline": reinforce_pp_baseline,
    "remax": remax,
}

__all__ = [
    "ADV_ESTIMATORS",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
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
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "kl_estimate",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "aggregate_loss",
    "ppo_policy_loss",
    "value_loss",
    "entropy_from_logits",
    "entropy_bonus",
    "DPO_KINDS",
    "dpo_loss",
    "kto_loss",
]
