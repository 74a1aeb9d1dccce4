"""The critic on this rank: its values (phase 3) and its update (phase 5) over the rows this rank
owns, the colocated :class:`~hyflow.roles.Critic`. A critic on a pool of its own is a
:class:`~hyflow.placement.remote_critic.RemoteCritic` on the training pool, and its pool runs a
:class:`LocalCritic` on the rows it owns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hyflow.checkpoint.trained_model import TrainedModel
from hyflow.parallel.groups import ParallelGroups
from hyflow.rl.batch import batching_for
from hyflow.rl.step_losses import ValueLoss, forward_score, value_scorer
from hyflow.rl.update import UpdateStats, update_model


@dataclass
class LocalCritic:
    """A critic held by this rank (``trained``: its chunks, optimizer and scheduler) in ``groups``'
    layout; ``cfg``: the RL config (``critic.*`` sets its batching and update)."""

    trained: TrainedModel
    cfg: object
    groups: ParallelGroups
    pad_id: int

    @property
    def model(self) -> TrainedModel:
        """Checkpointed with the actor."""
        return self.trained

    def values(self, columns: dict, lengths: Sequence[int], shape: tuple[int, int]) -> torch.Tensor:
        """``[B, S]`` values of these rows (forward only)."""
        scoring = batching_for(self.cfg, "critic", self.groups, self.pad_id).cut(columns, lengths)
        return forward_score(self.trained.chunks, scoring, value_scorer(), self.groups, shape)

    def update(self, columns: dict, lengths: Sequence[int], *, seed: int, step: int, row_offset: int,
               agg_mode: str, norm_length: float) -> UpdateStats:
        """The critic's mini-batches x epochs over these rows (``columns``: the batch's, ``old_values``,
        ``returns``)."""
        cfg = self.cfg
        return update_model(self.trained, self.groups, columns, lengths, ValueLoss(cfg.critic),
                            batching=batching_for(cfg, "critic", self.groups, self.pad_id),
                            mini_batch_size=cfg.critic.mini_batch_size or cfg.actor.mini_batch_size,
                            epochs=cfg.critic.ppo_epochs or cfg.actor.ppo_epochs, seed=seed, step=step,
                            row_offset=row_offset, agg_mode=agg_mode, norm_length=norm_length)
