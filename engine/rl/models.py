"""The models of an RL run and how they are built: actor (+ hybrid engine and generation
engine), reference, critic, reward model. Everything a step needs, in one object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from hyflow.hybrid.executor import HybridEngine
from hyflow.models.builder import build_gpt_model
from hyflow.models.description import ModelDescription
from hyflow.models.weights import gather_full_state_dict, load_full_state_dict, random_full_state_dict
from hyflow.parallel.groups import ParallelGroups, init_training_groups
from hyflow.training.optimizer import build_optimizer, wrap_ddp


@dataclass
class Roles:
    """Built models, optimizers and engines of one rank."""

    desc: ModelDescription
    groups: ParallelGroups
    actor_chunks: list
    actor_optimizer: Any
    actor_scheduler: Any
    hybrid: HybridEngine
    rollout_config: Any
    eos_token_ids: list[int]
    sample_vocab: int  # ids the tokenizer can decode; the generator never samples beyond
    reference: Optional[torch.nn.Module] = None
    critic_chunks: Optional[list] = None
    critic_optimizer: Any = None
    critic_scheduler: Any = None
    reward_model: Any = None  # hyflow.rl.reward_model.RewardModel when reward.model_checkpoint is set
    step_counter: int = 0
    _engine: Any = field(default=None, repr=False)

    def generate(self, gen_model, prompts: list[list[int]], n: int, greedy: bool = False):
        """Generate ``n`` samples per prompt on the micro-DP replicas (each TP_g x PP_g ranks of
        the generation layout; with PP_g > 1 the stages run one after another); every rank gets all
        samples in request order. ``greedy``: argmax decoding (temperature 0), the same
        ``max_new_tokens`` and stop ids (ReMax's baseline responses)."""
        from hyflow.rollout.engine import GenerationEngine
        from hyflow.rollout.request import RolloutResult, RolloutStats

        if self._engine is None:
            self._engine = GenerationEngine(gen_model, self.rollout_config, vocab_size=self.sample_vocab,
                                            eos_token_ids=self.eos_token_ids,
                                            tp_group=self.hybrid.gen_groups.pgs.tp,
                                            pp_group=self.hybrid.gen_groups.pgs.pp,
                                            max_position_embeddings=self.desc.max_position_embeddings)
        plan = self.hybrid.plan
        replicas, replica = plan.gen_dp_size, self.hybrid.gen_groups.dp_rank
        per = -(-len(prompts) // replicas)
        mine = prompts[replica * per:(replica + 1) * per]
        # A fresh random stream per step (step_counter is checkpointed, so resume stays exact).
        sampling = self.rollout_config.sampling.replace(n=n, seed=self.rollout_config.sampling.seed
                                                        + 1_000_003 * self.step_counter)
        if greedy:
            sampling = sampling.replace(temperature=0.0)
        result = self._engine.generate(mine, sampling, request_offset=replica * per) if mine else None
        # Every rank of a replica (all TP ranks, all pipeline stages) holds its full results:
        # one representative each (TP rank 0 of the first stage) contributes them.
        gen = self.hybrid.gen_groups
        payload = (replica, result.samples if result else [], result.stats if result else RolloutStats()) \
            if gen.tp_rank == 0 and gen.pp_rank == 0 else None
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, payload)
        samples, stats = [], RolloutStats()
        for item in sorted((g for g in gathered if g is not None), key=lambda g: g[0]):
            samples.extend(item[1])
            stats = stats.merge(item[2])
        for s in samples:  # request_offset made indices global
            assert 0 <= s.request_index < len(prompts)
        return RolloutResult(samples=samples, stats=stats)

    @torch.no_grad()
    def reset_reference(self) -> None:
        """Make the reference a copy of the current actor (after an SFT warm-up)."""
        if self.reference is None:
            return
        actor = dict(getattr(self.actor_chunks[0], "module", self.actor_chunks[0]).named_parameters())
        for name, param in self.reference.named_parameters():
            param.copy_(actor[name])


def check_actor_checkpoint(path: str) -> None:
    """A missing or incomplete ``actor.checkpoint`` fails with one error naming the command that
    creates it. Reads files only (no process group needed)."""
    from hyflow.checkpoint.model import CheckpointError, read_checkpoint_info

    try:
        read_checkpoint_info(path)
    except CheckpointError as e:
        raise CheckpointError(
            f"actor.checkpoint={path!r}: {e}. Convert the model into it first: `hyflow convert hf2mcore "
            f"--hf <HF model dir or .gguf file> --out {path}` (for configs/smollm2_arith.yaml, "
            "`make smollm2` writes checkpoints/smollm2-135m)") from None


def _initial_state(cfg, desc: ModelDescription, model, groups: ParallelGroups, checkpoint: Optional[str]):
    if checkpoint:
        from hyflow.checkpoint.model import load_model_checkpoint

        load_model_checkpoint(model, checkpoint, groups)
    else:
        load_full_state_dict(model, random_full_state_dict(desc, cfg.trainer.seed), desc, groups)


def build_roles(cfg, tokenizer) -> Roles:
    """Groups, actor (+ optimizer, hybrid engine), reference, critic and reward model for ``cfg``."""
    from hyflow.rollout.config import RolloutConfig

    if cfg.reward.model_checkpoint:  # a bad path fails here, before any model is built
        from hyflow.rl.reward_model import check_reward_model_checkpoint

        check_reward_model_checkpoint(cfg.reward.model_checkpoint)
    world = dist.get_world_size()
    layout = cfg.actor_layout(world)
    groups = init_training_groups(layout, seed=cfg.trainer.seed)
    desc = cfg.model
    if cfg.actor.checkpoint:
        desc = ModelDescription.load(cfg.actor.checkpoint)
    actor = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec,
                            config_overrides=_recompute(cfg.actor.recompute))
    _initial_state(cfg, desc, actor, groups, cfg.actor.checkpoint)
    chunks = wrap_ddp([actor], groups, cfg.actor.optim.distributed_optimizer)
    total_updates = cfg.trainer.total_steps * cfg.actor.ppo_epochs * max(
        1, cfg.data.train_batch_size * cfg.rollout.n // cfg.actor.mini_batch_size) + cfg.actor.sft_warmup_steps
    optimizer, scheduler = build_optimizer(chunks, cfg.actor.optim, total_updates, actor.config.params_dtype)
    hybrid = HybridEngine(chunks[0], desc, groups, (cfg.rollout.layout.tp, cfg.rollout.layout.pp),
                          dtype=cfg.actor.dtype, spec=cfg.actor.spec, optimizer=optimizer,
                          offload_grad_buffers=cfg.rollout.offload_grad_buffers,
                          offload_optimizer=cfg.rollout.offload_optimizer)
    eos = list(dict.fromkeys((desc.eos_token_ids or []) + list(tokenizer.stop_token_ids())))
    rollout_config = RolloutConfig.from_job(cfg.rollout, pad_token_id=tokenizer.pad_token_id or 0)
    if desc.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"the model's vocabulary ({desc.vocab_size}) is smaller than the tokenizer's "
                         f"({tokenizer.vocab_size}); use a model/tokenizer pair that match")
    roles = Roles(desc=desc, groups=groups, actor_chunks=chunks, actor_optimizer=optimizer,
                  actor_scheduler=scheduler, hybrid=hybrid, rollout_config=rollout_config, eos_token_ids=eos,
                  sample_vocab=min(desc.vocab_size, tokenizer.vocab_size))
    if cfg.reference.enable:  # also measures the reported KL when no KL term is optimised
        reference = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec,
                                    config_overrides={"perform_initialization": False})
        reference.requires_grad_(False)
        reference.eval()
        roles.reference = reference
        roles.reset_reference()
    if cfg.critic.enable:
        critic = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=cfg.actor.spec, value_head=True)
        # The critic starts from the actor's initial trunk with a fresh scalar head.
        trunk = gather_full_state_dict(actor, desc, groups)
        trunk.pop("output_layer.weight", None)
        load_full_state_dict(critic, trunk, desc, groups, skip_missing=("output_layer.weight",))
        critic_chunks = wrap_ddp([critic], groups, cfg.critic.optim.distributed_optimizer)
        roles.critic_chunks = critic_chunks
        roles.critic_optimizer, roles.critic_scheduler = build_optimizer(
            critic_chunks, cfg.critic.optim, total_updates, critic.config.params_dtype)
    if cfg.reward.model_checkpoint:  # frozen, eval, in the actor's training layout (like the reference)
        from hyflow.rl.reward_model import build_reward_model

        roles.reward_model = build_reward_model(cfg, groups, roles.sample_vocab, tokenizer.pad_token_id or 0)
    return roles


def _recompute(kind: str) -> dict:
    if kind == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if kind == "selective":
        return {"recompute_granularity": "selective"}
    return {}
