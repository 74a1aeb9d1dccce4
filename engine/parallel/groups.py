"""Process groups built from a :class:`~hyflow.parallel.layout.Layout`.

Two entry points:

* :func:`init_training_groups` installs a layout as Megatron-Core's global
  ``parallel_state`` (Megatron's optimizer, DDP and checkpointing still read
  those globals in 0.16) and returns the same groups as a
  :class:`ParallelGroups` object that hyflow passes explicitly.
* :func:`build_groups` creates a second, independent set of groups for another
  layout over the same ranks (the actor's generation layout), or for any explicit
  rank enumeration, without touching the globals.

Both must be called by every rank in the same order (group creation is collective). Both create
groups through :mod:`hyflow.parallel.group_registry` (each distinct set of ranks once, a rank's
singletons as one self group; no Megatron gloo side groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from hyflow.monitor import comm
from hyflow.parallel import group_registry
from hyflow.parallel.distributed import rank_device
from hyflow.parallel.layout import Layout, LayoutError

_KINDS = ("tp", "pp", "dp", "cp", "mp", "tp_cp", "dp_cp", "embd", "pos_embd")


@dataclass
class ParallelGroups:
    """A layout together with this rank's process groups for it.

    Attributes:
        layout: the layout the groups realise.
        pgs: Megatron's ``ProcessGroupCollection`` (pass as ``pg_collection``).
        rank: this process's global rank.
        coords: this rank's coordinates in the layout (tp, cp, dp, pp).
        device: where this rank's models, batches and collective buffers live
            (``cuda:LOCAL_RANK`` or ``cpu``; :func:`hyflow.parallel.distributed.rank_device`).
    """

    layout: Layout
    pgs: ProcessGroupCollection
    rank: int
    coords: dict
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank (0 without an expert-parallel group)."""
        group = getattr(self.pgs, "ep", None)
        return group.rank() if group is not None else 0

    @property
    def etp_rank(self) -> int:
        """This rank's expert tensor-parallel rank (its TP rank without an expert grid)."""
        group = getattr(self.pgs, "expt_tp", None)
        return group.rank() if group is not None else self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1


def _require_dist() -> int:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; start hyflow through `hyflow train` / "
            "torchrun, or call hyflow.parallel.distributed.init_distributed() first"
        )
    return dist.get_world_size()


def init_training_groups(layout: Layout, seed: int = 1234) -> ParallelGroups:
    """Make ``layout`` Megatron's global parallel state and return its groups.

    Also seeds Megatron's model-parallel RNG tracker (``seed``; TP ranks get
    distinct streams), which Megatron's layers need before they are built.
    """
    layout.check_world(_require_dist())
    group_registry.initialize_megatron_groups(layout)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    comm.register_collection(pgs)  # collectives over these groups are charged to dp / tp / pp / ...
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    rank = dist.get_rank()
    return ParallelGroups(layout=layout, pgs=pgs, rank=rank, coords=layout.coords(rank), device=rank_device())


def build_groups(layout: Layout, enumerations: Optional[dict[str, list[list[int]]]] = None,
                 backend: Optional[str] = None, coords: Optional[dict[str, int]] = None,
                 experts: bool = False) -> ParallelGroups:
    """Create fresh process groups for ``layout`` without touching Megatron's globals.

    ``enumerations`` overrides the rank lists of any kind (``tp``, ``pp``, ``dp``,
    ...); by default they come from :meth:`Layout.groups`. The hybrid engine passes
    its own enumerations for the generation layout (strided TP groups) together with
    this rank's ``coords`` in that layout (default: :meth:`Layout.coords`).

    ``experts``: also the groups Megatron-Core's MoE layers read (:func:`_add_expert_groups`).
    """
    world = _require_dist()
    layout.check_world(world)
    enumerations = dict(enumerations or {})
    rank = dist.get_rank()
    pgs = ProcessGroupCollection()
    for kind in _KINDS:
        ranks = enumerations.get(kind) or layout.groups(kind)
        _check_partition(kind, ranks, world)
        setattr(pgs, kind, group_registry.subgroups(ranks, backend=backend))
    pgs.intra_dp_cp = pgs.dp_cp
    if experts:
        _add_expert_groups(pgs, layout, enumerations, world, backend)
    comm.register_collection(pgs)
    return ParallelGroups(layout=layout, pgs=pgs, rank=rank, coords=coords or layout.coords(rank),
                          device=rank_device())


def _add_expert_groups(pgs: ProcessGroupCollection, layout: Layout, enumerations: dict[str, list[list[int]]],
                       world: int, backend: Optional[str]) -> None:
    """The MoE groups of a layout without an expert grid of its own (ep=1, etp=tp: every rank holds
    all experts, split like its dense layers; the hybrid engine's generation layout): expert TP is
    the TP group, expert DP the DP group, and the EP group each rank alone. ``tp_dp_cp`` (the
    router's aux-loss statistics) is a pipeline stage's ranks, read off the PP groups (members in
    stage order)."""
    if layout.has_experts_split:
        raise LayoutError(f"build_groups creates expert groups for ep=1, etp=tp only (got {layout.describe()}); "
                          "training layouts get theirs from init_training_groups")
    pgs.expt_tp, pgs.tp_ep, pgs.expt_dp, pgs.intra_expt_dp, pgs.tp_ep_pp = pgs.tp, pgs.tp, pgs.dp, pgs.dp, pgs.mp
    pgs.ep, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)], backend=backend)
    pp_groups = [sorted(g) for g in (enumerations.get("pp") or layout.groups("pp"))]
    stages = [sorted(g[k] for g in pp_groups) for k in range(layout.pp)]
    pgs.tp_dp_cp, _ = dist.new_subgroups_by_enumeration(stages, backend=backend)


def _check_partition(kind: str, groups: list[list[int]], world: int) -> None:
    seen = sorted(r for g in groups for r in g)
    if kind in ("embd", "pos_embd"):
        return  # these cover a subset of ranks
    if seen != list(range(world)):
        raise LayoutError(
            f"{kind} groups {groups} do not cover each of the {world} ranks exactly once"
        )
