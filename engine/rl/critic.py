"""The critic's two parts of an RL step: its values (phase 3) and its update (phase 5), for a
critic on this rank or on a pool of its own (:class:`~hyflow.placement.remote_critic.RemoteCritic`
answers the same calls; the critic's pool runs these functions on the rows it owns)."""

from __future__ import annotations

import torch

from hyflow.rl.batch import batching_for
from hyflow.rl.losses import ValueLoss, forward_score, value_scorer
from hyflow.rl.update import update_model


def critic_values(cfg, critic, groups, columns: dict, lengths, shape: tuple[int, int],
                  pad_id: int) -> torch.Tensor:
    """Phase 3's values of these rows ([B, S], forward only). A critic on a pool of its own
    (:class:`~hyflow.placement.remote_critic.RemoteCritic`) is asked for them; its pool runs this
    same function on the rows it owns."""
    if getattr(critic, "remote", False):
        return critic.values(columns, lengths, shape)
    scoring = batching_for(cfg, "critic", groups, pad_id).cut(columns, lengths)
    return forward_score(critic.chunks, scoring, value_scorer(), groups, shape)


def update_critic(cfg, critic, groups, columns: dict, lengths, pad_id: int, **common):
    """Phase 5's critic update over these rows (``columns``: the batch's, ``old_values``, ``returns``);
    a remote critic is sent the returns and answers with its update's statistics."""
    if getattr(critic, "remote", False):
        return critic.update(columns, lengths, **common)
    return update_model(critic, groups, columns, lengths, ValueLoss(cfg.critic),
                        batching=batching_for(cfg, "critic", groups, pad_id),
                        mini_batch_size=cfg.critic.mini_batch_size or cfg.actor.mini_batch_size,
                        epochs=cfg.critic.ppo_epochs or cfg.actor.ppo_epochs, **common)
