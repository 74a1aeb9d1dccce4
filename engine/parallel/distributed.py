"""Process start-up: torch.distributed from the launcher's environment.

torchrun / srun set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. On a machine without CUDA the CPU compatibility layer is
activated and the gloo backend used; with CUDA, one GPU per local rank
(:func:`rank_device`) and the ``cpu:gloo,cuda:nccl`` backend: collectives on CUDA
tensors go through NCCL, those on host tensors (set-up, pickled objects) through gloo.

Two NCCL rules the rest of hyflow relies on, both handled here:

* **timeouts**: every group (the default one and every ``new_group``, Megatron's included) waits
  up to ``timeout_s`` in a collective (``trainer.collective_timeout_s``, default
  :data:`DEFAULT_TIMEOUT_S`). Placement pools wait inside receives for the other pool's whole
  generation or update, so the timeout bounds a phase, not a message;
* **communicators**: NCCL creates a group's communicator on the group's first operation, which
  every member must enter. Groups whose first use would be a batched send/receive or a control
  message among some members only are initialised with :func:`eager_init` right after creation.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hyflow.compat import cpu
from hyflow.compat.cpu import maybe_activate


def launched_by_torchrun() -> bool:
    """True when this process is one rank of a launched job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` where CUDA is present, else the CPU.

    The one place that decides; everything else reads ``ParallelGroups.device``.
    """
    if cpu.is_active() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


#: seconds a collective may wait (a whole phase of the other pool, for placement pools)
DEFAULT_TIMEOUT_S = 3600.0


def set_group_timeout(timeout_s: float) -> None:
    """Make ``timeout_s`` the timeout of every process group created from now on without one.

    ``init_process_group``'s timeout covers the default group only: ``new_group`` reads torch's
    module defaults (10 min for NCCL, 30 for gloo), which are set here.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if isinstance(getattr(c10d, name, None), datetime.timedelta):
            setattr(c10d, name, timeout)


def group_timeout() -> datetime.timedelta:
    """The timeout new process groups get (:func:`set_group_timeout`)."""
    return c10d.default_pg_timeout


def eager_init(group, device: torch.device) -> None:
    """Create ``group``'s communicator now: one all-reduce of a scalar on ``device`` entered by every
    member (NCCL creates a communicator on a group's first operation, and a first operation that
    only some members enter -- a batched send/receive, a control message -- hangs). Call it on
    every member, in the order the groups were created; ``None`` (not a member) does nothing."""
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    if dist.get_world_size(group) > 1:
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def default_dtype() -> str:
    """The parameter dtype ``auto`` stands for: ``bf16`` where this process runs on CUDA, ``fp32`` on
    the CPU (where bf16 matmuls are slow and the tests compare against float32 references)."""
    return "bf16" if rank_device().type == "cuda" else "fp32"


#: environment a rank needs before its CUDA context exists (launchers set it too)
RANK_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # Megatron: TP/SP communication ordered with compute


def set_rank_env() -> None:
    """:data:`RANK_ENV` where the environment does not say otherwise."""
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Initialise the default process group (idempotent). Returns (rank, world_size).

    ``timeout_s`` bounds every collective of every group (:func:`set_group_timeout`)."""
    maybe_activate()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    set_rank_env()  # before torch.cuda.set_device creates the context
    set_group_timeout(timeout_s)
    if not launched_by_torchrun():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = rank_device()
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
        # gloo connects each group's full mesh when the group is created unless told to connect a
        # pair on its first use: on GPU most groups never carry a host tensor, so they never connect
        # (~3,400 connections per rank at 1024 ranks otherwise). Not on CPU runs, where gloo carries
        # everything: a lazily connected pair waits for its peer past the collective timeout.
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    """Tear down Megatron state and the default group."""
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
