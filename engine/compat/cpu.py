"""Run Megatron-Core 0.16 on CPU (gloo) by redirecting its CUDA assumptions.

Megatron-Core is written for CUDA: it asks ``torch.cuda.current_device()`` for a
device, creates tensors with ``device="cuda"``, calls ``.cuda()``, keeps its
model-parallel RNG streams in the CUDA generator, classifies parameters by
``Tensor.type()`` strings such as ``'torch.cuda.FloatTensor'`` and synchronises
streams. On a machine without CUDA each of these raises. This module is the one
place where hyflow redirects them, so that the real Megatron stack (TP, PP, DDP,
distributed optimizer, inference contexts, dist-checkpointing) runs on CPU for
development and CI.

Safety: :func:`activate` refuses to run when CUDA is available, and
:func:`maybe_activate` (what hyflow calls at start-up) does nothing there. Every
patch remembers the original object, and :func:`deactivate` restores them all.

Redirections (each has a test in ``tests/test_cpu_compat.py``):

* ``torch.cuda.current_device()`` returns ``torch.device("cpu")``, so the common
  ``device=torch.cuda.current_device()`` / ``.to(torch.cuda.current_device())``
  idioms land on CPU.
* Tensor factories (``torch.empty``, ``zeros``, ``ones``, ``full``, ``tensor``,
  ``arange``, ``rand*``, ``*_like`` ...) and ``Tensor.to`` map a CUDA device
  argument to CPU; ``Tensor.cuda()`` returns the tensor unchanged.
* The CUDA RNG is the CPU default generator: ``torch.cuda.manual_seed``,
  ``get_rng_state`` / ``set_rng_state`` and Megatron's ``_get_cuda_rng_state`` /
  ``_set_cuda_rng_state`` operate on it, so ``model_parallel_cuda_manual_seed``
  and the ``CudaRNGStatesTracker`` forks work (random ops on CPU tensors draw from
  that generator, which is what the forks must swap).
* ``Tensor.type()`` on a CPU tensor reports the CUDA type string
  (``'torch.cuda.FloatTensor'``) that Megatron's optimizers test for; converting
  with a ``'torch.cuda.*'`` string converts to the matching CPU type.
* ``torch.cuda.synchronize``, ``torch.cuda.empty_cache``, ``set_device``,
  streams and events become no-ops; memory queries return 0.
* Megatron's gradient-accumulation fusion calls Apex's CUDA extension
  ``fused_weight_gradient_mlp_cuda``; here it is a CPU version (the weight gradient
  accumulated into ``main_grad`` inside the GEMM, ``addmm_``), so DDP-wrapped linear
  layers skip the separate weight-gradient tensor and its addition
  (:func:`hyflow.training.optimizer.wrap_ddp` turns the fusion on where it is available).
* Megatron's MoE token dispatcher moves its all-to-all split sizes to the host "as numpy"
  only when they are CUDA tensors; on CPU they stay tensors, which ``all_to_all_single`` refuses.
  Here CPU tensors asked for as numpy become numpy arrays too.
* Under expert tensor parallelism the dispatcher all-gathers and reduce-scatters token blocks of
  *different* sizes per rank (NCCL's uneven collectives); gloo's collectives need equal sizes, so
  on CPU the blocks are padded to the largest, exchanged, and trimmed (same values).

One repair applies with or without CUDA (:func:`install_without_te`, which
:func:`maybe_activate` always runs): Megatron-Core 0.16's MoE router reads
``te_general_gemm`` even when Transformer Engine is absent (the name is then undefined); it is
set to None, the value Megatron's own code tests for.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable

import torch
from torch.utils._device import _device_constructors

__all__ = ["activate", "deactivate", "is_active", "maybe_activate", "CpuCompatError"]

_LOG = logging.getLogger(__name__)

#: name -> (owner object, attribute, original value) for everything we patched.
_ORIGINALS: dict[str, tuple[Any, str, Any]] = {}
_ACTIVE = False

_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace",
    "rand", "randn", "randint", "randperm", "empty_strided", "eye",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
)


class CpuCompatError(RuntimeError):
    """Raised when the CPU layer is asked to activate where it must not."""


def is_active() -> bool:
    """True while the CPU redirections are installed."""
    return _ACTIVE


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # A bare int means "cuda:<int>" to torch's factories.
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_if_cuda(device: Any) -> Any:
    return torch.device("cpu") if _is_cuda_device(device) else device


def _patch(owner: Any, attr: str, new: Any) -> None:
    key = f"{getattr(owner, '__name__', repr(owner))}.{attr}"
    if key not in _ORIGINALS:
        _ORIGINALS[key] = (owner, attr, getattr(owner, attr, None))
    setattr(owner, attr, new)


def _wrap_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return fn(*args, **kwargs)

    factory.__hyflow_original__ = fn  # type: ignore[attr-defined]
    return factory


def _tensor_to(original: Callable) -> Callable:
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and (_is_cuda_device(args[0])):
            args = (torch.device("cpu"),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _tensor_type(original: Callable) -> Callable:
    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)
            # Megatron classifies parameters by 'torch.cuda.*Tensor' strings.
            if self.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
                return "torch.cuda." + name[len("torch."):]
            return name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda."):]
        return original(self, dtype, non_blocking, **kwargs)

    return type_


def _install_rng() -> None:
    """Make the CPU default generator play the role of the CUDA generator."""
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    import megatron.core.tensor_parallel.random as mrandom

    def get_rng_state(device: Any = "cuda", *_, **__) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = -1, *_, **__) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    _patch(torch.cuda, "get_rng_state", get_rng_state)
    _patch(torch.cuda, "set_rng_state", set_rng_state)
    _patch(torch.cuda, "manual_seed", manual_seed)
    _patch(torch.cuda, "manual_seed_all", manual_seed)
    _patch(torch.cuda.random, "get_rng_state", get_rng_state)
    _patch(torch.cuda.random, "set_rng_state", set_rng_state)
    _patch(mrandom, "_get_cuda_rng_state", get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", set_rng_state)
    # On CPU the "CUDA" stream *is* the CPU generator, so random ops inside a
    # tracker fork change it by design; Megatron's warning about that is noise here.
    logging.getLogger(mrandom.__name__).addFilter(_CpuRngWarningFilter())


class _CpuRngWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


class _NullStream:
    """Stand-in for torch.cuda.Stream / Event: every operation is immediate on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullStream()

    def record(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _install_device_queries() -> None:
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    _patch(torch.cuda, "device_count", lambda: 0)
    _patch(torch.cuda, "set_device", lambda *a, **k: None)
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)
    _patch(torch.cuda, "empty_cache", lambda *a, **k: None)
    _patch(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    _patch(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    _patch(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    _patch(torch.cuda, "max_memory_reserved", lambda *a, **k: 0)
    _patch(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    _patch(torch.cuda, "Stream", _NullStream)
    _patch(torch.cuda, "Event", _NullStream)
    _patch(torch.cuda, "current_stream", lambda *a, **k: _NullStream())
    _patch(torch.cuda, "default_stream", lambda *a, **k: _NullStream())
    _patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())


class _WgradGemmAccumulate:
    """Apex's ``fused_weight_gradient_mlp_cuda`` on the CPU: ``main_grad += grad_output^T input``
    in one GEMM (inputs 2-D, as Megatron's linear backward passes them)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.add_(grad_output.t() @ total_input)


def _install_wgrad_accumulation() -> None:
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        _patch(layers, "fused_weight_gradient_mlp_cuda", _WgradGemmAccumulate)
        _patch(layers, "_grad_accum_fusion_available", True)


def _numpy_split_sizes(original: Callable) -> Callable:
    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _uneven_gather(original: Callable) -> Callable:
    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    return gather


def _uneven_reduce_scatter(original: Callable) -> Callable:
    @functools.wraps(original)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        longest = max(sizes)
        blocks = torch.split(input_, sizes, dim=0)
        padded = input_.new_zeros((len(sizes) * longest,) + tuple(input_.shape[1:]))
        for i, block in enumerate(blocks):
            padded[i * longest:i * longest + block.shape[0]] = block
        out = input_.new_empty((longest,) + tuple(input_.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, padded, group=group)
        return out[:sizes[group.rank()]]

    return reduce_scatter


def _install_moe_dispatcher() -> None:
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu",
           _numpy_split_sizes(token_dispatcher.maybe_move_tensor_to_cpu))
    _patch(mappings, "_gather_along_first_dim", _uneven_gather(mappings._gather_along_first_dim))
    _patch(mappings, "_reduce_scatter_along_first_dim",
           _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim))


def install_without_te() -> None:
    """Megatron-Core's MoE utilities without Transformer Engine (GPU or CPU): define the
    ``te_general_gemm`` name its router tests (None: torch's matmul path)."""
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def activate() -> None:
    """Install every redirection. Raises :class:`CpuCompatError` if CUDA is available."""
    global _ACTIVE
    if _ACTIVE:
        return
    if _cuda_really_available():
        raise CpuCompatError(
            "hyflow's CPU compatibility layer must not run on a machine with CUDA "
            "(it would silently move Megatron-Core onto the CPU). Use "
            "maybe_activate(), which leaves GPU machines alone."
        )
    # `with torch.device(...)` recognises factories by identity in a set cached on first use:
    # cache torch's own functions before wrapping them, or meta-device model construction
    # (transformers' from_pretrained) silently builds some buffers on the CPU instead.
    _device_constructors()
    for name in _FACTORIES:
        _patch(torch, name, _wrap_factory(getattr(torch, name)))
    _patch(torch.Tensor, "to", _tensor_to(torch.Tensor.to))
    _patch(torch.Tensor, "cuda", _tensor_cuda)
    _patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type))
    _install_device_queries()
    _install_rng()
    _install_wgrad_accumulation()
    _install_moe_dispatcher()
    install_without_te()
    _ACTIVE = True
    _LOG.debug("hyflow CPU compatibility layer active")


def deactivate() -> None:
    """Restore every patched object (used by tests)."""
    global _ACTIVE
    for owner, attr, original in reversed(list(_ORIGINALS.values())):
        setattr(owner, attr, original)
    _ORIGINALS.clear()
    _ACTIVE = False


def _cuda_really_available() -> bool:
    # Read through the original function in case someone patched is_available.
    return bool(torch._C._cuda_getDeviceCount() > 0) if torch.backends.cuda.is_built() else False


def maybe_activate() -> bool:
    """Activate the CPU layer if and only if CUDA is absent.

    ``HYFLOW_CPU_COMPAT=0`` disables it (Megatron will then fail on CPU with its
    own errors). Returns whether the layer is active.
    """
    install_without_te()
    if os.environ.get("HYFLOW_CPU_COMPAT", "1") == "0" or _cuda_really_available():
        return False
    activate()
    return True
