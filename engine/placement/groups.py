"""Process groups of a pooled placement: each pool's layout, on the pool's ranks (``Layout.start``).

Every pool runs one layout (the roles that share a pool share its tp/pp, checked by
:func:`pool_layouts`), so one set of rank partitions covers the world: per group kind, the
groups of every pool's layout, shifted to its ranks. :func:`build_pool_groups` creates them
(collectively, every rank in the same order) and returns this rank's
:class:`~hyflow.parallel.groups.ParallelGroups` for its own pool, with ``.pool_group``: all ranks
of its pool (the distributed optimizer's instance, so gradient norms and clipping cover the
pool's TP x PP x DP ranks; the supervisor's flags).

:func:`build_sync_group` creates the group the weight sync runs over (the actor's pool and the
generation pool), registered as ``reshard`` traffic with :mod:`hyflow.monitor.comm`.

NCCL creates a communicator on a group's first operation and every member must enter it. The
pools' first operations on the default group (the training lead's control message, rows to
their owners), on the sync group (ranks without buckets skip a round) and on pipeline groups
(point to point) involve some members only, so these groups are created eagerly
(:func:`hyflow.parallel.distributed.eager_init`) where they are made.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection

from hyflow.config import ConfigError
from hyflow.monitor import comm
from hyflow.parallel import group_registry
from hyflow.parallel.distributed import eager_init, rank_device
from hyflow.parallel.groups import ParallelGroups
from hyflow.parallel.layout import Layout
from hyflow.placement.config import ROLES, Placement, Pool

_KINDS = ("tp", "pp", "dp", "cp", "mp", "tp_cp", "dp_cp", "embd", "pos_embd")


def pool_layouts(placement: Placement) -> dict[str, Layout]:
    """Pool name -> the layout every role on it runs (a pool holding roles of two shapes is an error)."""
    out: dict[str, Layout] = {}
    owner: dict[str, str] = {}
    for role in ROLES:
        rp = placement.roles.get(role)
        if rp is None:
            continue
        have = out.get(rp.pool.name)
        if have is None:
            out[rp.pool.name], owner[rp.pool.name] = rp.layout, role
        elif (have.tp, have.pp, have.cp) != (rp.layout.tp, rp.layout.pp, rp.layout.cp):
            raise ConfigError(
                f"pool {rp.pool.name!r} holds the {owner[rp.pool.name]} (tp={have.tp} pp={have.pp}) and the {role} "
                f"(tp={rp.layout.tp} pp={rp.layout.pp}): the roles of one pool share one layout; give the "
                f"{role} a pool of its own or its layout null", key=f"placement.{role}")
    return out


def pool_enumerations(placement: Placement) -> dict[str, list[list[int]]]:
    """Group kind -> rank lists over the whole world (each pool's layout on its ranks)."""
    layouts = pool_layouts(placement)
    enums: dict[str, list[list[int]]] = {kind: [] for kind in _KINDS}
    for pool in placement.pools:
        layout = layouts[pool.name]
        for kind in _KINDS:
            enums[kind] += layout.groups(kind)
    return enums


#: Megatron-Core's expert-grid group kind -> :meth:`Layout.expert_groups`' kind
_EXPERT_KINDS = {"ep": "ep", "expt_tp": "etp", "expt_dp": "edp", "tp_ep": "tp_ep", "tp_ep_pp": "tp_ep_pp"}


def pool_expert_enumerations(placement: Placement) -> dict[str, list[list[int]]]:
    """Megatron's expert groups of every pool's layout over the world (dense pools and generation
    layouts: ep = 1, each rank its own EP group, expert TP = TP), and ``tp_dp_cp``: the ranks of one
    pipeline stage (the router's load-balancing statistics)."""
    layouts = pool_layouts(placement)
    enums: dict[str, list[list[int]]] = {kind: [] for kind in [*_EXPERT_KINDS, "tp_dp_cp"]}
    for pool in placement.pools:
        layout = layouts[pool.name]
        for kind, theirs in _EXPERT_KINDS.items():
            enums[kind] += layout.expert_groups(theirs)
        enums["tp_dp_cp"] += layout.groups("tp_dp_cp")
    return enums


def build_pool_groups(placement: Placement, backend: Optional[str] = None):
    """This rank's :class:`~hyflow.parallel.groups.ParallelGroups` on its pool (collective: every rank
    calls it). ``coords`` are the rank's coordinates inside its pool's layout; ``.pool`` is added."""
    if dist.get_world_size() != placement.world:
        raise ConfigError(f"the placement covers {placement.world} ranks but {dist.get_world_size()} were launched")
    rank, device = dist.get_rank(), rank_device()
    eager_init(dist.group.WORLD, device)  # control messages and rows: the lead and other pools only
    pgs = ProcessGroupCollection()
    for kind, ranks in pool_enumerations(placement).items():
        group = group_registry.subgroups(ranks, backend=backend)
        setattr(pgs, kind, group)
        if kind == "pp":  # pipeline sends and receives between neighbouring stages
            eager_init(group, device)
    pgs.intra_dp_cp = pgs.dp_cp
    # The expert grid of each pool's layout (MoE layers; dense models' DDP and optimizer still ask
    # for these groups: there ep = 1 and the others equal the dense ones).
    for kind, ranks in pool_expert_enumerations(placement).items():
        setattr(pgs, kind, group_registry.subgroups(ranks, backend=backend))
    pgs.intra_expt_dp = pgs.expt_dp
    pool_group = group_registry.subgroups([list(p.ranks) for p in placement.pools], backend=backend, purpose="pool")
    eager_init(pool_group, device)
    # The distributed optimizer's instance is the whole pool: its gradient norm (hence clipping)
    # is reduced over this group (Megatron's grad_stats_parallel_group), not over DP alone.
    pgs.intra_dist_opt = pool_group
    comm.register_collection(pgs)
    _install_megatron_globals(pgs, pool_enumerations(placement), dist.get_rank())
    if ps._GLOBAL_MEMORY_BUFFER is None:
        # Megatron's attention takes scratch from this process-wide buffer even when every group is
        # passed explicitly (initialize_model_parallel makes it; pools do not call that).
        ps._set_global_memory_buffer()
    pool = placement.pool_of(rank)
    layout = pool_layouts(placement)[pool.name]
    groups = ParallelGroups(layout=layout, pgs=pgs, rank=rank, coords=layout.coords(rank),
                            device=device)
    groups.pool = pool  # type: ignore[attr-defined]
    groups.pool_group = pool_group  # type: ignore[attr-defined]
    return groups


def _install_megatron_globals(pgs, enums: dict[str, list[list[int]]], rank: int) -> None:
    """Make this rank's pool groups Megatron's global state (every rank lives in one pool, so each
    rank's globals are well defined). hyflow passes groups explicitly; this is for the Megatron
    code that still reads the globals (its vocab-parallel cross entropy, used by the SFT warm-up)."""
    def mine(kind: str) -> list[int]:
        return next(g for g in enums[kind] if rank in g)

    for group_attr, ranks_attr, kind in (
            ("_TENSOR_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "tp"),
            ("_PIPELINE_MODEL_PARALLEL_GROUP", "_PIPELINE_GLOBAL_RANKS", "pp"),
            ("_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GLOBAL_RANKS", "dp"),
            ("_DATA_PARALLEL_GROUP_WITH_CP", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "dp_cp"),
            ("_CONTEXT_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GLOBAL_RANKS", "cp"),
            ("_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GLOBAL_RANKS", "mp"),
            ("_TENSOR_AND_CONTEXT_PARALLEL_GROUP", None, "tp_cp")):
        setattr(ps, group_attr, getattr(pgs, kind))
        if ranks_attr:
            setattr(ps, ranks_attr, mine(kind))
    embd = [g for g in enums["embd"] if rank in g]
    pos = [g for g in enums["pos_embd"] if rank in g]
    ps._EMBEDDING_GROUP, ps._EMBEDDING_GLOBAL_RANKS = (pgs.embd, embd[0]) if embd else (None, None)
    ps._POSITION_EMBEDDING_GROUP, ps._POSITION_EMBEDDING_GLOBAL_RANKS = (pgs.pos_embd, pos[0]) if pos else (None, None)


def build_sync_group(src: Pool, dst: Pool, backend: Optional[str] = None):
    """The group of the weight sync from ``src`` to ``dst`` (collective: every rank calls it; its
    communicator is created here, as ranks without buckets skip rounds of the sync)."""
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    group = group_registry.group(ranks, backend=backend, purpose="reshard")
    if dist.get_rank() in ranks:
        eager_init(group, rank_device())
        comm.register_group(group, "reshard")
    return group


@contextmanager
def optimizer_agreement_on(pool):
    """Megatron's optimizer set-up agrees on its parameter groups with ``all_gather_object`` over the
    default group (once per optimizer, not on the step's path); on a pool that agreement is the
    pool's: the call is routed to ``pool`` (a group) and the other ranks' entries left empty."""
    original = dist.all_gather_object

    def gather(out, obj, group=None):
        if group is not None or pool is None:
            return original(out, obj, group=group)
        part = [None] * pool.size()
        original(part, obj, group=pool)
        out[:] = part + [[] for _ in range(len(out) - len(part))]

    dist.all_gather_object = gather
    try:
        yield
    finally:
        dist.all_gather_object = original
