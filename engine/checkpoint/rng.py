"""Random streams of a rank: capture and restore them, and store them as tensors and plain
numbers, so a checkpoint's ``rng/rank_*.pt`` loads with ``torch.load(weights_only=True)``
(nothing in it can run code).

A rank's streams are python's ``random``, numpy's global generator, torch's CPU (and CUDA)
generator and Megatron's tensor-parallel RNG tracker.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from hyflow.checkpoint.errors import CheckpointError
from hyflow.checkpoint.trust import unpickling_detail
from hyflow.compat import cpu

RNG_FORMAT = "hyflow-rng"
RNG_VERSION = 2


def capture_rng() -> dict[str, Any]:
    """This rank's random streams: python, numpy, torch (CPU, CUDA) and Megatron's tracker."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and not cpu.is_active():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = get_cuda_rng_tracker()
    state["tracker"] = {name: s.clone() for name, s in tracker.get_states().items()}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Undo everything drawn since :func:`capture_rng` returned ``state``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states({name: s.clone() for name, s in state["tracker"].items()})


def rng_to_plain(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (from :func:`capture_rng`) as tensors, numbers and strings only."""
    version, internal, gauss = state["python"]
    kind, key, pos, has_gauss, cached = state["numpy"]
    out: dict[str, Any] = {
        "format": RNG_FORMAT, "version": RNG_VERSION,
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": None if gauss is None else float(gauss)},
        "numpy": {"kind": str(kind), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": state["torch"].clone(),
        "tracker": {str(name): s.clone() for name, s in state["tracker"].items()},
    }
    if "cuda" in state:
        out["cuda"] = state["cuda"].clone()
    return out


def rng_from_plain(data: Any, source: str) -> dict[str, Any]:
    """The inverse of :func:`rng_to_plain`; a wrong structure raises :class:`CheckpointError`
    naming ``source``."""
    try:
        if data.get("format") != RNG_FORMAT or int(data.get("version", 0)) > RNG_VERSION:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')}")
        py, npy = data["python"], data["numpy"]
        state: dict[str, Any] = {
            "python": (int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss_next"]),
            "numpy": (npy["kind"], npy["key"].numpy().astype(np.uint32), int(npy["pos"]), int(npy["has_gauss"]),
                      float(npy["cached_gaussian"])),
            "torch": _byte_tensor(data["torch"]),
            "tracker": {str(k): _byte_tensor(v) for k, v in data["tracker"].items()},
        }
        if "cuda" in data:
            state["cuda"] = _byte_tensor(data["cuda"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source} is not a random-state file this hyflow reads ({type(e).__name__}: {e})") \
            from None
    return state


def _byte_tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 tensor, got {type(value).__name__}")
    return value


def save_rng(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` (from :func:`capture_rng`) to ``path`` as plain tensors and numbers."""
    torch.save(rng_to_plain(state), path)


def load_rng(path: str) -> dict[str, Any]:
    """Read a file written by :func:`save_rng` with ``weights_only=True``: a file that holds
    anything but tensors and plain data (a pickled callable, or the pickled numpy state older
    hyflow versions wrote) is refused with :class:`CheckpointError`; nothing in it runs."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # noqa: BLE001 - UnpicklingError for anything but plain data
        raise CheckpointError(
            f"{path} holds Python objects other than tensors and plain data ({unpickling_detail(e)}): refused, hyflow "
            "never runs code from a checkpoint. If you wrote it with an older hyflow and trust it, delete "
            "the checkpoint's rng/ folder: the run then resumes with re-seeded random streams") from None
    return rng_from_plain(data, path)
