"""The models of an RL run and how they are built: the actor (with its optimizer, its weight path
to generation and the rollouts that generate with it), the frozen reference, the critic and the
reward model. Every model is built for the rank's device (``ParallelGroups.device``) in the actor's
training layout. The roles the step calls are typed with their declared interfaces
(:mod:`hyflow.roles`); this module builds the colocated ones, :mod:`hyflow.placement.pool_models`
the pooled ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hyflow.checkpoint.model import adapter_base
from hyflow.checkpoint.starting_weights import check_starting_weights, load_starting_weights, \
    starting_description
from hyflow.checkpoint.trained_model import TrainedModel
from hyflow.hybrid.executor import HybridEngine
from hyflow.models.builder import build_gpt_model
from hyflow.models.description import ModelDescription
from hyflow.models.lora import BaseModelView, apply_lora, lora_spec
from hyflow.models.weights import load_full_state_dict, random_full_state_dict
from hyflow.parallel.groups import ParallelGroups, init_training_groups
from hyflow.rl.critic import LocalCritic
from hyflow.rl.dispatch import RolloutDispatcher
from hyflow.rl.reward_model import RewardModel, build_reward_model, check_reward_model_checkpoint
from hyflow.rl.vllm_rollouts import VLLMRollouts
from hyflow.roles import Critic, Rollouts, WeightPath
from hyflow.rollout.config import GenerationConfig
from hyflow.training.optimizer import build_optimizer, wrap_ddp


@dataclass
class RLModels:
    """Built models, optimizers and roles of one rank (the roles: :mod:`hyflow.roles`)."""

    desc: ModelDescription
    groups: ParallelGroups
    actor: TrainedModel
    weights: WeightPath  # the actor's weights to generation and back
    rollouts: Rollouts  # generates (or receives) this rank's samples
    sample_vocab: int  # ids the tokenizer can decode; the generator never samples beyond
    reference: Optional[torch.nn.Module] = None
    critic: Optional[Critic] = None
    reward_model: Optional[RewardModel] = None  # when reward.model_checkpoint is set

    def trained(self) -> dict[str, TrainedModel]:
        """The models every checkpoint holds, with their optimizers and LR schedulers (a critic
        on a pool of its own holds its model there: ``critic.model`` is None here)."""
        critic = self.critic.model if self.critic is not None else None
        return {"actor": self.actor} | ({"critic": critic} if critic is not None else {})

    @torch.no_grad()
    def reset_reference(self) -> None:
        """Make the reference a copy of the current actor (after an SFT warm-up)."""
        if self.reference is not None:
            _copy_matching(self.actor.module, self.reference)


def check_actor_checkpoint(path: str) -> None:
    """A missing or incomplete ``actor.checkpoint`` (a hyflow checkpoint, an HF directory or a
    ``.gguf`` file) fails with one error naming it. Reads files only (no process group needed)."""
    check_starting_weights(path, "actor.checkpoint")


@torch.no_grad()
def _copy_matching(src: torch.nn.Module, dst: torch.nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy ``src``'s local shards into ``dst``'s parameters of the same name and shape (both in
    the same layout: no communication). Returns the names of ``dst`` left untouched."""
    source = dict(getattr(src, "module", src).named_parameters())
    untouched = []
    for name, param in getattr(dst, "module", dst).named_parameters():
        other = source.get(name)
        if name in skip or other is None or other.shape != param.shape:
            untouched.append(name)
        else:
            param.copy_(other)
    return untouched


@torch.no_grad()
def _init_value_head(model: torch.nn.Module, std: float, seed: int) -> None:
    """The scalar head drawn from its own seeded stream: the same initial critic in every layout
    (the head is replicated over TP ranks and lives on the last stage)."""
    head = getattr(getattr(model, "output_layer", None), "weight", None)
    if head is not None:
        gen = torch.Generator().manual_seed(seed)
        head.copy_(torch.randn(head.shape, generator=gen, device=torch.device("cpu")) * std)


def _initial_state(cfg, desc: ModelDescription, model, groups: ParallelGroups, checkpoint: Optional[str],
                   write_cache: bool = True):
    if checkpoint:  # a hyflow checkpoint, or an HF model read directly (actor.checkpoint_cache: converted once)
        load_starting_weights(model, checkpoint, groups, desc, cfg.actor.checkpoint_cache, write_cache)
    else:
        load_full_state_dict(model, random_full_state_dict(desc, cfg.trainer.seed), desc, groups)


def build_rl_models(cfg, tokenizer) -> RLModels:
    """Groups, actor (+ optimizer, hybrid engine as the weight path, dispatcher as the rollouts), reference,
    critic and reward model."""
    if cfg.reward.model_checkpoint:  # a bad path fails here, before any model is built
        check_reward_model_checkpoint(cfg.reward.model_checkpoint)
    layout = cfg.actor_layout(dist.get_world_size())
    groups = init_training_groups(layout, seed=cfg.trainer.seed)
    desc = starting_description(cfg.actor.checkpoint) if cfg.actor.checkpoint else cfg.model
    if desc.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"the model's vocabulary ({desc.vocab_size}) is smaller than the tokenizer's "
                         f"({tokenizer.vocab_size}); use a model/tokenizer pair that match")
    actor, chunks, optimizer, scheduler = build_actor(cfg, desc, groups)
    hybrid = HybridEngine(chunks[0], desc, groups, (cfg.rollout.layout.tp, cfg.rollout.layout.pp),
                          dtype=cfg.actor.dtype, spec=model_spec(cfg), optimizer=optimizer,
                          offload_grad_buffers=cfg.rollout.offload_grad_buffers,
                          offload_optimizer=cfg.rollout.offload_optimizer,
                          # a forced-stale sampler swaps older weights into a buffer of its own
                          in_place=not cfg.rollout.force_staleness)
    sample_vocab = min(desc.vocab_size, tokenizer.vocab_size)
    eos = list(dict.fromkeys((desc.eos_token_ids or []) + list(tokenizer.stop_token_ids())))
    generation = GenerationConfig.from_settings(cfg.rollout, pad_token_id=tokenizer.pad_token_id or 0)
    if cfg.rollout.multi_turn.enable:  # a multi-turn context outgrows the prompt limit; its budget bounds it
        generation = dataclasses.replace(generation, max_prompt_length=None)
    if cfg.rollout.backend == "vllm":  # vLLM in these ranks, fed the hybrid engine's generation shards
        dispatcher = VLLMRollouts.from_config(cfg, hybrid, groups, generation, desc, sample_vocab, eos)
    else:
        dispatcher = RolloutDispatcher(hybrid, groups, generation, desc, sample_vocab, eos,
                                       current_weights=not cfg.rollout.force_staleness)
    models = RLModels(desc=desc, groups=groups, actor=TrainedModel(chunks, optimizer, scheduler), weights=hybrid,
                      rollouts=dispatcher, sample_vocab=sample_vocab)
    build_other_roles(cfg, models, actor, tokenizer)
    return models


#: Weights come from a checkpoint or the layout-independent random draw: no Megatron init.
FROZEN_INIT = {"perform_initialization": False}


def build_actor(cfg, desc: ModelDescription, groups: ParallelGroups, optimizer_scope=None):
    """The actor in its training layout with its initial weights, DDP-wrapped: (module, chunks,
    optimizer, scheduler). ``optimizer_scope``: see :func:`build_other_roles`."""
    actor = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=model_spec(cfg),
                            config_overrides=dict(FROZEN_INIT, **_recompute(cfg.actor.recompute)))
    _initial_state(cfg, desc, actor, groups, cfg.actor.checkpoint)
    if cfg.actor.lora is not None:  # the base is frozen: DDP and the optimizer see the adapters only
        apply_lora(actor, cfg.actor.lora, seed=cfg.trainer.seed, base=adapter_base(cfg.actor.checkpoint, cfg.trainer.seed))
    chunks = wrap_ddp([actor], groups, cfg.actor.optim.distributed_optimizer)
    total_updates = cfg.trainer.total_steps * cfg.actor.ppo_epochs * max(
        1, cfg.data.train_batch_size * cfg.rollout.n // cfg.actor.mini_batch_size) + cfg.actor.sft_warmup_steps
    with optimizer_scope if optimizer_scope is not None else contextlib.nullcontext():
        optimizer, scheduler = build_optimizer(chunks, cfg.actor.optim, total_updates, actor.config.params_dtype,
                                               groups=groups)
    return actor, chunks, optimizer, scheduler


def build_other_roles(cfg, models: RLModels, actor, tokenizer, optimizer_scope=None,
                      roles: tuple[str, ...] = ("reference", "critic", "reward")) -> None:
    """The reference, the critic and the reward model in the actor's training layout (``models.groups``),
    attached to ``models``. ``actor``: the unwrapped actor (the critic copies its initial trunk);
    ``optimizer_scope``: a context the critic's optimizer is built in (a placement pool's default
    group); ``roles``: the ones built here (placement pools run the others elsewhere)."""
    frozen = FROZEN_INIT
    groups, desc = models.groups, models.desc
    if cfg.reference.enable and "reference" in roles and cfg.actor.lora is not None and actor is not None:
        models.reference = BaseModelView(actor)  # the base with the adapters off: no second copy
    elif cfg.reference.enable and "reference" in roles:  # also measures the reported KL when no KL term is optimised
        reference = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=model_spec(cfg), config_overrides=frozen)
        reference.requires_grad_(False)
        reference.eval()
        models.reference = reference
        models.reset_reference()
    if cfg.critic.enable and "critic" in roles:
        models.critic = LocalCritic(build_critic(cfg, desc, groups, actor, optimizer_scope), cfg, groups,
                                    tokenizer.pad_token_id or 0)
    if cfg.reward.model_checkpoint and "reward" in roles:  # frozen, eval, in the actor's training layout
        models.reward_model = build_reward_model(cfg, groups, models.sample_vocab, tokenizer.pad_token_id or 0)


def build_critic(cfg, desc: ModelDescription, groups: ParallelGroups, trunk: Optional[torch.nn.Module],
                 optimizer_scope=None) -> TrainedModel:
    """The critic in ``groups``' layout, DDP-wrapped with its optimizer. It starts from the actor's
    initial trunk with a fresh seeded head: ``trunk`` is the actor in the same layout (a local copy),
    or None on a pool without the actor, which loads the actor's initial weights into a temporary
    actor-shaped model first (freed before the optimizer exists: the peak stays below the critic's
    steady state with its optimizer)."""
    frozen = FROZEN_INIT
    if trunk is None:
        trunk = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=model_spec(cfg), config_overrides=frozen)
        _initial_state(cfg, desc, trunk, groups, cfg.actor.checkpoint, write_cache=False)
    critic = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=model_spec(cfg), value_head=True,
                             config_overrides=dict(frozen, **_recompute(cfg.actor.recompute)))
    untouched = _copy_matching(trunk, critic, skip=("output_layer.weight",))
    assert set(untouched) <= {"output_layer.weight"}, untouched
    del trunk
    _init_value_head(critic, desc.init_method_std, cfg.trainer.seed + 17)
    if cfg.critic.lora is not None:  # adapters on the frozen trunk; the value head trains whole
        apply_lora(critic, cfg.critic.lora, seed=cfg.trainer.seed + 17, trainable=("output_layer.weight",),
                   base=adapter_base(cfg.actor.checkpoint, cfg.trainer.seed))
    critic_chunks = wrap_ddp([critic], groups, cfg.critic.optim.distributed_optimizer)
    with optimizer_scope if optimizer_scope is not None else contextlib.nullcontext():
        critic_optimizer, critic_scheduler = build_optimizer(
            critic_chunks, cfg.critic.optim, _critic_updates(cfg), critic.config.params_dtype, groups=groups)
    return TrainedModel(critic_chunks, critic_optimizer, critic_scheduler)


def model_spec(cfg) -> str:
    """The layer spec of every model of the run (one for all: the critic copies the actor's trunk by
    parameter name), LoRA-safe when the actor or the critic has adapters."""
    return lora_spec(cfg.actor.spec, cfg.actor.lora, cfg.critic.lora)


def _critic_updates(cfg) -> int:
    mini = cfg.critic.mini_batch_size or cfg.actor.mini_batch_size
    epochs = cfg.critic.ppo_epochs or cfg.actor.ppo_epochs
    return cfg.trainer.total_steps * epochs * max(1, cfg.data.train_batch_size * cfg.rollout.n // mini)


def _recompute(kind: str) -> dict:
    if kind == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if kind == "selective":
        return {"recompute_granularity": "selective"}
    return {}
