"""The reward model of an RL run: a frozen GPTModel with a scalar value head.

Built from ``reward.model_checkpoint`` in the actor's training layout (any TP x PP; the
checkpoint may have been written under another layout), kept in eval mode without
gradients, like the reference. A response's score is the value head's output at its last
token, after reading ``prompt + response``:
:meth:`RewardModel.__call__` is the :data:`hyflow.rewards.manager.RewardModelFn` handed to the
:class:`~hyflow.rewards.manager.RewardManager` (it scores the token ids passed as ``sequences``,
so nothing is re-tokenized). The forward runs through the same pipeline schedule as the
critic's values (:func:`hyflow.rl.step_losses.forward_score`), on the rank's DP shard only.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import torch

from hyflow.checkpoint.model import CheckpointError, load_model_checkpoint, read_checkpoint_info, read_description
from hyflow.checkpoint.trust import read_dcp_index
from hyflow.config import ConfigError
from hyflow.models.builder import build_gpt_model
from hyflow.models.description import ModelDescription
from hyflow.models.stage_split import resolve_stage_layers
from hyflow.rl.batch import batching_for
from hyflow.rl.step_losses import forward_score

KEY = "reward.model_checkpoint"
_HINT = ("set reward.model_checkpoint to a hyflow checkpoint directory of a reward model: a GPTModel with a "
         "scalar value head (output_layer.weight of shape [1, hidden]) written by save_model_checkpoint, "
         "e.g. a critic from an RL checkpoint (<run>/checkpoints/step_N/critic)")


def check_reward_model_checkpoint(path: str) -> ModelDescription:
    """The reward model's description after checking ``path`` is a complete hyflow checkpoint with a
    scalar value head; else one :class:`~hyflow.config.ConfigError` naming the key and the fix.
    Reads files only (no process group needed)."""
    if not path or not os.path.isdir(path):
        raise ConfigError(f"{KEY}={path!r} is not a directory; {_HINT}", key=KEY)
    try:
        read_checkpoint_info(path)
        desc = read_description(path)
    except CheckpointError as e:
        raise ConfigError(f"{KEY}={path!r}: {e}; {_HINT}", key=KEY) from None
    head = _saved_shape(path, "output_layer.weight")
    if head is None or head[0] != 1:
        what = ("it has no output layer (tied embeddings)" if head is None
                else f"its output layer has {head[0]} rows")
        raise ConfigError(f"{KEY}={path!r} is a language-model checkpoint, not a reward model: {what}, "
                          f"no scalar value head; {_HINT}", key=KEY)
    return desc


def _saved_shape(path: str, name: str) -> Optional[tuple]:

    meta = read_dcp_index(path).state_dict_metadata.get(name)
    size = getattr(meta, "size", None)
    return tuple(size) if size is not None else None


class RewardModel:
    """Scores ``prompt + response`` token sequences with a frozen value-head model."""
    def __init__(self, model: torch.nn.Module, desc: ModelDescription, groups, batching,
                 pad_id: int = 0) -> None:
        self.model, self.desc, self.groups = model, desc, groups
        self.batching, self.pad_id = batching, pad_id  # a hyflow.rl.batch.MicroBatching

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 sequences: Optional[Sequence[Sequence[int]]] = None) -> list[float]:
        if sequences is None:
            raise ValueError("the reward model scores token ids: pass sequences= (prompt + response ids)")
        return self.score(sequences).tolist()

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """[N] float32: the value head at the last token of each sequence (collective over the
        model's TP x PP ranks, which must pass the same sequences: a DP shard)."""
        lengths = [len(s) for s in sequences]
        if not lengths or min(lengths) < 1:
            raise ValueError("the reward model needs non-empty sequences")
        if max(lengths) > self.desc.max_position_embeddings:
            raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the reward model's context "
                             f"({self.desc.max_position_embeddings})")
        device = self.groups.device
        tokens = torch.full((len(sequences), max(lengths)), self.pad_id, dtype=torch.long, device=device)
        for i, s in enumerate(sequences):
            tokens[i, :len(s)] = torch.as_tensor(list(s), dtype=torch.long, device=device)
        micro = self.batching.cut({"tokens": tokens}, lengths)
        values = forward_score([self.model], micro, lambda out, batch: out.squeeze(-1), self.groups,
                               tuple(tokens.shape))
        last = torch.as_tensor(lengths, device=device) - 1
        return values[torch.arange(len(sequences), device=device), last].float()


def build_reward_model(cfg, groups, sample_vocab: int, pad_id: int = 0) -> RewardModel:
    """Load ``cfg.reward.model_checkpoint`` into a frozen value-head model in ``groups``' layout."""
    path = cfg.reward.model_checkpoint
    desc = check_reward_model_checkpoint(path)
    if desc.vocab_size < sample_vocab:
        raise ConfigError(f"{KEY}={path!r}: the reward model's vocabulary ({desc.vocab_size}) is smaller than "
                          f"the actor's tokenizer ({sample_vocab}); it must read the actor's token ids", key=KEY)
    total = cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens
    if desc.max_position_embeddings < total:
        raise ConfigError(f"{KEY}={path!r}: the reward model's context ({desc.max_position_embeddings}) is "
                          f"shorter than rollout.max_prompt_length + max_new_tokens = {total}", key=KEY)
    split = groups.layout.stage_layers
    if split is not None and sum(split) != desc.num_layers:
        # The actor's stage split counts the actor's layers; a reward model of another depth gets
        # its own (a scalar head: balanced is even where it divides), on the same ranks and groups.


        own = resolve_stage_layers(dataclasses.replace(groups.layout, stage_layers=None), desc, 0.0)
        groups = dataclasses.replace(groups, layout=own)
    try:
        groups.layout.check_model(desc)
    except ValueError as e:
        raise ConfigError(f"{KEY}={path!r} cannot run in the actor's training layout: {e}", key=KEY) from None
    model = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec, value_head=True,
                            config_overrides={"perform_initialization": False})
    try:
        load_model_checkpoint(model, path, groups, desc)
    except CheckpointError as e:
        raise ConfigError(f"{KEY}={path!r}: {e}; {_HINT}", key=KEY) from None
    model.requires_grad_(False)
    model.eval()

    return RewardModel(model, desc, groups, batching_for(cfg, "reference", groups, pad_id), pad_id)
