"""NCCL's rule for a process group's first operation, checked on gloo.

NCCL creates a group's communicator lazily, in the group's first operation on a device tensor,
and every member of the group must enter that operation: a first operation that only some
members enter (a batched send/receive between two of them, a control message from one rank to
some others) hangs on NCCL, while gloo, which connects a group when it is created, runs it. So a
CPU run cannot show that hang; :class:`FirstOps` records instead, on each rank, the first
communicator-creating operation on every group (collectives and ``batch_isend_irecv``; plain
``send``/``recv`` use a pairwise communicator of their own, pickled-object collectives and
barriers run on gloo on GPU machines too), and :func:`first_op_problems` says which groups a
NCCL run could not start: a member that never entered an operation on a group others used, a
first operation that is a batched send/receive among some members only (a control message from
the training lead to the generation ranks on the default group), or members whose first
operations differ. Use it around a multi-rank run::

    with FirstOps() as ops:
        run_the_job()
    return ops.first                      # per rank; then, in the test process:
    assert first_op_problems(per_rank) == []
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hyflow.monitor.comm import patch_everywhere, unpatch

#: operations that create the group's communicator (on a device tensor)
CREATING = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
            "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
            "gather", "scatter", "batch_isend_irecv")
#: operations whose nested calls are not the group's first operation on NCCL (gloo on GPU machines,
#: or the pairwise communicator of a plain send/receive)
OPAQUE = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "barrier",
          "monitored_barrier", "send", "recv", "isend", "irecv")


class FirstOps:
    """While entered, records this rank's first creating operation per group: ``first[group name] =
    (global ranks of the group, operation name, global ranks taking part in it)`` (a collective:
    the group; a batched send/receive: this rank and its peers)."""

    def __init__(self) -> None:
        self.first: dict[str, tuple[tuple[int, ...], str, tuple[int, ...]]] = {}
        self._local = threading.local()
        self._patched: list = []

    def _note(self, name: str, group: Any, peers: Optional[list[int]] = None) -> None:
        group = group if group is not None else dist.group.WORLD
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            return
        key = group.group_name
        if key not in self.first:
            ranks = tuple(dist.get_process_group_ranks(group))
            taking_part = ranks if peers is None else tuple(sorted({dist.get_rank(), *peers}))
            self.first[key] = (ranks, name, taking_part)

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if not depth and name in CREATING:
                if name == "batch_isend_irecv":
                    ops = args[0] if args else kwargs.get("p2p_op_list")
                    if ops:
                        self._note(name, ops[0].group, [_peer(op) for op in ops])
                else:
                    self._note(name, kwargs.get("group", _positional_group(name, args)))
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth
        wrapper.__hyflow_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def __enter__(self) -> "FirstOps":
        replacements = {}
        for name in CREATING + OPAQUE:
            original = getattr(c10d, name, None)
            original = getattr(original, "__hyflow_original__", original)
            if original is not None:
                replacements[id(original)] = self._wrap(name, original)
        self._patched = patch_everywhere(replacements)
        return self

    def __exit__(self, *exc) -> None:
        unpatch(self._patched)


#: position of the group argument of each creating collective (after the tensors and op)
_GROUP_POS = {"all_reduce": 2, "broadcast": 2, "reduce": 3, "all_gather": 2, "all_gather_into_tensor": 2,
              "_all_gather_base": 2, "reduce_scatter": 3, "reduce_scatter_tensor": 3, "_reduce_scatter_base": 3,
              "all_to_all": 2, "all_to_all_single": 4, "gather": 3, "scatter": 3}


def _peer(op: Any) -> int:
    """The global rank a ``P2POp`` talks to."""
    if op.peer is not None:
        return op.peer
    return dist.get_global_rank(op.group, op.group_peer)


def _positional_group(name: str, args: tuple) -> Optional[Any]:
    pos = _GROUP_POS.get(name)
    return args[pos] if pos is not None and len(args) > pos else None


def first_op_problems(per_rank: list[dict]) -> list[str]:
    """The groups whose communicator a NCCL run could not create: ``per_rank[r]`` is rank ``r``'s
    :attr:`FirstOps.first`."""
    problems = []
    groups: dict[str, tuple[int, ...]] = {}
    for first in per_rank:
        for key, (ranks, _, _) in first.items():
            groups[key] = ranks
    for key, ranks in sorted(groups.items()):
        seen = {r: per_rank[r][key] for r in ranks if key in per_rank[r]}
        ops = {r: f[1] for r, f in seen.items()}
        missing = [r for r in ranks if r not in seen]
        partial = {r: list(f[2]) for r, f in seen.items() if f[2] != ranks}
        if missing:
            problems.append(f"group {key} (ranks {list(ranks)}): ranks {missing} never entered an operation on it, "
                            f"while {ops} did (their first operation waits for the absent members on NCCL)")
        elif partial:
            problems.append(f"group {key} (ranks {list(ranks)}): the first operation is a batched send/receive "
                            f"among some members only (rank: ranks taking part) {partial}")
        elif len(set(ops.values())) > 1:
            problems.append(f"group {key} (ranks {list(ranks)}): first operations differ: {ops}")
    return problems
