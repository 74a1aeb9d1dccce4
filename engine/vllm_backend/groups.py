"""vLLM's process groups, made from the hybrid engine's generation layout before vLLM starts.

vLLM in the training ranks runs as its *external launcher* (``distributed_executor_backend=
"external_launcher"``: one engine per process, no worker processes, the ranks of an instance step
in lockstep because they see the same requests in the same order). Left to itself it reuses the
running ``torch.distributed`` world and cuts it into instances of contiguous ranks (TP fastest).
Our generation TP groups are strided (``tp = tp_g * s + t`` with ``s = TP / TP_g``,
:mod:`hyflow.hybrid.reshard_plan`: that is what makes a training shard a slice of its generation
shard), so :func:`init_vllm_groups` creates vLLM's groups from the plan's lists first; vLLM then
finds them initialised and checks only their sizes. Every other vLLM group of a dense model
(pipeline, data, context parallel) has one rank: an instance is one generation replica.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hyflow.parallel.distributed import rank_device

#: vLLM's module globals this module sets (vllm.distributed.parallel_state, 0.32).
_SINGLETON_GROUPS = (("_DCP", "dcp", True), ("_PCP", "pcp", False), ("_PP", "pp", False), ("_DP", "dp", False))


def init_vllm_groups(tp_groups: list[list[int]], local_rank: int) -> None:
    """vLLM's world and model-parallel groups over the running ``torch.distributed`` world: TP
    groups ``tp_groups`` (a partition of the world's ranks), every other kind one rank per group.
    Collective: every rank calls it with the same lists (each group is created by all ranks)."""
    from vllm.distributed import parallel_state as ps  # optional dependency, imported when the backend starts

    if ps.model_parallel_is_initialized():
        return
    os.environ["VLLM_DIST_IDENT"] = _instance_ident()
    world = dist.get_world_size()
    backend = dist.get_backend()
    ps.init_distributed_environment(world, dist.get_rank(), "env://", local_rank, backend)
    ps._TP = ps.init_model_parallel_group([list(g) for g in tp_groups], local_rank, backend,
                                          use_message_queue_broadcaster=True, group_name="tp")
    if hasattr(ps, "_ETP"):  # the engram TP group: the TP group for models without engram tables
        ps._ETP = ps._TP
    singles = [[r] for r in range(world)]
    for attr, name, broadcaster in _SINGLETON_GROUPS:
        setattr(ps, attr, ps.init_model_parallel_group(singles, local_rank, backend,
                                                       use_message_queue_broadcaster=broadcaster,
                                                       group_name=name))


def _instance_ident() -> str:
    """A name for this vLLM start's shared-memory segments, the same on every rank (rank 0's random
    draw, one broadcast at set-up). vLLM's CPU build names a TP group's segments
    ``{VLLM_DIST_IDENT}-tp:N-[ranks]-cpushm``, and its worker derives the identifier from the init
    method, ``env://`` for every job: two jobs on one host, or a job after one killed by -9 (its
    segments stay in /dev/shm), collide on the name and vLLM's start fails (errno 17, EEXIST)."""
    nonce = torch.zeros(1, dtype=torch.int64, device=rank_device())
    if dist.get_rank() == 0:
        nonce[0] = int.from_bytes(os.urandom(7), "little")  # not torch's generator: the training owns it
    dist.broadcast(nonce, src=0)
    return f"hyflow{int(nonce.item()):x}"


def local_rank(device: torch.device) -> int:
    """The device index vLLM's worker takes (``LOCAL_RANK``): the rank's CUDA device, 0 on CPU."""
    return device.index if device.type == "cuda" and device.index is not None else 0
