"""Process groups of a plan: enumerations for all ranks, real groups for sample ranks.

Enumerations are pure arithmetic (:meth:`Layout.groups`, the hybrid planner's generation
groups), so they are produced for every rank of a 1024-rank job in milliseconds. To check
that they are the groups the engine really creates, :func:`verify_rank` starts a *fake*
``torch.distributed`` world in this one process (``backend="fake"`` with a ``FakeStore``:
collectives are no-ops, group creation is real), pretends to be one rank, creates the training
groups (Megatron's ``initialize_model_parallel`` through hyflow's registry), the generation groups
and the data plane's micro-DP groups exactly as a job would, compares the groups that rank ends up
in with the enumerations and counts the ``new_group`` calls it made (:func:`counting_new_group`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyflow.hybrid.generation_groups import MEGATRON_KINDS, build_generation_groups, build_micro_dp_group
from hyflow.hybrid.reshard_plan import ReshardPlan
from hyflow.hybrid.reshard_table import rank_plan
from hyflow.monitor import comm
from hyflow.parallel.group_registry import initialize_megatron_groups
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
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without an initialised process group")
    dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        # Megatron (seconds) only when this runs: `hyflow --help` imports this module
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        comm.forget_groups()  # the fake groups registered while pretending
        dist.destroy_process_group()


def _member_groups() -> int:
    """Process groups this rank is a member of (torch registers only those)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return len(getattr(world, "pg_names", {}) or {})


@dataclass
class GroupCalls:
    """``new_group`` calls made inside :func:`counting_new_group` (non-member calls included: in
    torch's default mode every rank makes every call) and how many asked for gloo."""

    calls: int = 0
    gloo: int = 0


@contextlib.contextmanager
def counting_new_group() -> Iterator[GroupCalls]:
    """Count ``torch.distributed.new_group`` calls (from Megatron, torch's
    ``new_subgroups_by_enumeration`` and hyflow alike). In a fake world a gloo group is counted and
    created on the fake backend (which cannot host gloo)."""
    counted = GroupCalls()
    original = c10d.new_group
    fake = dist.get_backend() == "fake"

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        counted.calls += 1
        if backend is not None and "gloo" in str(backend):
            counted.gloo += 1
            if fake:
                backend = None
        return original(ranks, timeout, backend, *args, **kwargs)

    dist.new_group = c10d.new_group = new_group
    try:
        yield counted
    finally:
        dist.new_group = c10d.new_group = original


@dataclass
class RankCheck:
    """What the fake world showed for one rank: the groups it is in and the ``new_group`` calls it
    made to create them (:mod:`hyflow.parallel.group_registry`: each distinct group once)."""

    rank: int
    training_calls: int = 0
    generation_calls: int = 0
    training_groups: int = 0  # distinct groups this rank is a member of
    generation_groups: int = 0
    megatron: dict[str, list[int]] = field(default_factory=dict)
    generation: dict[str, list[int]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)


def _megatron_groups() -> dict[str, list[int]]:
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
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
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from megatron.core import parallel_state as ps

    getters = {"ep": ps.get_expert_model_parallel_group, "etp": ps.get_expert_tensor_parallel_group,
               "edp": ps.get_expert_data_parallel_group, "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
               "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group}
    return {kind: sorted(dist.get_process_group_ranks(get())) for kind, get in getters.items()}


def verify_rank(layout: Layout, rank: int, plan: Optional[ReshardPlan] = None,
                train_enums: Optional[dict] = None, gen_enums: Optional[dict] = None,
                experts: bool = False) -> RankCheck:
    """Create, in a fake world, every group ``rank`` would create and compare.

    Training: Megatron's ``initialize_model_parallel`` through hyflow's group registry
    (:func:`hyflow.parallel.group_registry.initialize_megatron_groups`, what
    :func:`hyflow.parallel.groups.init_training_groups` runs).
    Generation (when ``plan`` is given): :func:`hyflow.hybrid.generation_groups.build_generation_groups`
    and the data plane's micro-DP groups, as the hybrid engine and the dispatcher create them.
    ``experts``: a mixture-of-experts model (its expert groups are compared with
    :meth:`Layout.expert_groups`, and the generation groups include the MoE ones).
    """
    check = RankCheck(rank=rank)
    train_enums = train_enums or layout_enumerations(layout)
    with fake_world(rank, layout.world_size), counting_new_group() as counted:
        before = _member_groups()
        initialize_megatron_groups(layout)  # exactly as init_training_groups does
        check.training_calls, check.training_groups = counted.calls, _member_groups() - before
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
            before = _member_groups()
            created = build_generation_groups(plan, rank, gen_enums, experts=experts)  # exactly as the engine does
            micro_dp = build_micro_dp_group(plan, layout.cp)  # as the dispatcher does
            check.generation_calls = counted.calls - check.training_calls
            check.generation_groups = _member_groups() - before
            for kind in ("tp", "pp", "dp"):
                check.generation[kind] = sorted(dist.get_process_group_ranks(getattr(created.layout.pgs, kind)))
            check.generation["tp_merge"] = sorted(dist.get_process_group_ranks(created.tp_merge))
            check.generation["pp_merge"] = sorted(dist.get_process_group_ranks(created.pp_merge))
            check.generation["micro_dp"] = sorted(dist.get_process_group_ranks(micro_dp))
            rp = rank_plan(plan, rank)
            expected = {"tp": rp.gen_tp_group, "pp": rp.gen_pp_group,
                        "dp": next(g for g in plan.gen_dp_groups if rank in g),
                        "tp_merge": plan.tp_merge_ranks(rank), "pp_merge": plan.pp_merge_ranks(rank),
                        "micro_dp": rp.micro_dp_group if layout.cp == 1 else check.generation["micro_dp"]}
            for kind, want in expected.items():
                if check.generation[kind] != sorted(want):
                    check.mismatches.append(f"rank {rank}: generation {kind} group "
                                            f"{check.generation[kind]} != planner's {sorted(want)}")
    return check
