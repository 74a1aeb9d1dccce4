"""Process start-up: torch.distributed from the launcher's environment.

torchrun / srun set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. On a machine without CUDA the CPU compatibility layer is
activated and the gloo backend used; with CUDA, one GPU per local rank
(:func:`rank_device`) and the ``cpu:gloo,cuda:nccl`` backend: collectives on CUDA
tensors go through NCCL, those on host tensors (set-up, pickled objects) through gloo.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from hyflow.compat.cpu import maybe_activate


def launched_by_torchrun() -> bool:
    """True when this process is one rank of a launched job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` where CUDA is present, else the CPU.

    The one place that decides; everything else reads ``ParallelGroups.device``.
    """
    from hyflow.compat import cpu

    if cpu.is_active() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group (idempotent). Returns (rank, world_size)."""
    cpu = maybe_activate()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not launched_by_torchrun():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    # gloo connects each group's full mesh when the group is created unless told to connect a pair
    # on its first use: on GPU most groups never carry a host tensor, so they never connect.
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    device = rank_device()
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process may take it later)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    """Tear down Megatron state and the default group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
