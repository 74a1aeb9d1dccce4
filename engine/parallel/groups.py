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
                 backend: Optional[str] = None, coords: Optional[dict[str, int]] = None) -> ParallelGroups:
    """Create fresh process groups for ``layout`` without touching Megatron's globals.

    ``enumerations`` overrides the rank lists of any kind (``tp``, ``pp``, ``dp``,
    ...); by default they come from :meth:`Layout.groups`. The hybrid engine passes
    its own enumerations for the generation layout (strided TP groups) together with
    this rank's ``coords`` in that layout (default: :meth:`Layout.coords`).
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
    comm.register_collection(pgs)
    return ParallelGroups(layout=layout, pgs=pgs, rank=rank, coords=coords or layout.coords(rank),
                          device=rank_device())


def _check_partition(kind: str, groups: list[list[int]], world: int) -> None:
    seen = sorted(r for g in groups for r in g)
    if kind in ("embd", "pos_embd"):
        return  # these cover a subset of ranks
    if seen != list(range(world)):
        raise LayoutError(
            f"{kind} groups {groups} do not cover each of the {world} ranks exactly once"
        )
