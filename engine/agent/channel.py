"""How a generation replica's ranks agree on what its environments answered.

Every rank of a generation replica (its TP x PP ranks) runs the same engine calls in lockstep, so
they all need the same contexts; but tools and environments run once per replica, on its leader
(generation TP rank 0 of pipeline stage 0): they are not deterministic (timeouts, games with
state, side effects) and running them on every rank would multiply their cost. The leader packs
what the environments answered into one int64 and one float64 tensor and broadcasts them over the
replica's TP group, then its PP group (two sizes, two payloads per group: nothing pickled).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


class ReplicaChannel:
    """The leader's ``share(ints, floats)`` reaches every rank of the replica.

    ``groups``: the replica's groups to broadcast over, in order (generation TP, then PP); groups
    of size 1 and None are skipped (a one-rank replica shares nothing).
    """

    def __init__(self, groups: Sequence[Optional[dist.ProcessGroup]] = (), device: Optional[torch.device] = None):
        self.groups = [g for g in groups if g is not None and g.size() > 1]
        self.device = device or torch.device("cpu")
        self.leader = all(g.rank() == 0 for g in self.groups)

    def share(self, ints: Sequence[int], floats: Sequence[float]) -> tuple[list[int], list[float]]:
        """The leader's lists on every rank (the others' arguments are ignored)."""
        if not self.groups:
            return list(ints), list(floats)
        sizes = torch.tensor([len(ints), len(floats)], dtype=torch.long, device=self.device)
        self._broadcast(sizes)
        n_int, n_float = sizes.tolist()
        ti = torch.tensor(list(ints), dtype=torch.long, device=self.device) if self.leader \
            else torch.empty(n_int, dtype=torch.long, device=self.device)
        tf = torch.tensor(list(floats), dtype=torch.float64, device=self.device) if self.leader \
            else torch.empty(n_float, dtype=torch.float64, device=self.device)
        self._broadcast(ti)
        self._broadcast(tf)
        return ti.tolist(), tf.tolist()

    def _broadcast(self, t: torch.Tensor) -> None:
        # TP first (stage 0's TP ranks get it from its leader), then every PP group from its stage 0.
        for group in self.groups:
            if t.numel():
                dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
