"""The process groups of a reshard plan: enumerated for every rank, created for one.

:func:`generation_enumerations` lists every group the hybrid engine needs (pure arithmetic,
what ``hyflow plan`` reports for 1024 ranks in milliseconds); :func:`build_generation_groups`
creates them, the one function both the executor and ``hyflow plan``'s fake-world check call,
so what the plan verifies is what a job runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.hybrid.reshard_plan import ReshardPlan
from hyflow.monitor import comm
from hyflow.parallel import group_registry

__all__ = ["MEGATRON_KINDS", "GenerationGroups", "generation_enumerations", "build_generation_groups", "cp_micro_dp",
           "build_micro_dp_group"]

#: Kinds of groups Megatron creates for a layout (and hyflow's ``ParallelGroups`` carries).
MEGATRON_KINDS = ("tp", "pp", "dp", "cp", "mp", "tp_cp", "dp_cp", "embd", "pos_embd")


def generation_enumerations(plan: ReshardPlan) -> dict[str, list[list[int]]]:
    """Every group of ``plan``'s generation side: the generation layout's Megatron kinds,
    ``micro_dp`` (reported, not created: the merges below partition it), and the two merge
    groups of the reshard (``tp_merge`` members in shard order, ``pp_merge`` in stage order)."""
    world = plan.world_size
    by_dp: dict[int, list[int]] = {}
    for r in range(world):
        by_dp.setdefault(plan.gen_coord(r)[2], []).append(r)
    lists = lambda groups: [list(g) for g in groups]  # noqa: E731
    return {
        "tp": lists(plan.gen_tp_groups), "pp": lists(plan.gen_pp_groups),
        "dp": lists(plan.gen_dp_groups), "cp": [[r] for r in range(world)],
        "mp": lists(by_dp.values()), "tp_cp": lists(plan.gen_tp_groups),
        "dp_cp": lists(plan.gen_dp_groups),
        "embd": [sorted({g[0], g[-1]}) for g in plan.gen_pp_groups],
        "pos_embd": [[g[0]] for g in plan.gen_pp_groups],
        "micro_dp": lists(plan.micro_dp_groups),
        "tp_merge": [list(plan.tp_merge_ranks(r)) for r in range(world) if plan.tp_merge_ranks(r)[0] == r],
        "pp_merge": [list(plan.pp_merge_ranks(r)) for r in range(world) if plan.pp_merge_ranks(r)[0] == r],
    }


@dataclass
class GenerationGroups:
    """The groups one rank uses on the generation side of a reshard."""

    layout: Any  # hyflow.parallel.groups.ParallelGroups of the generation layout
    tp_merge: Any  # process group of the TP merge
    tp_merge_ranks: list[int]
    pp_merge: Any  # process group of the PP merge
    pp_merge_ranks: list[int]


def build_generation_groups(plan: ReshardPlan, rank: int, enums: dict | None = None,
                            experts: bool = False) -> GenerationGroups:
    """Create every generation group of ``plan`` (collective: every rank of the world calls it,
    in the same order) and return ``rank``'s. Through :mod:`hyflow.parallel.group_registry`: a
    layout group equal to another (the generation tp and the training tp at TP_g = TP, the
    generation mp and tp at PP_g=1, ...) is that group, singletons are the rank's self group; the
    merge groups are their own (their traffic is counted as ``reshard``). ``experts``: also the
    groups a mixture-of-experts generation model reads (EP_g = 1: :func:`hyflow.parallel.groups.build_groups`)."""
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from hyflow.parallel.groups import build_groups

    enums = enums or generation_enumerations(plan)
    tp_merge = group_registry.subgroups(enums["tp_merge"], purpose="reshard")
    pp_merge = group_registry.subgroups(enums["pp_merge"], purpose="reshard")
    comm.register_group(tp_merge, "reshard")
    comm.register_group(pp_merge, "reshard")
    tg, pg, dg = plan.gen_coord(rank)
    layout = build_groups(plan.gen,
                          {k: sorted(sorted(g) for g in enums[k]) for k in MEGATRON_KINDS},
                          coords={"tp": tg, "cp": 0, "dp": dg, "pp": pg}, experts=experts)
    return GenerationGroups(layout, tp_merge, list(plan.tp_merge_ranks(rank)),
                            pp_merge, list(plan.pp_merge_ranks(rank)))


def cp_micro_dp(plan, cp: int) -> list[list[int]]:
    """The micro-DP groups of the data plane. At ``cp > 1`` the reshard plan folds CP into DP (CP
    ranks hold the same weights: its data-parallel index is ``dp * cp + cp_rank``), so its micro-DP
    groups are per CP rank; the CP ranks of a training DP rank share its prompts, so their groups
    with the same generation TP / PP ranks become one group of ``cp`` times the replicas."""
    groups = generation_enumerations(plan)["micro_dp"]
    if cp == 1:
        return [list(g) for g in groups]
    merged: dict[tuple[int, int, int], list[int]] = {}
    for g in groups:
        folded = plan.train.coords(g[0])["dp"]
        tg, pg, _ = plan.gen_coord(g[0])
        merged.setdefault((folded // cp, tg, pg), []).extend(g)
    return [sorted(g) for g in merged.values()]


def build_micro_dp_group(plan: ReshardPlan, cp: int):
    """This rank's micro-DP group of the data plane (:func:`cp_micro_dp`; collective: every rank of
    the world calls it), its traffic counted as ``data``."""
    return group_registry.subgroups(cp_micro_dp(plan, cp), purpose="data")
