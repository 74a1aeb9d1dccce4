"""Validation of a checkpoint outside training (``hyflow eval``): the model loaded in a generation
layout, each data-parallel replica validating a share of the prompts with the same
:class:`~hyflow.validation.rl.Validation` the RL job runs, so the numbers equal the run's."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.distributed as dist

from hyflow.agent.agent import MultiTurnAgent
from hyflow.data.tasks import load_data_tokenizer
from hyflow.parallel.groups import init_training_groups
from hyflow.parallel.layout import Layout
from hyflow.rewards.manager import RewardManager
from hyflow.rl.reward_model import build_reward_model
from hyflow.rollout.config import GenerationConfig
from hyflow.rollout.dp import generate_data_parallel
from hyflow.rollout.engine import GenerationEngine
from hyflow.rollout.loading import load_checkpoint
from hyflow.validation.rl import Validation


def evaluate(cfg: Any, model_dir: str, tp: int, pp: int, dp: int) -> Optional[dict]:
    """Validate ``model_dir`` on this rank (collective over ``tp * pp * dp`` ranks); rank 0 gets
    the metrics, the other ranks None."""
    if dist.get_world_size() != tp * pp * dp:
        raise ValueError(f"{dist.get_world_size()} ranks running but --tp {tp} x --pp {pp} x --dp {dp}")
    groups = init_training_groups(Layout(tp=tp, pp=pp, dp=dp), seed=cfg.trainer.seed)
    model, desc = load_checkpoint(model_dir, groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec)
    tokenizer = load_data_tokenizer(cfg.data)
    vocab = min(desc.vocab_size, tokenizer.vocab_size)  # as the RL job's dispatcher
    eos = list(dict.fromkeys((desc.eos_token_ids or []) + list(tokenizer.stop_token_ids())))
    gen_cfg = GenerationConfig.from_settings(cfg.rollout, pad_token_id=tokenizer.pad_token_id or 0)
    if cfg.rollout.multi_turn.enable:  # as in training: a multi-turn context outgrows the prompt limit
        gen_cfg = dataclasses.replace(gen_cfg, max_prompt_length=None)
    engine = GenerationEngine(model, gen_cfg, vocab_size=vocab, eos_token_ids=eos, tp_group=groups.pgs.tp,
                              pp_group=groups.pgs.pp, max_position_embeddings=desc.max_position_embeddings)
    reward_model = None
    if cfg.reward.model_checkpoint:
        reward_model = build_reward_model(cfg, groups, vocab, tokenizer.pad_token_id or 0)
    reward = RewardManager.from_config(cfg.reward, model_fn=reward_model)
    agent = MultiTurnAgent(cfg.rollout.multi_turn, tokenizer) if cfg.rollout.multi_turn.enable else None
    validation = Validation.from_config(cfg, tokenizer, reward, gen_cfg.sampling, agent)

    def generate(records: list, offset: int):
        if agent is not None:  # this replica's trajectories, its leader running the tools (hyflow.agent)
            return agent.rollout(engine, records, validation.n, seed=validation.sampling.seed, request_offset=offset,
                                 sampling=validation.sampling.replace(n=1), max_seq_len=engine.max_seq_len,
                                 device=groups.device, replica_groups=[groups.pgs.tp, groups.pgs.pp],
                                 pad_id=tokenizer.pad_token_id or 0)
        return generate_data_parallel(engine, [r.prompt_ids for r in records], None, validation.sampling,
                                      request_offset=offset, device=groups.device).samples

    metrics = validation.run(generate, groups.dp_rank, dp, groups.pgs.dp, groups.device)
    return metrics if dist.get_rank() == 0 else None
