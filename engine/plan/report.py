"""Print a :class:`~hyflow.plan.core.PlanResult`: a human table, then one JSON line.

The JSON line (last line of stdout) is the machine interface: sizes in bytes, group
enumerations as count / size / first group / digest (:func:`hyflow.plan.group_check.digest`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyflow.config.units import format_bytes
from hyflow.plan.core import PlanResult
from hyflow.plan.stages import format_compute
from hyflow.plan.throughput import format_projection



def _layout_dict(layout: Any) -> dict:
    return {k: v for k, v in dataclasses.asdict(layout).items()}


def to_json(result: PlanResult) -> dict[str, Any]:
    """The JSON object of a plan."""
    out: dict[str, Any] = {
        "ok": not result.errors, "config": result.config, "job": result.job,
        "world_size": result.world_size,
        "roles": {r.name: {"layout": _layout_dict(r.layout), "dtype": r.dtype,
                           "trainable": r.trainable, "params_per_rank": r.stage_params,
                           "groups": r.groups} for r in result.roles},
        "generation": result.generation,
    }
    plan = result.reshard
    out["reshard"] = None
    if plan is not None:
        out["reshard"] = {
            "train": [plan.train.tp, plan.train.pp, plan.train.dp], "gen": [plan.gen.tp, plan.gen.pp],
            "micro_dp_size": plan.micro_dp_size, "gen_dp_size": plan.gen_dp_size,
            "model_bytes": plan.model_bytes, "bytes_recv_max": max(plan.bytes_recv),
            "bytes_recv_min": min(plan.bytes_recv), "bytes_sent_max": max(plan.bytes_sent),
            "formula_bytes": float(plan.formula_bytes), "total_bytes_moved": plan.total_bytes_moved,
            "peak_extra_bytes": plan.peak_extra_bytes, "gen_bytes_max": max(plan.gen_bytes),
            "scratch_bytes_max": max(plan.scratch_bytes),
        }
    sync = result.weight_sync
    out["placement"] = {"description": result.placement, "pools": result.pools}
    out["weight_sync"] = None if sync is None else {
        "total_bytes": sync.total_bytes, "bytes_recv_max": sync.max_recv, "bytes_sent_max": sync.max_sent,
        "buckets": sync.buckets, "rounds": sync.rounds, "bucket_bytes": sync.bucket_bytes,
        "model_bytes": sync.model_bytes}
    out["throughput"] = result.throughput
    out["experts"] = result.experts
    peak = result.peak
    out["memory"] = {
        "gpu_bytes": result.gpu_memory_bytes, "reserve_bytes": result.reserve_bytes,
        "fragmentation": result.fragmentation, "required_bytes": result.required_bytes,
        "peak_phase": peak.phase if peak else None, "peak_bytes": peak.total if peak else None,
        "fits": result.fits,
        "phases": {e.phase: {"total": e.total, "stage": e.stage,
                             "items": {i.name: i.bytes for i in e.items}} for e in result.phases},
    }
    out["megatron_checks"] = [
        {"rank": c.rank, "training_new_group_calls": c.training_calls,
         "generation_new_group_calls": c.generation_calls, "training_groups": c.training_groups,
         "generation_groups": c.generation_groups, "megatron": c.megatron,
         "generation": c.generation, "ok": not c.mismatches} for c in result.checks]
    out["errors"], out["warnings"], out["notes"] = result.errors, result.warnings, result.notes
    out["timings"] = {k: round(v, 3) for k, v in result.timings.items()}
    return out


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{int(n)}"


def format_table(result: PlanResult) -> str:
    """The human-readable report."""
    lines = [f"hyflow plan: {result.config}" + (
        f" (job {result.job}) at {result.world_size} ranks, {format_bytes(result.gpu_memory_bytes)}"
        " per GPU" if result.world_size else "")]
    if result.roles:
        lines += ["", "Training layouts",
                  f"  {'role':10s} {'layout':38s} {'params/rank (max)':>18s}  {'dtype':5s}"]
        for r in result.roles:
            lines.append(f"  {r.name:10s} {r.layout.describe():38s} "
                         f"{_count(max(r.stage_params)):>18s}  {r.dtype:5s}"
                         + (f"  ({r.note})" if r.note else ""))
        actor = result.roles[0]
        lines += ["", f"Groups of the actor's training layout ({actor.layout.describe()})",
                  f"  {'kind':9s} {'count':>6s} {'size':>5s}  first group"]
        for kind, g in actor.groups.items():
            lines.append(f"  {kind:9s} {g['count']:6d} {str(g['size']):>5s}  {_short(g['first'])}")
    if result.generation:
        g = result.generation
        lines += ["", f"Generation layout of the actor: TP_g={g['tp']} PP_g={g['pp']} "
                      f"DP_g={g['dp']} (micro-DP {g['micro_dp_size']})",
                  f"  {'kind':9s} {'count':>6s} {'size':>5s}  first group"]
        for kind in ("tp", "pp", "dp", "micro_dp", "tp_merge", "pp_merge"):
            if kind not in g["groups"]:  # a generation pool of its own has no micro-DP / merge groups
                continue
            grp = g["groups"][kind]
            lines.append(f"  {kind:9s} {grp['count']:6d} {str(grp['size']):>5s}  {_short(grp['first'])}")
    if result.pools:
        lines += ["", f"Placement: {result.placement}",
                  f"  {'pool':10s} {'ranks':>11s}  {'roles':28s} {'worst phase (per GPU)':>24s}"]
        for p in result.pools:
            ranks = f"{p['ranks'][0]}-{p['ranks'][1] - 1}"
            lines.append(f"  {p['name']:10s} {ranks:>11s}  {', '.join(p['roles']):28s} "
                         f"{format_bytes(p['bytes']):>12s}  ({p['phase']})")
    sync = result.weight_sync
    if sync is not None:
        lines += ["", "Weight sync training pool -> generation pool, per update",
                  f"  {format_bytes(sync.total_bytes)} in {sync.buckets} buckets of <= "
                  f"{format_bytes(sync.bucket_bytes)} ({sync.rounds} rounds); each generation rank receives "
                  f"{format_bytes(sync.max_recv)} (its slice, once), a training rank sends at most "
                  f"{format_bytes(sync.max_sent)}; model {format_bytes(sync.model_bytes)}"]
    plan = result.reshard
    if plan is not None:
        lines += ["", "Reshard per train->generation transition (per rank)",
                  f"  received max {format_bytes(max(plan.bytes_recv))} (formula "
                  f"{format_bytes(float(plan.formula_bytes))}), sent max "
                  f"{format_bytes(max(plan.bytes_sent))}, extra memory max "
                  f"{format_bytes(plan.peak_extra_bytes)}; all ranks move "
                  f"{format_bytes(plan.total_bytes_moved)} of a {format_bytes(plan.model_bytes)} model"]
    if result.experts:
        lines += _format_experts(result.experts)
    if result.checks:
        lines += ["", "Groups really created for sample ranks (fake process-group backend)"]
        for c in result.checks:
            status = "match" if not c.mismatches else f"{len(c.mismatches)} MISMATCH(ES)"
            lines.append(f"  rank {c.rank:5d}: new_group calls {c.training_calls} training + {c.generation_calls} "
                         f"generation, member of {c.training_groups} + {c.generation_groups}: {status}; "
                         f"tp {_short(c.megatron.get('tp', []))}"
                         f" pp {_short(c.megatron.get('pp', []))} dp {_short(c.megatron.get('dp', []))}")
    if result.phases:
        lines += ["", "Memory per GPU (worst rank of each phase)"]
        for est in result.phases:
            stage = f", pipeline stage {est.stage}" if est.stage is not None else ""
            lines.append(f"  {est.phase}{stage}: {format_bytes(est.total)}")
            for item in est.items:
                lines.append(f"    {item.name:32s} {format_bytes(item.bytes):>11s}  {item.note}")
        peak = result.peak
        verdict = "fits" if result.fits else "DOES NOT FIT"
        lines.append(f"  peak: {peak.phase} {format_bytes(peak.total)} + {result.fragmentation:.0%} "
                     f"fragmentation + {format_bytes(result.reserve_bytes)} reserve = "
                     f"{format_bytes(result.required_bytes)} of {format_bytes(result.gpu_memory_bytes)}"
                     f" per GPU: {verdict}")
    if result.compute:
        lines += format_compute(result.compute)
    if result.throughput:
        lines += format_projection(result.throughput)
    for note in result.notes:
        lines.append(f"note: {note}")
    for w in result.warnings:
        lines.append(f"warning: {w}")
    for e in result.errors:
        lines.append(f"error: {e}")
    if result.timings:
        lines.append("planned in " + ", ".join(f"{k} {v:.2f}" for k, v in result.timings.items()))
    return "\n".join(lines)


def _format_experts(x: dict) -> list[str]:
    lines = ["", f"Experts: EP={x['ep']} x ETP={x['etp']} (expert DP {x['edp']}), {x['experts_per_rank']} experts "
                 "per rank and layer"]
    a2a = x["alltoall_bytes_per_step"]
    if a2a:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in a2a.items() if k != "total")
        lines.append(f"  expert all-to-all per step (busiest rank, sent = received): {format_bytes(a2a['total'])}"
                     f" ({parts})")
    ex = x["exchange"]
    if ex is None:
        lines.append("  generation shares the training experts (same expert grid): no expert exchange")
    else:
        lines.append(f"  expert exchange per transition: received max {format_bytes(ex['recv_bytes_max'])} over "
                     f"groups of {ex['group_size']} ranks in {ex['collectives']} all-to-all(s); generation experts "
                     f"{format_bytes(ex['gen_bytes_max'])} per rank, staging {format_bytes(ex['staging_bytes_max'])}")
    return lines


def _short(group: list, limit: int = 8) -> str:
    if len(group) <= limit:
        return str(list(group))
    return "[" + ", ".join(map(str, group[:limit])) + f", ... ({len(group)})]"
