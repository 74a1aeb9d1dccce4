"""Process groups of a plan: enumerations for all ranks, real groups for sample ranks.

Enumerations are pure arithmetic (:meth:`Layout.groups`, the hybrid planner's generation
groups), so they are produced for every rank of a 1024-rank job in milliseconds. To check
that they are the groups the engine really creates, :func:`verify_rank` starts a *fake*
``torch.distributed`` world in this one process (``backend="fake"`` with a ``FakeStore``:
collectives are no-ops, group creation is real), pretends to be one rank, runs Megatron's
``initialize_model_parallel`` and hyflow's generation-group construction exactly as a job
would, and compares the groups that rank ends up in with the enumerations.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from hyflow.hybrid.planner import ReshardPlan, generation_enumerations  # noqa: F401 (re-exported)
from hyflow.parallel.layout import Layout

#: Kinds of training groups Megatron creates (and hyflow's ``ParallelGroups`` carries).
KINDS = ("tp", "pp", "dp", "cp", "mp", "tp_cp", "dp_cp", "embd", "pos_embd")


def layout_enumerations(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of every kind of a training layout."""
    return {kind: layout.groups(kind) for kind in KINDS}


def _lists(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(g) for g in groups]


def digest(groups: Sequence[Sequence[int]]) -> str:
    """Short, order-independent fingerprint of a group enumeration."""
    canon = sorted(sorted(int(r) for r in g) for g in groups)
    return hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()[:16]


def summarize(enums: dict[str, list[list[int]]]) -> dict[str, dict]:
    """Per kind: number of groups, group size, first group and digest (for reports / JSON)."""
    out = {}
    for kind, groups in enums.items():
        sizes = sorted({len(g) for g in groups})
        out[kind] = {"count": len(groups), "size": sizes[0] if len(sizes) == 1 else sizes,
                     "first": sorted(groups[0]) if groups else [], "digest": digest(groups)}
    return out


def check_partition(kind: str, groups: Sequence[Sequence[int]], world: int) -> Optional[str]:
    """An error message unless ``groups`` cover each of ``world`` ranks exactly once."""
    if kind in ("embd", "pos_embd"):
        return None
    seen = sorted(r for g in groups for r in g)
    if seen != list(range(world)):
        return f"{kind} groups do not cover each of the {world} ranks exactly once"
    return None


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """A ``torch.distributed`` default group of ``world_size`` in which this process is
    ``rank``, with no communication (``backend="fake"``)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without an initialised process group")
    dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _group_count() -> int:
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    return len(getattr(world, "pg_names", {}) or {})


@dataclass
class RankCheck:
    """What the fake world showed for one rank."""

    rank: int
    megatron_groups_created: int = 0
    generation_groups_created: int = 0
    megatron: dict[str, list[int]] = field(default_factory=dict)
    generation: dict[str, list[int]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)


def _megatron_groups() -> dict[str, list[int]]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    getters = {
        "tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
        "dp": lambda: ps.get_data_parallel_group(with_context_parallel=False),
        "cp": ps.get_context_parallel_group, "mp": ps.get_model_parallel_group,
        "tp_cp": ps.get_tensor_and_context_parallel_group,
        "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "embd": lambda: ps.get_embedding_group(check_initialized=False),
        "pos_embd": lambda: ps.get_position_embedding_group(check_initialized=False),
    }
    out = {}
    for kind, get in getters.items():
        group = get()
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            out[kind] = sorted(dist.get_process_group_ranks(group))
    return out


def verify_rank(layout: Layout, rank: int, plan: Optional[ReshardPlan] = None,
                train_enums: Optional[dict] = None, gen_enums: Optional[dict] = None) -> RankCheck:
    """Create, in a fake world, every group ``rank`` would create and compare.

    Training: Megatron's ``initialize_model_parallel`` (as :func:`init_training_groups` calls
    it; gloo side groups off since the fake backend cannot host them). Generation (when
    ``plan`` is given): :func:`hyflow.parallel.groups.build_groups` with the planner's
    enumerations plus the merge groups, as the hybrid engine does.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hyflow.parallel.groups import ParallelGroups, build_groups

    check = RankCheck(rank=rank)
    train_enums = train_enums or layout_enumerations(layout)
    with fake_world(rank, layout.world_size):
        before = _group_count()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep, order="tp-cp-ep-dp-pp",
            create_gloo_process_groups=False)
        check.megatron_groups_created = _group_count() - before
        check.megatron = _megatron_groups()
        for kind, ranks in check.megatron.items():
            mine = [g for g in train_enums[kind] if rank in g]
            if mine != [ranks]:
                check.mismatches.append(
                    f"rank {rank}: Megatron's {kind} group {ranks} != layout's {mine}")
        if plan is not None:
            gen_enums = gen_enums or generation_enumerations(plan)
            before = _group_count()
            tg, pg, dg = plan.gen_coord(rank)
            gen_layout = Layout(tp=plan.gen.tp, pp=plan.gen.pp, dp=plan.gen_dp_size)
            groups: ParallelGroups = build_groups(
                gen_layout, {k: v for k, v in gen_enums.items() if k in KINDS},
                coords={"tp": tg, "cp": 0, "dp": dg, "pp": pg})
            for kind in ("micro_dp", "tp_merge", "pp_merge"):
                group, _ = dist.new_subgroups_by_enumeration(gen_enums[kind])
                check.generation[kind] = sorted(dist.get_process_group_ranks(group))
            check.generation_groups_created = _group_count() - before
            for kind in ("tp", "pp", "dp"):
                check.generation[kind] = sorted(dist.get_process_group_ranks(getattr(groups.pgs, kind)))
            rp = plan.rank_plan(rank)
            expected = {"tp": rp.gen_tp_group, "pp": rp.gen_pp_group, "micro_dp": rp.micro_dp_group,
                        "dp": next(g for g in plan.gen_dp_groups if rank in g)}
            for kind, want in expected.items():
                if check.generation[kind] != sorted(want):
                    check.mismatches.append(f"rank {rank}: generation {kind} group "
                                            f"{check.generation[kind]} != planner's {sorted(want)}")
    return check
