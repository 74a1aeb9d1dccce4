"""``hyflow plan`` for a run on placement pools: roles in their layouts, memory per pool, and the
bytes of the weight sync from the training pool to the generation pool.

Each pool's worst phase is estimated for the roles that live on it (what else stays resident there
counted too); the generation pool holds the actor in the generation layout (its slice only, as the
weight sync delivers it), the KV cache and the sync's receive buckets.
"""

from __future__ import annotations

from typing import Any

from hyflow.placement.sync_planner import model_experts, model_specs, summarize_weight_sync
from hyflow.plan import memory_estimate as mem
from hyflow.plan.group_check import layout_enumerations, summarize
from hyflow.plan.role_plan import RolePlan


def plan_pools(cfg: Any, world: int, opts: Any, result: Any, placement: Any, model, attention: str) -> None:
    """Fill ``result`` (a :class:`~hyflow.plan.core.PlanResult`) for a pooled placement."""
    dtype = cfg.actor.dtype
    pbytes = mem.DTYPE_BYTES[dtype]
    seq = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length  # a multi-turn trajectory: its budget
    roles = placement.roles
    for name in ("actor", "reference", "critic", "reward"):
        if name not in roles:
            continue
        rp = roles[name]
        head = name in ("critic", "reward")
        rp.layout.check_model(model, training=name in ("actor", "critic"))
        result.roles.append(RolePlan(name, rp.layout, model, dtype, name in ("actor", "critic"),
                                     mem.stage_params(model, rp.layout, head), summarize(layout_enumerations(rp.layout)),
                                     note=f"pool {rp.pool.name}: ranks {rp.pool.start}-{rp.pool.stop - 1}"))
    by_name = {r.name: r for r in result.roles}
    actor_layout = roles["actor"].layout
    padded = mem.padded_vocab(model, actor_layout.tp)
    gen = roles["rollout"]
    sync = summarize_weight_sync(model_specs(model, padded, pbytes), actor_layout, gen.layout, model.num_layers,
                                 **model_experts(model, pbytes))
    result.weight_sync = sync
    prompts, n = cfg.data.train_batch_size, cfg.rollout.n

    def static(role: str) -> int:
        per_param = pbytes if role in ("reference", "reward") else None
        r = by_name[role]
        if per_param is not None:
            return max(r.stage_params) * per_param
        shard = r.layout.dp if getattr(cfg, role).optim.distributed_optimizer else 1
        return max(r.stage_params) * int(pbytes + 4 + mem.optimizer_bytes_per_param(dtype) / shard)

    for pool in placement.pools:
        here = [r for r in ("actor", "critic", "reference", "reward") if r in roles and roles[r].pool == pool]
        if not here:
            continue
        lead = roles[here[0]]
        rows = prompts // lead.layout.dp * n
        data = ("rollout data", mem.rollout_data_bytes(rows, seq, reference="reference" in roles,
                                                       critic="critic" in roles),
                f"this rank's {rows} rows (1/{lead.layout.dp} of {prompts * n}) x {seq} tokens")
        resident = [(f"{r} weights" + ("+grads+optimizer" if r == "critic" else ""), static(r),
                     "resident") for r in here[1:]]
        label = f"pool {pool.name}"
        if here[0] in ("actor", "critic"):
            c = cfg.actor if here[0] == "actor" else cfg.critic
            mini = cfg.actor.mini_batch_size if here[0] == "actor" else (c.mini_batch_size or cfg.actor.mini_batch_size)
            train = mem.training_estimates(
                model, lead.layout, dtype=dtype, seq=seq, micro_batch_size=c.micro_batch_size,
                n_micro=max(1, mini // (lead.layout.dp * c.micro_batch_size)), attention=attention,
                recompute=cfg.actor.recompute, distributed_optimizer=c.optim.distributed_optimizer,
                head="value" if here[0] == "critic" else "lm", logits_copies=3 if here[0] == "actor" else 1,
                phase=f"{label}: {here[0]} update")
            est = _with(train, resident + [data], f"{label}: {here[0]} update")
            if here[0] == "actor":  # its start-up: the actor, then the other roles of the pool
                start = mem.rl_startup_estimate(cfg, by_name["actor"], opts.device, 0, [],
                                                [(by_name[r], r == "critic") for r in here[1:]])
                start.phase = f"{label}: {start.phase}"
                result.phases.append(start)
        else:
            fwd = mem.inference_estimates(model, lead.layout, dtype=dtype, seq=seq,
                                          micro_batch_size=cfg.actor.micro_batch_size, attention=attention,
                                          phase=f"{label}: forward")
            est = _with(fwd, [(f"{here[0]} weights", static(here[0]), "frozen")] + resident + [data],
                        f"{label}: {here[0]} forward")
        result.phases.append(est)
        result.pools.append({"name": pool.name, "ranks": [pool.start, pool.stop], "roles": here,
                             "phase": est.phase, "bytes": est.total})
    # the generation pool: its slice of the actor, the KV cache, the sync's receive staging
    layout = gen.layout
    per_replica = -(-prompts * n // layout.dp)
    if cfg.trainer.mode == "async":  # one streaming cache: up to k + 1 batches' groups in flight
        per_replica *= cfg.trainer.max_staleness + 1
    slots = min(cfg.rollout.max_concurrent, per_replica)
    prefill = min(8192, -(-slots // n) * cfg.rollout.max_prompt_length)
    est = mem.MemoryEstimate(f"pool {gen.pool.name}: generation")
    est.add("generation weights", sync.max_shard_bytes,
            f"actor in TP_g={layout.tp} PP_g={layout.pp}: this rank's slice, as the weight sync delivers it")
    peers = sync.max_peers
    est.add("weight-sync staging", min(sync.bucket_bytes * peers, sync.max_shard_bytes),
            f"one bucket per sending peer ({peers})")
    est.add("KV cache", mem.kv_cache_bytes(model, layout.tp, layout.pp, slots, seq, dtype),
            f"{slots} sequences x {seq} tokens")
    est.add("forward transient", mem.generation_transient(model, layout.tp, prefill_tokens=prefill, rows=slots,
                                                          dtype=dtype), f"prefill of {prefill} tokens")
    result.phases.append(est)
    result.pools.append({"name": gen.pool.name, "ranks": [gen.pool.start, gen.pool.stop], "roles": ["rollout"],
                         "phase": est.phase, "bytes": est.total})
    result.generation = {
        "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "micro_dp_size": 1, "layout": layout.describe(),
        "groups": summarize(layout_enumerations(layout)), "kv_cache_bytes": est.get("KV cache"),
        "slots": slots, "capacity": seq, "pool": gen.pool.name,
    }


def _with(base, resident, phase: str):
    worst = mem.worst(base)
    est = mem.MemoryEstimate(phase, list(worst.items), worst.stage)
    for name, nbytes, note in resident:
        est.add(name, nbytes, note)
    return est
