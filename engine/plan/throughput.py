"""A first-order cost model of an RL step on GPUs: steps/s of ``sync`` (colocated hybrid engine)
and ``one_step_off`` (a training pool and a generation pool that overlap), for ``hyflow plan``.

Per step, with ``S = data.train_batch_size x rollout.n`` responses, every response assumed at
``rollout.max_new_tokens`` (an upper bound: real responses stop earlier):

* **generation** on ``R`` replicas of ``TP_g x PP_g`` GPUs: each replica decodes its ``S / R``
  sequences in waves of ``rollout.max_concurrent``; a decode step is memory bound and reads the
  replica's weights once (``model bytes / TP_g`` per GPU over the stages, which run one after the
  other) plus the wave's KV cache, at ``HBM bandwidth x decode_efficiency``; prefill is compute
  bound at ``prefill_mfu``;
* **training** (old / reference log-probs, critic values, updates, as
  :func:`hyflow.plan.flops.step_flops` counts them; full recompute adds a forward per
  update) on the training GPUs at ``train_mfu``, times the pipeline's idle slots
  (:func:`hyflow.plan.stages.bubble_step_factor`): an update flushes the pipeline after every
  mini-batch (``mini_batch_size / (dp x micro_batch_size)`` micro-batches per flush), a scoring
  pass once over the rank's rows;
* **gradient traffic** (:func:`dp_gradient_seconds`): Megatron DDP reduces after the backward
  (``overlap_grad_reduce`` off), per optimizer step a ring reduce-scatter of the fp32 gradients and
  an all-gather of the updated parameters (distributed optimizer; else an all-reduce), over the
  data-parallel group's links;
* **moving the weights**: colocated, the slowest rank's reshard (:func:`reshard_seconds`): its TP
  merge then its PP merge, each at the bandwidth of its group's links (NVLink inside a node, the
  network when the group spans nodes: the PP merge's groups usually do); pools, the weight sync's
  largest per-GPU receive or send over the inter-node network.

``sync``: generation on all GPUs + reshard + training and gradient traffic on all GPUs.
``one_step_off``: the slower of generation (generation pool) and training with its gradient
traffic (training pool), + the weight sync. The constants are stated in the output; the model is
for comparing layouts and modes, not a promise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from hyflow.config import ConfigError
from hyflow.hybrid.param_specs import ReshardPlanError, model_param_specs
from hyflow.hybrid.reshard_plan import plan_reshard
from hyflow.parallel.layout import Layout
from hyflow.placement.config import resolve_placement
from hyflow.placement.sync_planner import model_experts, model_specs, summarize_weight_sync
from hyflow.plan import memory_estimate as mem
from hyflow.plan.flops import forward_flops, step_flops
from hyflow.plan.stages import bubble_step_factor, job_head_layers

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """Per-GPU figures of the cost model (defaults: H100 SXM, NDR InfiniBand)."""

    peak_flops: float = 989.4e12  # dense bf16
    hbm_bytes_per_s: float = 3.35e12
    nvlink_bytes_per_s: float = 450 * GB
    network_bytes_per_s: float = 50 * GB  # 400 Gb/s per GPU
    train_mfu: float = 0.40
    prefill_mfu: float = 0.50
    decode_efficiency: float = 0.60


def generation_seconds(cfg: Any, model: Any, tp: int, pp: int, replicas: int, hw: Hardware) -> float:
    """Seconds for ``replicas`` generation replicas of ``tp x pp`` GPUs to produce one step's responses."""

    pbytes = mem.DTYPE_BYTES[cfg.actor.dtype]
    seqs = -(-cfg.data.train_batch_size * cfg.rollout.n // replicas)
    wave = min(cfg.rollout.max_concurrent, seqs)
    waves = -(-seqs // wave)
    weights = _model_bytes(model, tp, pbytes)  # one replica's weights, read once per decode step
    new = cfg.rollout.max_new_tokens
    kv_mean = mem.kv_cache_bytes(model, tp, 1, wave, cfg.rollout.max_prompt_length + new // 2, cfg.actor.dtype)
    decode = waves * new * (weights / tp + kv_mean) / (hw.hbm_bytes_per_s * hw.decode_efficiency)
    prompts = seqs / cfg.rollout.n  # a prompt is prefilled once for its n samples
    prefill = forward_flops(model, prompts * cfg.rollout.max_prompt_length, cfg.rollout.max_prompt_length) / (
        tp * pp * hw.peak_flops * hw.prefill_mfu)
    return decode + prefill


def training_seconds(cfg: Any, model: Any, gpus: int, hw: Hardware, layout: Any = None) -> float:
    """Seconds of one step's forward/backward work (everything but generation) on ``gpus`` GPUs in
    ``layout`` (the actor's; its pipeline's idle slots included, :func:`pipeline_factors`)."""

    rows = cfg.data.train_batch_size * cfg.rollout.n
    tokens = rows * (cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens)
    f = step_flops(_with_model(cfg, model), tokens, rows)
    update = f["update"] * (4 / 3 if cfg.actor.recompute == "full" else 1.0)
    scoring_bubble, update_bubble = pipeline_factors(cfg, model, layout) if layout is not None else (1.0, 1.0)
    work = (f["ref"] + f["critic"]) * scoring_bubble + update * update_bubble
    return work / (gpus * hw.peak_flops * hw.train_mfu)


def pipeline_factors(cfg: Any, model: Any, layout: Any) -> tuple[float, float]:
    """1F1B step time over perfectly parallel work (:func:`hyflow.plan.stages.bubble_step_factor`,
    the built stage split) of a scoring pass (one flush over the rank's rows) and of an update (one
    flush per mini-batch: ``mini_batch_size / (dp x micro_batch_size)`` micro-batches each)."""

    if layout.pp == 1 or layout.vpp:
        return 1.0, 1.0
    layers = list(layout.layers_per_stage(model.num_layers))
    head = job_head_layers(_with_model(cfg, model), model)
    dp, mbs = layout.dp * layout.cp, cfg.actor.micro_batch_size
    scoring = max(1, cfg.data.train_batch_size * cfg.rollout.n // dp // mbs)
    update = max(1, cfg.actor.mini_batch_size // (dp * mbs))
    return bubble_step_factor(layers, head, scoring), bubble_step_factor(layers, head, update)


def link_bytes_per_s(ranks: Any, gpus_per_node: int, hw: Hardware) -> float:
    """Bandwidth of a group's links: NVLink when its ranks share a node, else the network."""
    return hw.nvlink_bytes_per_s if len({r // gpus_per_node for r in ranks}) <= 1 else hw.network_bytes_per_s


def reshard_seconds(plan: Any, gpus_per_node: int, hw: Hardware) -> float:
    """The slowest rank's train -> generation transition: its TP merge (``bytes_recv`` minus
    ``bytes_recv_pp``, inside its stage's merge group) then its PP merge (``bytes_recv_pp``, from the
    other stages of its PP-merge group), each at its group's link bandwidth."""
    worst = 0.0
    for rank in range(plan.world_size):
        pp = plan.bytes_recv_pp[rank] if plan.bytes_recv_pp else 0
        t = ((plan.bytes_recv[rank] - pp) / link_bytes_per_s(plan.tp_merge_ranks(rank), gpus_per_node, hw)
             + pp / link_bytes_per_s(plan.pp_merge_ranks(rank), gpus_per_node, hw))
        worst = max(worst, t)
    return worst


def dp_gradient_seconds(cfg: Any, model: Any, layout: Any, gpus_per_node: int, hw: Hardware) -> float:
    """Seconds per RL step of the actor's data-parallel gradient traffic on the worst stage's rank
    (DDP reduces after the backward, nothing overlaps): per optimizer step a ring moves ``(DP-1)/DP``
    of a buffer per pass, the fp32 gradients reduce-scattered and the updated parameters all-gathered
    with the distributed optimizer (an all-reduce, two passes of the fp32 gradients, without), over
    the links of the data-parallel group (global ranks: a pool's layout starts at its first rank)."""

    dp = layout.dp * layout.cp
    if dp == 1:
        return 0.0
    params = max(mem.stage_params(model, layout))
    ring = (dp - 1) / dp
    if cfg.actor.optim.distributed_optimizer:
        per_update = ring * params * (4 + mem.DTYPE_BYTES[cfg.actor.dtype])
    else:
        per_update = 2 * ring * params * 4
    updates = cfg.actor.ppo_epochs * max(1, cfg.data.train_batch_size * cfg.rollout.n // cfg.actor.mini_batch_size)
    group = layout.groups("dp_cp")[0]
    return updates * per_update / link_bytes_per_s(group, gpus_per_node, hw)


def project(cfg: Any, model: Any, world: int, reshard: Any, sync_plan: Any, off_placement: Any,
            hw: Hardware = Hardware(), layout: Any = None, gpus_per_node: int = 8,
            expert_exchange_bytes: int = 0) -> dict:
    """Seconds and steps/s of both modes; ``reshard`` the colocated reshard plan (None: not
    planned), ``layout`` the actor's colocated training layout, ``off_placement`` the one_step_off
    placement (or a string: why there is none), ``sync_plan`` its weight-sync plan (or summary),
    ``expert_exchange_bytes`` what the slowest rank receives of a mixture-of-experts actor's expert
    exchange per transition (charged at the network's speed: expert groups at scale span nodes)."""
    out: dict[str, Any] = {"assumptions": dict(asdict(hw), gpus_per_node=gpus_per_node),
                           "responses_at_max_new_tokens": True}
    gen = cfg.rollout.layout
    t_gen = generation_seconds(cfg, model, gen.tp, gen.pp, world // (gen.tp * gen.pp), hw)
    t_train = training_seconds(cfg, model, world, hw, layout)
    t_dp = dp_gradient_seconds(cfg, model, layout, gpus_per_node, hw) if layout is not None else 0.0
    t_reshard = reshard_seconds(reshard, gpus_per_node, hw) if reshard is not None else 0.0
    t_reshard += expert_exchange_bytes / hw.network_bytes_per_s
    total = t_gen + t_reshard + t_train + t_dp
    bubbles = pipeline_factors(cfg, model, layout) if layout is not None else (1.0, 1.0)
    out["sync"] = {"ranks": world, "generation_s": t_gen, "reshard_s": t_reshard, "training_s": t_train,
                   "dp_gradient_s": t_dp, "scoring_bubble": bubbles[0], "update_bubble": bubbles[1],
                   "step_s": total, "steps_per_s": 1 / total}
    if isinstance(off_placement, str) or off_placement is None:
        out["one_step_off"] = {"unavailable": off_placement or "no placement"}
        return out
    roles = off_placement.roles
    g = roles["rollout"].layout
    actor = roles["actor"]
    train_gpus = sum(p.size for p in off_placement.pools if p != roles["rollout"].pool)
    o_gen = generation_seconds(cfg, model, g.tp, g.pp, g.dp, hw)
    o_train = training_seconds(cfg, model, train_gpus, hw, actor.layout)
    o_dp = dp_gradient_seconds(cfg, model, actor.layout, gpus_per_node, hw)
    o_sync = max(sync_plan.max_recv, sync_plan.max_sent) / hw.network_bytes_per_s
    step = max(o_gen, o_train + o_dp) + o_sync
    out["one_step_off"] = {"train_ranks": train_gpus, "gen_ranks": roles["rollout"].pool.size,
                           "generation_s": o_gen, "training_s": o_train, "dp_gradient_s": o_dp,
                           "weight_sync_s": o_sync, "step_s": step, "steps_per_s": 1 / step}
    out["speedup"] = total / step
    return out


def _model_bytes(model: Any, tp: int, pbytes: int) -> float:

    layout_params = sum(mem.stage_params(model, _layout(tp)))
    return layout_params * tp * pbytes


def _layout(tp: int):

    return Layout(tp=tp)


def _with_model(cfg: Any, model: Any) -> Any:
    """``cfg`` with ``model`` as its model section (the checkpoint's description when planned from one)."""
    return dataclasses.replace(cfg, model=model) if cfg.model is not model else cfg


def format_projection(proj: dict) -> list[str]:
    """Lines of the report."""
    s = proj["sync"]
    lines = ["", "Throughput projection (cost model, hyflow.plan.throughput; responses at max_new_tokens)",
             f"  sync (colocated, {s['ranks']} GPUs): generation {s['generation_s']:.1f} s + reshard "
             f"{s['reshard_s']:.2f} s + training {s['training_s']:.1f} s (pipeline bubbles x{s['update_bubble']:.3f} "
             f"per update, x{s['scoring_bubble']:.3f} scoring) + DP gradient traffic {s['dp_gradient_s']:.1f} s "
             f"= {s['step_s']:.1f} s/step, {s['steps_per_s'] * 3600:.1f} steps/h ({s['steps_per_s']:.5f} steps/s)"]
    o = proj["one_step_off"]
    if "unavailable" in o:
        lines.append(f"  one_step_off: not projected ({o['unavailable']})")
    else:
        lines.append(f"  one_step_off (train {o['train_ranks']} GPUs | generation {o['gen_ranks']} GPUs): "
                     f"max(generation {o['generation_s']:.1f} s, training {o['training_s']:.1f} s + DP gradient "
                     f"traffic {o['dp_gradient_s']:.1f} s) + weight sync "
                     f"{o['weight_sync_s']:.2f} s = {o['step_s']:.1f} s/step, {o['steps_per_s'] * 3600:.1f} steps/h "
                     f"({o['steps_per_s']:.5f} steps/s); {proj['speedup']:.2f}x sync")
    hw = proj["assumptions"]
    lines.append(f"  assumed per GPU: {hw['peak_flops'] / 1e12:.0f} TFLOP/s peak, training MFU {hw['train_mfu']:.0%}, "
                 f"prefill MFU {hw['prefill_mfu']:.0%}, HBM {hw['hbm_bytes_per_s'] / 1e12:.2f} TB/s at "
                 f"{hw['decode_efficiency']:.0%} in decode, NVLink {hw['nvlink_bytes_per_s'] / GB:.0f} GB/s inside a "
                 f"node of {hw['gpus_per_node']}, network {hw['network_bytes_per_s'] / GB:.0f} GB/s between nodes")
    return lines


def project_plan(cfg: Any, model: Any, world: int, device: str, result: Any, placement: Any) -> None:
    """``hyflow plan``'s projection into ``result.throughput`` (GPU plans only): ``sync`` colocated
    on every rank (the config's reshard, or for a pooled config the colocated equivalent) and
    ``one_step_off`` (the config's pools, or the ranks split in half)."""

    if device != "gpu":
        return
    pbytes = mem.DTYPE_BYTES[cfg.actor.dtype]
    try:
        colocated = cfg.trained_actor_layout().with_dp_for(world)
    except ConfigError:
        colocated = None
    reshard = result.reshard
    if reshard is None and colocated is not None:  # a pooled config: the colocated equivalent
        try:
            specs = model_param_specs(model, mem.padded_vocab(model, colocated.tp), pbytes)
            reshard = plan_reshard(specs, colocated, (cfg.rollout.layout.tp, cfg.rollout.layout.pp),
                                   world_size=world, num_layers=model.num_layers)
        except (ConfigError, ReshardPlanError):
            reshard = None
    off: Any = placement if not placement.colocated else None
    sync = result.weight_sync
    if off is None:
        try:
            off = resolve_placement(dataclasses.replace(
                cfg, trainer=dataclasses.replace(cfg.trainer, mode="one_step_off")), world)
        except ConfigError as e:
            off = f"the ranks split in half do not fit: {e}"
    if sync is None and not isinstance(off, str):
        actor, gen = off.roles["actor"], off.roles["rollout"]
        sync = summarize_weight_sync(model_specs(model, mem.padded_vocab(model, actor.layout.tp), pbytes),
                                     actor.layout, gen.layout, model.num_layers,
                                     **model_experts(model, pbytes))
    cluster = getattr(cfg, "cluster", None)
    exchange = (getattr(result, "experts", None) or {}).get("exchange") or {}
    result.throughput = project(cfg, model, world, reshard, sync, off, layout=colocated,
                                gpus_per_node=cluster.gpus_per_node if cluster else 8,
                                expert_exchange_bytes=exchange.get("recv_bytes_max", 0) if reshard else 0)
