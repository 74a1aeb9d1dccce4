"""Assemble a plan: roles and layouts, generation layout and reshard, memory per phase.

:func:`build_plan` reads a job config (``job: lm`` or ``job: rl``) for a world size and
returns a :class:`PlanResult`; nothing here needs a GPU. Errors (a layout that does not
divide, a phase that does not fit in GPU memory) are collected as messages that say what
to change; :mod:`hyflow.plan.report` prints them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

from hyflow.config import ConfigError
from hyflow.hybrid.expert_exchange import plan_expert_exchange, same_expert_grid
from hyflow.hybrid.generation_groups import generation_enumerations
from hyflow.hybrid.param_specs import ReshardPlanError, model_param_specs
from hyflow.hybrid.reshard_plan import PP_STAGING_SLOT, ReshardPlan, plan_reshard, staging_bytes_per_rank
from hyflow.jobs.registry import load_job_config
from hyflow.models.description import ModelDescription
from hyflow.parallel.layout import Layout
from hyflow.plan import lora as plan_lora
from hyflow.plan import memory_estimate as mem
from hyflow.plan.experts import rl_step_alltoall
from hyflow.plan.group_check import RankCheck, check_partition, layout_enumerations, summarize, verify_rank
from hyflow.plan.pools import plan_pools
from hyflow.plan.role_plan import RolePlan
from hyflow.plan.stages import compute_plan
from hyflow.plan.throughput import project_plan
from hyflow.rollout.config import GenerationConfig

GIB = 1 << 30


@dataclass
class PlanOptions:
    """How to plan.

    Attributes:
        world_size: ranks (default: ``trainer.nproc`` of the config).
        gpu_memory_gib: memory of one GPU (default: ``cluster.gpu_memory_gib`` of an ``rl``
            config, else 80 = H100-80GB).
        device: ``gpu`` (the default attention kernels are TE's / flash) or ``cpu`` (Megatron's
            local spec, as the CPU runs use it; no reserve).
        reserve_gib: per-GPU memory kept for the CUDA context, NCCL and library workspaces
            (default 2.5 on GPU, 0 on CPU).
        fragmentation: fraction of the estimate added for allocator fragmentation
            (default 0.05 on GPU, 0 on CPU).
        megatron_ranks: ranks whose groups are really created in a fake world and checked
            (default: first and last rank; ``"all"`` for every rank; empty to skip, which
            avoids importing Megatron).
    """

    world_size: Optional[int] = None
    gpu_memory_gib: Optional[float] = None
    device: Literal["gpu", "cpu"] = "gpu"
    reserve_gib: Optional[float] = None
    fragmentation: Optional[float] = None
    megatron_ranks: Optional[Union[Sequence[int], str]] = None


@dataclass
class PlanResult:
    """Everything ``hyflow plan`` reports."""

    config: str
    job: str = "?"
    world_size: int = 0
    roles: list[RolePlan] = field(default_factory=list)
    reshard: Optional[ReshardPlan] = None
    generation: Optional[dict[str, Any]] = None
    phases: list[mem.MemoryEstimate] = field(default_factory=list)
    gpu_memory_bytes: int = 0
    reserve_bytes: int = 0
    fragmentation: float = 0.0
    checks: list[RankCheck] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the config buys (e.g. LoRA's memory saved)
    timings: dict[str, float] = field(default_factory=dict)
    distributed_optimizer: bool = False
    compute: dict[str, Any] = field(default_factory=dict)  #: :func:`hyflow.plan.stages.compute_plan`
    pools: list[dict] = field(default_factory=list)  # placement pools: name, ranks, roles, worst phase
    placement: str = ""
    weight_sync: Any = None  # hyflow.placement.sync_planner.SyncSummary (placement pools)
    throughput: Optional[dict] = None  # hyflow.plan.throughput.project
    experts: Optional[dict[str, Any]] = None  # a mixture-of-experts actor: expert grid, all-to-all, exchange

    @property
    def peak(self) -> Optional[mem.MemoryEstimate]:
        return mem.worst(self.phases) if self.phases else None

    @property
    def required_bytes(self) -> int:
        """Peak estimate plus fragmentation and reserve: what must fit in one GPU."""
        peak = self.peak
        return int(peak.total * (1 + self.fragmentation)) + self.reserve_bytes if peak else 0

    @property
    def fits(self) -> bool:
        return bool(self.phases) and self.required_bytes <= self.gpu_memory_bytes


def _load_model(checkpoint: Optional[str], fallback: ModelDescription, what: str,
                notes: list[str]) -> ModelDescription:
    """The description next to a converted checkpoint when it is here, else ``fallback``."""
    if checkpoint:
        if os.path.exists(os.path.join(checkpoint, "model.json")):
            return ModelDescription.load(checkpoint)
        notes.append(f"{what}: {checkpoint}/model.json is not on this machine; planned with the "
                     "config's model section")
    return fallback


def _attention(spec: str, device: str) -> mem.Attention:
    if spec in ("local", "sdpa", "te"):
        return spec  # type: ignore[return-value]
    return "te" if device == "gpu" else "local"


def _role(name: str, layout: Layout, model: ModelDescription, dtype: str, trainable: bool,
          value_head: bool = False, note: str = "") -> RolePlan:
    layout.check_model(model)
    enums = layout_enumerations(layout)
    return RolePlan(name, layout, model, dtype, trainable,
                    mem.stage_params(model, layout, value_head), summarize(enums), note)


def _with_resident(base: list[mem.MemoryEstimate], resident: list[tuple[str, int, str]],
                   phase: str) -> mem.MemoryEstimate:
    """Worst stage of ``base`` with the other roles' resident bytes added."""
    worst = mem.worst(base)
    est = mem.MemoryEstimate(phase, list(worst.items), worst.stage)
    for name, nbytes, note in resident:
        est.add(name, nbytes, note)
    return est


def _plan_lm(cfg: Any, world: int, opts: PlanOptions, result: PlanResult) -> None:
    layout = cfg.actor.layout.with_dp_for(world)
    actor = _role("actor", layout, cfg.model, cfg.actor.dtype, True)
    result.roles.append(actor)
    d = cfg.data
    n_micro = d.global_batch_size // (d.micro_batch_size * layout.dp)
    result.phases.append(mem.worst(mem.training_estimates(
        cfg.model, layout, dtype=cfg.actor.dtype, seq=d.seq_length,
        micro_batch_size=d.micro_batch_size, n_micro=n_micro,
        attention=_attention(cfg.actor.spec, opts.device), recompute=cfg.actor.recompute,
        distributed_optimizer=cfg.actor.optim.distributed_optimizer, phase="train")))


def _plan_preference(cfg: Any, world: int, opts: PlanOptions, result: PlanResult) -> None:
    """DPO / KTO: the actor's update (a DPO micro-batch holds 2 rows per pair) with the frozen
    reference resident, unless reference-free or precomputed (then it is freed before training)."""
    notes: list[str] = []
    model = _load_model(cfg.actor.checkpoint, cfg.model, "actor.checkpoint", notes)
    layout = cfg.actor_layout(world)
    dtype = cfg.actor.dtype
    result.roles.append(_role("actor", layout, model, dtype, True))
    frozen: list[tuple[str, int, str]] = []
    if getattr(cfg.algorithm, "reference_free", False):
        notes.append("reference_free: no reference model")
    elif cfg.algorithm.precompute_ref_logprobs:
        notes.append("precompute_ref_logprobs: the reference scores the dataset once, then is freed")
    elif cfg.actor.lora is None:
        ref = _role("reference", layout, model, dtype, False)
        result.roles.append(ref)
        frozen.append(("reference weights", max(ref.stage_params) * mem.DTYPE_BYTES[dtype], f"frozen, {dtype}"))
    result.warnings.extend(notes)
    mb = cfg.actor.micro_batch_size
    train = mem.training_estimates(
        model, layout, dtype=dtype, seq=cfg.data.max_prompt_length + cfg.data.max_completion_length,
        micro_batch_size=(2 if cfg.job == "dpo" else 1) * mb, n_micro=cfg.data.train_batch_size // (layout.dp * mb),
        attention=_attention(cfg.actor.spec, opts.device), recompute=cfg.actor.recompute,
        distributed_optimizer=cfg.actor.optim.distributed_optimizer, logits_copies=2,  # vocab-parallel log-probs
        phase=f"{cfg.job} update")
    if cfg.actor.lora is not None:
        full, train = train, plan_lora.adapt_estimates(train, model, layout, cfg.actor.lora, dtype=dtype,
                                                       distributed_optimizer=cfg.actor.optim.distributed_optimizer)
        saved_reference = 0 if cfg.algorithm.precompute_ref_logprobs or getattr(cfg.algorithm, "reference_free", False) \
            else max(mem.stage_params(model, layout)) * mem.DTYPE_BYTES[dtype]
        result.notes.append(plan_lora.savings_note("actor", full, train, cfg.actor.lora, saved_reference))
    result.phases.append(_with_resident(train, frozen, f"{cfg.job} update"))


def _plan_rl(cfg: Any, world: int, opts: PlanOptions, result: PlanResult) -> None:
    notes: list[str] = []
    model = _load_model(cfg.actor.checkpoint, cfg.model, "actor.checkpoint", notes)
    layout = cfg.actor_layout(world)
    dtype, attention = cfg.actor.dtype, _attention(cfg.actor.spec, opts.device)
    seq = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length  # a multi-turn trajectory: its budget
    placement = cfg.resolved_placement(world)
    result.placement = placement.describe()
    if not placement.colocated:
        plan_pools(cfg, world, opts, result, placement, model, attention)
        result.warnings.extend(notes)
        project_plan(cfg, model, world, opts.device, result, placement)
        return
    actor = _role("actor", layout, model, dtype, True)
    result.roles.append(actor)
    pbytes = mem.DTYPE_BYTES[dtype]

    def worst_static(role: RolePlan, per_param: int) -> int:
        return max(role.stage_params) * per_param

    # Frozen and auxiliary roles, resident in every phase (worst stage each: an upper bound).
    frozen: list[tuple[str, int, str]] = []
    if cfg.reference.enable and cfg.actor.lora is None:  # a LoRA actor's reference is its base: no copy
        ref_layout = cfg.reference.layout.with_dp_for(world) if cfg.reference.layout else layout
        ref = _role("reference", ref_layout, model, dtype, False)
        result.roles.append(ref)
        frozen.append(("reference weights", worst_static(ref, pbytes), f"frozen, {dtype}"))
    critic = None
    if cfg.critic.enable:
        cmodel = _load_model(getattr(cfg.critic, "checkpoint", None), model, "critic.checkpoint", notes)
        clayout = cfg.critic.layout.with_dp_for(world) if cfg.critic.layout else layout
        critic = _role("critic", clayout, cmodel, dtype, True, value_head=True)
        result.roles.append(critic)
    if cfg.reward.model_checkpoint:  # kind=model, or a rule / function plus a reward model
        rmodel = _load_model(cfg.reward.model_checkpoint, model, "reward.model_checkpoint", notes)
        reward = _role("reward", layout, rmodel, dtype, False, value_head=True,
                       note="reward model in the actor's training layout")
        result.roles.append(reward)
        frozen.append(("reward weights", worst_static(reward, pbytes), f"frozen, {dtype}"))
    result.warnings.extend(notes)

    mini = cfg.actor.mini_batch_size
    actor_train = mem.training_estimates(
        model, layout, dtype=dtype, seq=seq, micro_batch_size=cfg.actor.micro_batch_size,
        n_micro=mini // (layout.dp * cfg.actor.micro_batch_size), attention=attention,
        recompute=cfg.actor.recompute, distributed_optimizer=cfg.actor.optim.distributed_optimizer,
        logits_copies=3, phase="actor update")  # log-prob exp; entropy exp and mask (always logged)
    if cfg.actor.lora is not None:
        full, actor_train = actor_train, plan_lora.adapt_estimates(
            actor_train, model, layout, cfg.actor.lora, dtype=dtype,
            distributed_optimizer=cfg.actor.optim.distributed_optimizer)
        reference = max(mem.stage_params(model, layout)) * pbytes if cfg.reference.enable else 0
        result.notes.append(plan_lora.savings_note("actor", full, actor_train, cfg.actor.lora, reference))
    actor_static = max(e.get("weights") + e.get("grads") + e.get("optimizer") for e in actor_train)
    # What stays in device memory while generating (rollout.offload_* free the rest).
    actor_state = max((0 if cfg.rollout.offload_grad_buffers else e.get("grads"))
                      + (0 if cfg.rollout.offload_optimizer else e.get("optimizer"))
                      for e in actor_train)
    critic_static: list[tuple[str, int, str]] = []
    if critic is not None:
        critic_train = mem.training_estimates(
            critic.model, critic.layout, dtype=dtype, seq=seq,
            micro_batch_size=cfg.critic.micro_batch_size,
            n_micro=max(1, mini // (critic.layout.dp * cfg.critic.micro_batch_size)),
            attention=attention, recompute=cfg.actor.recompute,
            distributed_optimizer=cfg.critic.optim.distributed_optimizer, head="value",
            phase="critic update")
        if cfg.critic.lora is not None:  # the value head trains whole
            full, critic_train = critic_train, plan_lora.adapt_estimates(
                critic_train, critic.model, critic.layout, cfg.critic.lora, dtype=dtype,
                distributed_optimizer=cfg.critic.optim.distributed_optimizer, trained_extra=critic.model.hidden_size)
            result.notes.append(plan_lora.savings_note("critic", full, critic_train, cfg.critic.lora))
        cstat = max(e.get("weights") + e.get("grads") + e.get("optimizer") for e in critic_train)
        critic_static = [("critic weights+grads+optimizer", cstat, "resident")]
        result.phases.append(_with_resident(
            critic_train, [("actor weights+grads+optimizer", actor_static, "resident")] + frozen,
            "critic update"))
    result.phases.insert(0, _with_resident(actor_train, frozen + critic_static, "actor update"))
    # Each rank holds its data-parallel shard of the step's samples (hyflow.rl.dispatch).
    rows = cfg.data.train_batch_size // layout.dp * cfg.rollout.n
    data = ("rollout data", mem.rollout_data_bytes(rows, seq, reference=cfg.reference.enable, critic=critic is not None),
            f"this rank's {rows} rows (1/{layout.dp} of {cfg.data.train_batch_size * cfg.rollout.n}) x {seq} tokens")
    for phase in result.phases:
        phase.add(*data)

    fwd = mem.inference_estimates(model, layout, dtype=dtype, seq=seq,
                                  micro_batch_size=cfg.actor.micro_batch_size,
                                  attention=attention, phase="log-probs")
    result.phases.append(_with_resident(
        fwd, [("actor weights+grads+optimizer", actor_static, "resident")] + frozen + critic_static + [data],
        "log-probs"))

    # Generation: the actor's weights live in the generation buffer (its training shard is
    # a slice of it); grads and optimizer state stay where they are.
    gen = cfg.rollout.layout
    specs = model_param_specs(model, mem.padded_vocab(model, layout.tp), pbytes)
    # for the weights CP is more data parallelism, as in the RL job's hybrid engine
    plan = plan_reshard(specs, layout.cp_as_dp(), (gen.tp, gen.pp), world_size=world, num_layers=model.num_layers)
    result.reshard = plan
    enums = generation_enumerations(plan)
    for kind in ("tp", "pp", "dp", "micro_dp"):
        problem = check_partition(kind, enums[kind], world)
        if problem:
            result.errors.append("generation " + problem)
    gen_layout = plan.gen
    capacity = seq
    # the engine sizes its cache for min(max_concurrent, the samples of its replica)
    per_replica = -(-cfg.data.train_batch_size * cfg.rollout.n // plan.gen_dp_size)
    engine = GenerationConfig.from_settings(cfg.rollout)  # what the generation engine will run with
    slots = min(engine.max_concurrent, per_replica)
    # a prompt is prefilled once for its n samples (the engine's share_prompt_prefill)
    prompts = -(-slots // cfg.rollout.n) if engine.share_prompt_prefill else slots
    chunk = cfg.rollout.prefill_chunk_size or cfg.rollout.max_prompt_length
    prefill = min(engine.max_prefill_tokens, prompts * min(chunk, cfg.rollout.max_prompt_length))
    est = mem.MemoryEstimate("generation")
    est.add("generation weights", max(plan.gen_bytes),
            f"actor in TP_g={gen.tp} PP_g={gen.pp} (holds the training shard)")
    if opts.device == "gpu" and max(plan.scratch_bytes):
        est.add("reshard all-gather staging", max(plan.scratch_bytes), "bucketed TP-merge all-gather (transition only)")
    est.add("actor grads+optimizer", actor_state, "resident during generation (minus rollout.offload_*)")
    if model.moe is not None:
        _plan_experts(cfg, model, layout, plan, pbytes, est, result)
    if cfg.actor.lora is not None and (gen.tp, gen.pp) != (layout.tp, layout.pp):
        for phase in result.phases:  # the base stays in the generation buffer between transitions
            phase.add("generation weights (LoRA)", max(plan.gen_bytes), "the base in the generation layout, kept")
    for name, nbytes, note in frozen + critic_static:
        est.add(name, nbytes, note)
    gen_layers = max(plan.gen_split)  # the generation stage with the most layers
    if cfg.rollout.backend == "vllm":
        _vllm_memory(cfg, model, est, result, plan, opts, slots, capacity)
    else:
        est.add("KV cache", mem.kv_cache_bytes(model, gen.tp, gen.pp, slots, capacity, dtype, layers=gen_layers),
                f"{slots} sequences x {capacity} tokens, {model.num_query_groups // gen.tp} "
                f"KV group(s) x {gen_layers} layer(s)")
        est.add("forward transient", mem.generation_transient(
            model, gen.tp, prefill_tokens=prefill, rows=slots, dtype=dtype, context=capacity,
            chunked=chunk < cfg.rollout.max_prompt_length),
            f"prefill of {prefill} tokens over a {capacity}-token cache, logits + sampling of {slots} rows")
    result.phases.append(est)
    staging = []
    if opts.device == "cpu" and plan.tp_ratio > 1:  # the TP merge's shared-memory staging, mapped for the run
        own = max(plan.bytes_recv) // (plan.tp_ratio - 1)
        staging.append(("reshard staging", staging_bytes_per_rank(own, plan.tp_ratio),
                        "CPU shared-memory slots of the TP merge (all of the group's, mapped)"))
    if opts.device == "cpu" and plan.pp_ratio > 1:  # the PP merge's exchange slots, likewise
        own = max(plan.bytes_recv) // (plan.pp_ratio - 1)
        staging.append(("reshard staging (PP)", staging_bytes_per_rank(own, plan.pp_ratio, PP_STAGING_SLOT),
                        "CPU shared-memory slots of the PP merge (all of the group's, mapped)"))
    for phase in result.phases:
        for item in staging:
            phase.add(*item)
    # The generation buffer at start-up: none when the generation model reads the training weights
    # (same layout), none on CPU (a mapping whose pages arrive with the first transition).
    in_place = (gen.tp, gen.pp) == (layout.tp, layout.pp) and not cfg.rollout.force_staleness
    buffer = 0 if in_place or opts.device == "cpu" else max(plan.gen_bytes)
    result.phases.insert(0, mem.rl_startup_estimate(cfg, actor, opts.device, buffer, staging,
                                           [(r, r.name == "critic") for r in result.roles[1:]]))
    result.generation = {
        "tp": gen.tp, "pp": gen.pp, "dp": plan.gen_dp_size, "micro_dp_size": plan.micro_dp_size,
        "layout": gen_layout.describe(), "groups": summarize(enums),
        "kv_cache_bytes": est.get("KV cache"), "slots": slots, "capacity": capacity,
        "rollout_rows_per_rank": rows, "rollout_data_bytes": data[1],
    }
    project_plan(cfg, model, world, opts.device, result, placement)


def _vllm_memory(cfg: Any, model: ModelDescription, est: mem.MemoryEstimate, result: PlanResult, plan: Any,
                 opts: PlanOptions, slots: int, capacity: int) -> None:
    """``rollout.backend: vllm``: vLLM's own memory beside the generation buffer (its staging). On GPU
    vLLM takes ``gpu_memory_utilization`` of the device while generating (weights, KV cache,
    activations) and its sleep mode gives it back for training (level 2; level 1 keeps nothing on
    the device either, level 0 keeps it all); vLLM's CPU build has no sleep mode, so its weights and
    KV cache stay for the whole run (:mod:`hyflow.vllm_backend.engine`)."""
    options, gen = cfg.rollout.vllm, cfg.rollout.layout
    if opts.device == "gpu":
        share = int(options.gpu_memory_utilization * result.gpu_memory_bytes)
        est.add("vLLM engine", share,
                f"weights + KV cache + activations: rollout.vllm.gpu_memory_utilization="
                f"{options.gpu_memory_utilization} of the device")
        resident = share if options.sleep_level == 0 else 0
        note = "rollout.vllm.sleep_level=0: vLLM keeps its memory while training"
    else:
        tokens = max((options.max_num_seqs or cfg.rollout.max_concurrent) * capacity, model.context_length)
        kv = options.kv_cache_memory_bytes or mem.kv_cache_bytes(model, gen.tp, 1, 1, tokens, cfg.actor.dtype)
        resident = max(plan.gen_bytes) + kv
        est.add("vLLM engine", resident, f"weights + KV cache: its copy of the generation shard, a KV cache of "
                                         f"{tokens} tokens")
        note = "vLLM's CPU build has no sleep mode: its weights and KV cache stay"
    if resident:
        for phase in result.phases:
            phase.add("vLLM (resident)", resident, note)


def _plan_experts(cfg: Any, model: ModelDescription, layout: Layout, plan: ReshardPlan, pbytes: int,
                  est: mem.MemoryEstimate, result: PlanResult) -> None:
    """A mixture-of-experts actor: generation memory of its experts (every expert on every
    replica, the training experts kept aside, one layer's exchange staging), the expert exchange's
    bytes per transition and the expert all-to-all traffic per step."""
    gen = cfg.rollout.layout
    info: dict[str, Any] = {"ep": layout.ep, "etp": layout.expert_tp, "edp": layout.expert_dp,
                            "experts_per_rank": model.moe.num_experts // layout.ep,
                            "alltoall_bytes_per_step": rl_step_alltoall(cfg, model, layout)}
    if same_expert_grid(layout, gen.tp, gen.pp):  # the generation model shares the training experts
        info["exchange"] = None
    else:
        x = plan_expert_exchange(model, layout, plan, pbytes)
        ranks = sorted({0, x.world_size // 2, x.world_size - 1} | {g[0] for g in x.groups[:1]})
        gen_bytes = max(x.gen_bytes(r) for r in ranks)
        kept = max(x.train_bytes(r) for r in ranks)
        staging = max(x.staging_bytes(r) for r in ranks)
        recv = max(x.recv_bytes(r) for r in ranks)
        est.add("generation experts", gen_bytes,
                f"all {model.moe.num_experts} experts of the stage's layers at 1/TP_g={gen.tp} (EP_g=1)")
        est.add("actor experts (training copy)", kept,
                f"{model.moe.num_experts // layout.ep} experts x 1/ETP={layout.expert_tp}, kept while generating")
        if staging:
            est.add("expert exchange staging", staging, "one generation layer's all-to-all buffers (transition only)")
        info["exchange"] = {"recv_bytes_max": recv, "gen_bytes_max": gen_bytes, "train_bytes_max": kept,
                            "staging_bytes_max": staging, "group_size": len(x.groups[0]),
                            "collectives": x.slots}
    result.experts = info


def build_plan(config_path: str, overrides: Sequence[str], opts: PlanOptions) -> PlanResult:
    """Plan a job; every problem found ends up in ``result.errors`` (nothing is raised for a
    bad config)."""
    t0 = time.perf_counter()
    result = PlanResult(config=config_path)
    overrides = list(overrides)
    try:
        if opts.world_size is None:
            cfg = load_job_config(config_path, overrides)
            world = cfg.trainer.nproc
        else:
            world = opts.world_size
            overrides = [o for o in overrides if not o.startswith("trainer.nproc=")]
            cfg = load_job_config(config_path, overrides + [f"trainer.nproc={world}"])
    except ConfigError as e:
        result.errors.append(f"config: {e}")
        return result
    result.job, result.world_size = cfg.job, world
    result.distributed_optimizer = bool(cfg.actor.optim.distributed_optimizer)
    cluster = getattr(cfg, "cluster", None)
    gib = opts.gpu_memory_gib or (cluster.gpu_memory_gib if cluster else 80.0)
    result.gpu_memory_bytes = int(gib * GIB)
    gpu = opts.device == "gpu"
    result.reserve_bytes = int((opts.reserve_gib if opts.reserve_gib is not None
                                else (2.5 if gpu else 0.0)) * GIB)
    result.fragmentation = opts.fragmentation if opts.fragmentation is not None else (0.05 if gpu else 0.0)
    try:
        {"rl": _plan_rl, "dpo": _plan_preference, "kto": _plan_preference}.get(cfg.job, _plan_lm)(cfg, world, opts, result)
    except (ConfigError, ReshardPlanError) as e:
        result.errors.append(f"layout: {e}")
        return result
    result.timings["plan_s"] = time.perf_counter() - t0
    if cluster and gpu:
        per_node = cluster.gpus_per_node
        if world % per_node:
            result.warnings.append(f"world size {world} is not a multiple of cluster.gpus_per_node="
                                   f"{per_node}: the last node is partly idle")
        for role in result.roles:
            if role.layout.tp > per_node:
                result.warnings.append(f"{role.name}: tp={role.layout.tp} spans nodes "
                                       f"(gpus_per_node={per_node}); keep tp within a node")
    _check_memory(result)
    if cfg.job == "rl" and result.roles:
        try:
            result.compute = compute_plan(cfg, result.roles[0].model, result.roles[0].layout, opts.device)
        except ValueError as e:  # e.g. fewer layers than pipeline stages (the layout check says so too)
            result.warnings.append(f"compute estimate skipped: {e}")
    ranks = opts.megatron_ranks if opts.megatron_ranks is not None else sorted({0, world - 1})
    if ranks == "all":
        ranks = range(world)
    if result.pools:  # pooled placement: the groups are the pools' layouts (checked by resolve_placement)
        ranks = ()
    if ranks:
        t1 = time.perf_counter()
        import megatron.core.parallel_state  # noqa: F401  (timed apart from group creation)

        result.timings["megatron_import_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        actor = result.roles[0]
        train_enums = layout_enumerations(actor.layout)
        gen_enums = generation_enumerations(result.reshard) if result.reshard else None
        for rank in ranks:
            if not 0 <= rank < world:
                result.errors.append(f"--megatron-rank {rank} is outside 0..{world - 1}")
                continue
            check = verify_rank(actor.layout, rank, result.reshard, train_enums, gen_enums,
                                experts=getattr(actor.model, "moe", None) is not None)
            result.checks.append(check)
            result.errors.extend(check.mismatches)
        result.timings["megatron_groups_s"] = time.perf_counter() - t1
    result.timings["total_s"] = time.perf_counter() - t0
    return result


def _check_memory(result: PlanResult) -> None:
    peak = result.peak
    if peak is None or result.fits:
        return
    biggest = sorted(peak.items, key=lambda i: -i.bytes)[:3]
    # each item's remedies as separate actions, so one shared by two items is named once
    hints = {
        "KV cache": ["lower rollout.max_concurrent or the max lengths", "raise rollout.layout.tp"],
        "forward transient": ["lower the rollout engine's max_prefill_tokens"],
        "generation weights": ["raise rollout.layout.tp", "raise rollout.layout.pp"],
        "optimizer": ["raise dp"] if result.distributed_optimizer else
                     ["set actor.optim.distributed_optimizer=true", "raise dp"],
        "activations": ["set actor.recompute=selective/full", "lower the micro-batch size"],
        "weights": ["raise tp", "raise pp"], "grads": ["raise tp", "raise pp"],
        "logits": ["lower the micro-batch size", "raise tp"],
        "actor grads+optimizer": ["set rollout.offload_optimizer / offload_grad_buffers=true"]
                                 + (["raise tp", "raise pp"] if result.distributed_optimizer else
                                    ["set actor.optim.distributed_optimizer=true"]),
    }
    parts = ", ".join(f"{i.name} {i.bytes / GIB:.1f} GiB" for i in biggest)
    hint = "; ".join(dict.fromkeys(a for i in biggest for a in hints.get(i.name, [])))
    result.errors.append(
        f"memory: phase '{peak.phase}' needs {result.required_bytes / GIB:.1f} GiB per GPU "
        f"(estimate {peak.total / GIB:.1f} GiB + {result.fragmentation:.0%} fragmentation + "
        f"{result.reserve_bytes / GIB:.1f} GiB reserve) but a GPU has "
        f"{result.gpu_memory_bytes / GIB:.1f} GiB; largest: {parts}" + (f". Try: {hint}" if hint else ""))
