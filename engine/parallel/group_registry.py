"""Process-group creation for the whole job: each distinct set of ranks once.

torch's ``new_group`` in its default mode must be entered by every rank of the world for every
group, members or not (group names come from a call counter), and each member builds a backend for
it (gloo connects a full mesh eagerly unless ``TORCH_GLOO_LAZY_INIT=1``). At 1024 ranks (TP8 x PP4
x DP32, generation TP_g=4) Megatron's ``initialize_model_parallel``, the hybrid engine's
generation groups and the data plane's micro-DP groups made 9,265 calls per rank, most of them for
a group equal to another (Megatron's tp / tp_cp / expt_tp / tp_ep, dp / dp_cp / expt_dp, mp /
tp_ep_pp, the generation layout's model-parallel groups and its tp) or of one rank (cp, ep,
pos_embd, the generation pp at PP_g=1: 1024 groups each). hyflow creates every group through
:func:`group` / :func:`subgroups`, and at that shape a rank makes 1,866 calls:

* one group per distinct (sorted ranks, backend, purpose): a kind whose ranks equal another's
  shares its group (same members, so NCCL's rule that a group's first operation is entered by all
  its members holds as before). ``purpose`` keeps apart groups whose traffic is told apart by group
  (:mod:`hyflow.monitor.comm_groups`: the reshard's merge groups, the data plane's micro-DP groups)
  from a layout's groups of the same ranks;
* a group of one rank is this rank's *self group* (one per purpose), made once: group-local (torch's
  ``use_local_synchronization``: no other rank takes part), or, when the default group is bound to
  a device (NCCL then splits every communicator from it and every rank must enter each split), one
  collective enumeration of all ranks' singletons.

Every rank still calls in the same order (the enumerations are the same on every rank), so the
calls that remain stay collective. ``hyflow.plan.group_check.verify_rank`` counts them in a fake
world (:func:`hyflow.plan.group_check.counting_new_group`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch.distributed as dist

from hyflow.parallel.distributed import group_timeout

__all__ = ["group", "subgroups", "megatron_groups_shared", "initialize_megatron_groups"]

_cache: dict[tuple[tuple[int, ...], Optional[str], Optional[str]], object] = {}
_self_group: dict[tuple[Optional[str], Optional[str]], object] = {}
_members: list = []  # the cached groups this rank is in
_world: list = [None]  # the default group the cache belongs to


def _check_world() -> None:
    """Forget every cached group when the world changed or one of this rank's groups was destroyed
    (the multi-rank test harness destroys a task's groups on every rank at once): all ranks then
    create the same groups again, in the same order."""
    default = dist.distributed_c10d._get_default_group()
    live = dist.distributed_c10d._world.pg_map
    if _world[0] is not default or any(g not in live for g in _members):
        _cache.clear()
        _self_group.clear()
        _members.clear()
        _world[0] = default


def _self(backend: Optional[str], purpose: Optional[str], **options):
    key = (backend, purpose)
    if key not in _self_group:
        rank = dist.get_rank()
        if dist.distributed_c10d._get_default_group().bound_device_id is None:
            _self_group[key] = dist.new_group([rank], backend=backend, use_local_synchronization=True,
                                              group_desc="hyflow_self", **options)
        else:
            mine, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())],
                                                        backend=backend, group_desc="hyflow_self", **options)
            _self_group[key] = mine
        _members.append(_self_group[key])
    return _self_group[key]


def group(ranks: Sequence[int], backend: Optional[str] = None, purpose: Optional[str] = None, **options):
    """The process group of ``ranks`` (``dist.GroupMember.NON_GROUP_MEMBER`` on other ranks);
    collective: every rank calls it with the same arguments, in the same order. ``purpose``: see the
    module docstring (None: a layout's group). ``options`` (``timeout``, ``pg_options``,
    ``group_desc``) apply when the group is first created."""
    _check_world()
    members = tuple(sorted(int(r) for r in ranks))
    if len(members) == 1:
        return _self(backend, purpose, **{k: v for k, v in options.items() if k == "timeout"}) \
            if members[0] == dist.get_rank() else dist.GroupMember.NON_GROUP_MEMBER
    key = (members, backend, purpose)
    if key not in _cache:
        _cache[key] = dist.new_group(list(members), backend=backend, **options)
        if dist.get_rank() in members:
            _members.append(_cache[key])
    return _cache[key]


def subgroups(enumeration: Sequence[Sequence[int]], backend: Optional[str] = None, purpose: Optional[str] = None,
              **options):
    """This rank's group of a partition ``enumeration`` (None when it is in none of them), like
    ``dist.new_subgroups_by_enumeration`` but through :func:`group`."""
    mine = None
    rank = dist.get_rank()
    for ranks in enumeration:
        g = group(ranks, backend, purpose, **options)
        if rank in ranks:
            mine = g
    return mine


@contextlib.contextmanager
def megatron_groups_shared() -> Iterator[None]:
    """Route Megatron-Core's group creation (``parallel_state.create_group``, which
    ``initialize_model_parallel`` calls for every group of every kind) through :func:`group`."""
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from megatron.core import parallel_state

    original = parallel_state.create_group

    def create_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                     group_desc=None):
        options = {k: v for k, v in (("timeout", timeout), ("pg_options", pg_options), ("group_desc", group_desc))
                   if v is not None}
        ranks = list(range(dist.get_world_size())) if ranks is None else ranks
        made = group(ranks, backend, **options)
        if dist.get_rank() in ranks:  # Megatron's own bookkeeping (its timeout updates walk it)
            if parallel_state._global_process_group_list is None:
                parallel_state._global_process_group_list = [None]
            parallel_state._global_process_group_list.append(made)
        return made

    parallel_state.create_group = create_group
    try:
        yield
    finally:
        parallel_state.create_group = original


def initialize_megatron_groups(layout) -> None:
    """Megatron-Core's global parallel state for ``layout`` (a :class:`~hyflow.parallel.layout.Layout`)
    with its groups from this registry and no gloo side groups (hyflow's optimizer and checkpoint
    formats never use them: ``fully_reshardable`` gathers over the device group). What
    :func:`hyflow.parallel.groups.init_training_groups` runs, and ``hyflow plan``'s group check."""
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    with megatron_groups_shared():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expert_tp,
            order="tp-cp-ep-dp-pp",
            create_gloo_process_groups=False,
            distributed_timeout_minutes=group_timeout().total_seconds() / 60,  # trainer.collective_timeout_s
        )
