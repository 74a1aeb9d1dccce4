"""The models of a pooled RL run (``placement.pools``, ``trainer.mode`` sync or one_step_off).

* On the **training pool**: :func:`build_training_models` builds the actor (DDP + optimizer over
  the pool's explicit groups), the reference, the critic and the reward model like the colocated
  job (:func:`hyflow.rl.models.build_rl_models`), but instead of the hybrid engine and its
  dispatcher it holds a :class:`WeightSender` (the actor's shards out to the generation pool) and a
  :class:`RemoteRollouts` (this rank's rows in from it), and a critic on a pool of its own is a
  :class:`~hyflow.placement.remote_critic.RemoteCritic`. They implement the same roles
  (:mod:`hyflow.roles`), so :func:`hyflow.jobs.rl.rl_step` runs unchanged: its phase 1 receives
  rows instead of generating them.
* On the **generation pool**: :class:`GenerationSide`, the actor in the generation layout (its
  slice only, filled by the weight sync) and the generation engine. With ``rollout.multi_turn`` it
  holds the agent too (:class:`~hyflow.agent.agent.MultiTurnAgent`) and runs the multi-turn loop of
  :mod:`hyflow.agent.rollout` on each replica (:meth:`GenerationSide.trajectories`): the replica's
  leader (generation TP rank 0 of stage 0) runs the tools and environments as the colocated
  replicas' leaders do, with the same seeds (keyed by step and global prompt index), and the
  trajectories' rows (ids, loss mask over observations, counters) go to the training ranks that
  own them (:mod:`hyflow.placement.rows`), which score and train on them as the colocated job does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hyflow.agent.agent import MultiTurnAgent
from hyflow.checkpoint.trained_model import TrainedModel
from hyflow.models.builder import build_gpt_model, resolve_spec
from hyflow.models.description import ModelDescription
from hyflow.models.lora import adapters_merged, has_adapters
from hyflow.parallel.layout import pad_vocab_size
from hyflow.placement.groups import optimizer_agreement_on, pool_enumerations
from hyflow.placement.remote_critic import RemoteCritic
from hyflow.placement.rows import ReceivedRows, recv_rows, row_routes
from hyflow.placement.sync_planner import SyncSummary, plan_actor_sync, summarize_actor_sync
from hyflow.placement.weight_sync import SyncStats, WeightSync
from hyflow.rl.batch import MicroBatching, RolloutBatch
from hyflow.rl.dispatch import sampling_seed, shard_range
from hyflow.rl.models import RLModels, build_actor, build_other_roles, model_spec
from hyflow.roles import RolloutCapabilities, WeightPathCapabilities
from hyflow.rollout.config import GenerationConfig, SamplingConfig
from hyflow.rollout.dp import GatheredRollout, SampleTensors, generate_data_parallel
from hyflow.rollout.engine import GenerationEngine
from hyflow.rollout.request import RolloutStats
from hyflow.vllm_backend.engine import VLLMEngine
from hyflow.vllm_backend.weights import vllm_weights


def samples_current_weights(cfg) -> bool:
    """Whether the generation pool samples every batch with the weights the training pool holds when it
    trains on it: ``sync``, and ``async`` with ``max_staleness`` 0."""
    return cfg.trainer.mode == "sync" or (cfg.trainer.mode == "async" and cfg.trainer.max_staleness == 0)


def runs_multi_turn(cfg) -> bool:
    """Whether the generation pool runs multi-turn trajectories for ``cfg``'s backend: hyflow's engine
    (its per-sample ``on_finish`` starts the tool calls while the other samples decode; ``trainer.mode:
    async`` feeds turns to its long-lived scheduler, :mod:`hyflow.jobs.async_trajectories`). Not vLLM
    (its batch call has no per-turn hook, as colocated)."""
    return cfg.rollout.backend == "hyflow"


@dataclass
class _Stats:
    bytes_received: int = 0
    seconds: float = 0.0


class WeightSender:
    """The training pool's :class:`~hyflow.roles.WeightPath`: training never leaves its layout
    (the transitions move nothing here), and :meth:`send` sends the actor's shards to the
    generation pool (the pooled loop calls it after each update)."""

    #: generation runs on the other pool: no generation model here to re-score or swap
    CAPABILITIES = WeightPathCapabilities(generation_model=False, exact_in_generation_layout=False,
                                          stale_weights=False)

    @classmethod
    def capabilities_for(cls, cfg) -> WeightPathCapabilities:
        return cls.CAPABILITIES

    def __init__(self, sync: WeightSync, summary: Optional[SyncSummary] = None,
                 model: Optional[torch.nn.Module] = None) -> None:
        self.sync, self.summary = sync, summary  # the whole sync's numbers (sync.plan is this rank's part)
        # A LoRA actor sends W + s B A, merged in the training layout for the send and unmerged exactly
        # after it: full-weight sync (the generation pool holds a plain model; adapter-only sync to a
        # pool is not built yet)
        self.model = model if model is not None and has_adapters(model) else None
        self.capabilities = self.CAPABILITIES
        self.stats = _Stats()  # the colocated metrics' reshard/* read it (nothing received here)
        self.last: SyncStats = SyncStats()

    def to_generation(self) -> None:
        """Nothing: the generation pool holds the weights of the last :meth:`send`."""

    def to_training(self) -> None:
        """Nothing: the actor never left its training layout."""

    def generation_weights(self) -> Optional[torch.Tensor]:
        return None

    def describe(self) -> str:
        return self.summary.summary() if self.summary is not None else self.sync.plan.summary()

    def send(self) -> SyncStats:
        if self.model is None:
            self.last = self.sync.run()
        else:
            with adapters_merged(self.model):
                self.last = self.sync.run()
        self.stats.seconds = self.last.seconds
        return self.last


@dataclass
class RemoteRollouts:
    """The training pool's :class:`~hyflow.roles.Rollouts`: ``generate`` receives this rank's rows
    of the step from the generation pool instead of generating them. ``current_weights``: the
    generation pool sampled them with the weights this pool holds (``trainer.mode=sync``; one
    update behind in ``one_step_off``)."""

    groups: object
    rollout_config: object
    placement: object
    group: object = None
    current_weights: bool = True
    multi_turn: bool = False
    filters_groups: bool = False  # trainer.mode=async: the generation pool filters groups (DAPO dynamic sampling)
    last: ReceivedRows | None = field(default=None)
    prefetched: ReceivedRows | None = field(default=None)

    @classmethod
    def capabilities_for(cls, cfg) -> RolloutCapabilities:
        return RolloutCapabilities(greedy=False, exact_rescore=False, current_weights=samples_current_weights(cfg),
                                   multi_turn=runs_multi_turn(cfg), dynamic_sampling=cfg.trainer.mode == "async")

    @property
    def capabilities(self) -> RolloutCapabilities:
        return RolloutCapabilities(greedy=False, exact_rescore=False, current_weights=self.current_weights,
                                   multi_turn=self.multi_turn, dynamic_sampling=self.filters_groups)

    def shard(self, count: int) -> tuple[int, int]:
        return shard_range(count, self.groups.layout.dp, self.groups.dp_rank)

    def prepare_for_generation(self) -> None:
        """Nothing: the generation pool generated these rows already."""

    def finish_generation(self) -> None:
        """Nothing held here."""

    def receive(self, total: int) -> ReceivedRows:
        """This rank's rows of a step of ``total`` prompts, received now (``trainer.mode: async``, whose
        rows say which prompts they answer: :meth:`generate` then returns these)."""
        routes = row_routes(total, self.placement.roles["rollout"], self.placement.roles["actor"])
        self.prefetched = recv_rows(routes, dist.get_rank(), self.groups.device, self.group)
        return self.prefetched

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, seed: int, request_offset: int,
                 greedy: bool = False, max_new_tokens: Optional[int] = None,
                 sampling: Optional[SamplingConfig] = None) -> GatheredRollout:
        if greedy:  # the preflight refuses it (capabilities.greedy)
            raise RuntimeError("the generation pool does not generate greedy baselines (remax)")
        got = self._take(len(prompts), n, request_offset, sampling)
        return GatheredRollout(samples=got.samples, stats=RolloutStats(samples=len(got.samples)))

    def generate_trajectories(self, agent, records: Sequence, n: int, *, seed: int, request_offset: int,
                              sampling: Optional[SamplingConfig] = None) -> SampleTensors:
        """This rank's multi-turn trajectories of the step (the generation pool ran the agent's loop,
        :meth:`GenerationSide.trajectories`), with their loss masks and counters."""
        if not self.multi_turn:  # the preflight refuses it (capabilities.multi_turn)
            raise RuntimeError("the generation pool runs no multi-turn trajectories in this trainer.mode")
        got = self._take(len(records), n, request_offset, sampling)
        if got.samples.mask is None or got.samples.stats is None:
            raise RuntimeError(f"rank {dist.get_rank()}: the generation pool sent single responses, not multi-turn "
                               "trajectories (both pools read the same rollout.multi_turn)")
        return got.samples

    def _take(self, prompts: int, n: int, request_offset: int, sampling: Optional[SamplingConfig]) -> ReceivedRows:
        """The rows of this rank's ``prompts`` prompts (global indices from ``request_offset``), received now
        unless :meth:`receive` got them already; checked to be exactly those."""
        if sampling is not None:  # the preflight refuses data.val_files with pools
            raise RuntimeError("the generation pool samples with the rollout's settings only (no validation)")
        if self.prefetched is None:
            self.receive(prompts * self.groups.layout.dp)
        got, self.prefetched = self.prefetched, None
        request = got.samples.column("request")
        if len(got.samples) != prompts * n or (len(request) and (
                int(request.min()) != request_offset or int(request.max()) != request_offset + prompts - 1)):
            raise RuntimeError(f"rank {dist.get_rank()}: received {len(got.samples)} rows for prompts "
                               f"{request.min().item() if len(request) else '-'}..; expected {prompts * n} rows of "
                               f"prompts {request_offset}..{request_offset + prompts - 1}")
        self.last = got
        return got

    def rescore(self, batch: RolloutBatch, batching: MicroBatching, *, temperature: float, fused: bool,
                train_mode: bool) -> torch.Tensor:
        raise RuntimeError("the training pool holds no generation model: re-score in the training layout "
                           "(capabilities.exact_rescore is False)")


def build_training_models(cfg, tokenizer, placement, groups, sync_group, row_group=None, pool_group=None) -> RLModels:
    """The training pool's :class:`~hyflow.rl.models.RLModels` (see the module docstring)."""
    desc = ModelDescription.load(cfg.actor.checkpoint) if cfg.actor.checkpoint else cfg.model
    actor, chunks, optimizer, scheduler = build_actor(cfg, desc, groups, optimizer_scope=optimizer_agreement_on(pool_group))
    fused = resolve_spec(model_spec(cfg)) == "te"
    plan = plan_actor_sync(placement, desc, actor.config.params_dtype.itemsize, fused_norms=fused, rank=dist.get_rank())
    sender = WeightSender(WeightSync(plan, actor, sync_group),
                          summarize_actor_sync(placement, desc, actor.config.params_dtype.itemsize, fused_norms=fused),
                          model=actor)
    rollouts = RemoteRollouts(groups, GenerationConfig.from_settings(cfg.rollout, pad_token_id=tokenizer.pad_token_id or 0),
                              placement, row_group, current_weights=samples_current_weights(cfg),
                              multi_turn=runs_multi_turn(cfg) and cfg.rollout.multi_turn.enable,
                              filters_groups=cfg.trainer.mode == "async")
    models = RLModels(desc=desc, groups=groups, actor=TrainedModel(chunks, optimizer, scheduler), weights=sender,
                      rollouts=rollouts, sample_vocab=min(desc.vocab_size, tokenizer.vocab_size))
    here = tuple(r for r in ("reference", "critic", "reward") if r not in placement.roles
                 or placement.same_pool("actor", r))
    build_other_roles(cfg, models, actor, tokenizer, optimizer_scope=optimizer_agreement_on(pool_group), roles=here)
    if "critic" not in here:  # on a pool of its own (hyflow.placement.remote_critic serves it there)
        models.critic = RemoteCritic(cfg, placement, groups)
    return models


class GenerationSide:
    """The generation pool's half: the actor in the generation layout (filled by the weight sync),
    the generation engine of this rank's replica, and with ``rollout.multi_turn`` the agent."""

    def __init__(self, cfg, tokenizer, placement, groups, sync_group) -> None:
        desc = ModelDescription.load(cfg.actor.checkpoint) if cfg.actor.checkpoint else cfg.model
        self.placement, self.groups, self.desc = placement, groups, desc
        actor = placement.roles["actor"]
        self.model = build_gpt_model(desc, groups, dtype=cfg.actor.dtype, spec=model_spec(cfg),
                                     config_overrides={"perform_initialization": False},
                                     padded_vocab_size=pad_vocab_size(desc.vocab_size, actor.layout.tp))
        self.model.requires_grad_(False)
        self.model.eval()
        plan = plan_actor_sync(placement, desc, self.model.config.params_dtype.itemsize,
                               fused_norms=resolve_spec(model_spec(cfg)) == "te", rank=dist.get_rank())
        self.sync = WeightSync(plan, self.model, sync_group)
        self.rollout_config = GenerationConfig.from_settings(cfg.rollout, pad_token_id=tokenizer.pad_token_id or 0)
        self.agent = None
        if cfg.rollout.multi_turn.enable:  # as colocated: the context outgrows the prompt limit, its budget bounds it
            # (prompt + trajectory budget: the async stream's cache rows are that long, as `hyflow plan` sizes them)
            self.rollout_config = replace(self.rollout_config, max_prompt_length=None,
                                          max_seq_len=cfg.rollout.max_prompt_length + cfg.rollout.max_response_length)
            self.agent = MultiTurnAgent(cfg.rollout.multi_turn, tokenizer)
        self.trainer_seed = cfg.trainer.seed
        eos = list(dict.fromkeys((desc.eos_token_ids or []) + list(tokenizer.stop_token_ids())))
        vocab = min(desc.vocab_size, tokenizer.vocab_size)
        if cfg.rollout.backend == "vllm":  # vLLM on this pool, fed the synced generation-layout weights in memory
            budget = cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens
            self.engine = VLLMEngine(desc, self.rollout_config, cfg.rollout.vllm, vocab_size=vocab,
                                     eos_token_ids=eos, tp_groups=pool_enumerations(placement)["tp"],
                                     dtype=cfg.actor.dtype, seed=cfg.trainer.seed,
                                     device=groups.device, seq_budget=budget)
            # the synced generation-layout weights go on into vLLM's own model
            self._after_sync = lambda: self.engine.load_weights(
                vllm_weights(self.model, self.desc, self.engine.vocab_size, self.groups.pgs.tp))
        else:
            self.engine = GenerationEngine(self.model, self.rollout_config, vocab_size=vocab, eos_token_ids=eos,
                                           tp_group=groups.pgs.tp, pp_group=groups.pgs.pp,
                                           max_position_embeddings=desc.max_position_embeddings)
            self._after_sync = lambda: None  # it generates from self.model, which the sync wrote in place

    def receive_weights(self) -> SyncStats:
        """The training pool's newest weights into this pool's generation model (the weight sync,
        collective with the training pool), and from it into vLLM's model when it generates."""
        stats = self.sync.run()
        self._after_sync()
        return stats

    @property
    def replica(self) -> int:
        return self.groups.dp_rank

    def share(self, count: int) -> tuple[int, int]:
        """This replica's prompts ``[first, stop)`` of a batch of ``count``."""
        return shard_range(count, self.groups.layout.dp, self.replica)

    def sequences(self, prompt_ids, step: int, index: int, n: int) -> list:
        """The ``n`` scheduler sequences of prompt ``index`` of ``step``'s batch, seeded as
        :meth:`generate` seeds it, keyed ``(step, index)`` (``trainer.mode: async`` streams prompts of
        several steps through one scheduler)."""
        sampling = self.rollout_config.sampling.replace(n=n, seed=sampling_seed(self.trainer_seed, step))
        seqs, _ = self.engine.prepare([list(prompt_ids)], sampling, request_offset=index)
        for s in seqs:
            s.key = (step, index)
        return seqs

    def generate(self, records, step: int, n: int, **partial):
        """This replica's samples of ``records`` (the step's prompts) with the seeds the colocated
        job uses for ``step`` (keyed by the global prompt index), sorted. ``partial``: the engine's
        weight updates at token boundaries (``trainer.mode: async``, :mod:`hyflow.jobs.fully_async`)."""
        first, stop = shard_range(len(records), self.groups.layout.dp, self.replica)
        seed = sampling_seed(self.trainer_seed, step)
        sampling = self.rollout_config.sampling.replace(n=n, seed=seed)
        return generate_data_parallel(self.engine, [list(r.prompt_ids) for r in records[first:stop]], None,
                                      sampling, request_offset=first, device=self.groups.device, **partial)

    def trajectories(self, records, step: int, n: int) -> SampleTensors:
        """This replica's ``n`` multi-turn trajectories of each of its share of ``records`` (the step's
        prompts), seeded as the colocated job seeds ``step`` (keyed by global prompt index), sorted:
        the agent's loop on this replica's engine, its leader running the tools and environments
        and sharing their answers over the replica's TP and PP groups."""
        first, stop = shard_range(len(records), self.groups.layout.dp, self.replica)
        seed = sampling_seed(self.trainer_seed, step)
        return self.agent.rollout(self.engine, records[first:stop], n, seed=seed, request_offset=first,
                                  sampling=self.rollout_config.sampling.replace(n=1, seed=seed),
                                  max_seq_len=getattr(self.engine, "max_seq_len", None) or self.desc.context_length,
                                  device=self.groups.device, replica_groups=[self.groups.pgs.tp, self.groups.pgs.pp],
                                  pad_id=self.rollout_config.pad_token_id)
