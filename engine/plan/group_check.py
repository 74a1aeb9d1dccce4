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

from hyflow.hybrid.generation_groups import MEGATRON_KINDS, build_generation_groups
from hyflow.hybrid.reshard_plan import ReshardPlan
from hyflow.hybrid.reshard_table import rank_plan
from hyflow.parallel.layout import Layout


def layout_enumerations(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of every kind of a training layout."""
    return {kind: layout.groups(kind) for kind in MEGATRON_KINDS}


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


def _megatron_expert_groups() -> dict[str, list[int]]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    getters = {"ep": ps.get_expert_model_parallel_group, "etp": ps.get_expert_tensor_parallel_group,
               "edp": ps.get_expert_data_parallel_group, "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
               "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group}
    return {kind: sorted(dist.get_process_group_ranks(get())) for kind, get in getters.items()}


def verify_rank(layout: Layout, rank: int, plan: Optional[ReshardPlan] = None,
                train_enums: Optional[dict] = None, gen_enums: Optional[dict] = None,
                experts: bool = False) -> RankCheck:
    """Create, in a fake world, every group ``rank`` would create and compare.

    Training: Megatron's ``initialize_model_parallel`` (as :func:`init_training_groups` calls
    it; gloo side groups off since the fake backend cannot host them). Generation (when
    ``plan`` is given): :func:`hyflow.hybrid.generation_groups.build_generation_groups`, the function
    the hybrid engine calls. ``experts``: a mixture-of-experts model (its expert groups are
    compared with :meth:`Layout.expert_groups`, and the generation groups include the MoE ones).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    check = RankCheck(rank=rank)
    train_enums = train_enums or layout_enumerations(layout)
    with fake_world(rank, layout.world_size):
        before = _group_count()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
            order="tp-cp-ep-dp-pp", create_gloo_process_groups=False)
        check.megatron_groups_created = _group_count() - before
        check.megatron = _megatron_groups()
        if experts:
            expert = _megatron_expert_groups()
            for kind, ranks in expert.items():
                check.megatron["expert_" + kind] = ranks
                train_enums = dict(train_enums, **{"expert_" + kind: layout.expert_groups(kind)})
        for kind, ranks in check.megatron.items():
            mine = [g for g in train_enums[kind] if rank in g]
            if mine != [ranks]:
                check.mismatches.append(
                    f"rank {rank}: Megatron's {kind} group {ranks} != layout's {mine}")
        if plan is not None:
            before = _group_count()
            created = build_generation_groups(plan, rank, gen_enums, experts=experts)  # exactly as the engine does
            check.generation_groups_created = _group_count() - before
            for kind in ("tp", "pp", "dp"):
                check.generation[kind] = sorted(dist.get_process_group_ranks(getattr(created.layout.pgs, kind)))
            check.generation["tp_merge"] = sorted(dist.get_process_group_ranks(created.tp_merge))
            check.generation["pp_merge"] = sorted(dist.get_process_group_ranks(created.pp_merge))
            rp = rank_plan(plan, rank)
            check.generation["micro_dp"] = sorted(rp.micro_dp_group)  # enumerated: no engine group
            expected = {"tp": rp.gen_tp_group, "pp": rp.gen_pp_group,
                        "dp": next(g for g in plan.gen_dp_groups if rank in g),
                        "tp_merge": plan.tp_merge_ranks(rank), "pp_merge": plan.pp_merge_ranks(rank)}
            for kind, want in expected.items():
                if check.generation[kind] != sorted(want):
                    check.mismatches.append(f"rank {rank}: generation {kind} group "
                                            f"{check.generation[kind]} != planner's {sorted(want)}")
    return check
