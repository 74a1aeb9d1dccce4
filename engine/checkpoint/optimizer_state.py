"""Megatron optimizer state in a step checkpoint: its format, and the repairs torch's Adam needs
around Megatron 0.16's distributed-optimizer save / load."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def optimizer_format() -> str:
    """Megatron's distributed-optimizer checkpoint format: ``fully_reshardable`` (loads under any
    TP / PP / DP layout), or, with torch's own Adam (no Apex / Transformer Engine, e.g. on CPU),
    ``dp_reshardable``: Megatron 0.16's fully reshardable loader drops that Adam's per-parameter
    ``step``, so there the state loads only into the same TP / PP (any DP). The plain
    (non-distributed) optimizer is keyed by the model's parameters and loads anywhere."""
    return "fully_reshardable" if distrib_optimizer.HAVE_APEX_OR_TE else "dp_reshardable"


def optimizer_metadata(fmt: str) -> dict[str, Any]:
    """The ``metadata`` argument of Megatron's ``optimizer.sharded_state_dict`` for ``fmt``."""
    return {"distrib_optim_sharding_type": fmt, "chained_optim_avoid_prefix": True}


def has_tensors(sharded: Any) -> bool:
    """Whether a sharded state dict holds any sharded tensor (an unstepped optimizer's has none)."""
    return any(isinstance(v, ShardedBase) for v in nested_values(sharded))


def distributed_parts(optimizer: Any) -> list:
    """The Megatron ``DistributedOptimizer`` parts of ``optimizer`` (chained or not)."""
    return [o for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]
            if isinstance(o, DistributedOptimizer)]


def _torch_adams(optimizer: Any) -> list:
    """The torch ``Adam`` inside each ``DistributedOptimizer`` part (no Apex / TE fused Adam)."""
    return [o.optimizer for o in distributed_parts(optimizer) if isinstance(o.optimizer, torch.optim.Adam)]


def _step_device(group: dict, param: torch.Tensor) -> torch.device:
    """Where torch's Adam keeps ``step``: with the parameter for the fused kernel, else on the CPU."""
    return param.device if group.get("fused") else torch.device("cpu")


def restore_adam_steps(optimizer: Any) -> None:
    """Repair a torch Adam's ``step`` after Megatron's ``DistributedOptimizer.load_state_dict``.

    Megatron 0.16 gives every parameter the *same* ``step`` tensor (which Adam would then
    increment once per parameter) and its dp_reshardable loader overwrites it with the loading
    template's value; the true step is the one it saved with the param groups.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state.get(param, {})
                if "step" in state:
                    step = group.get("step", state["step"])
                    state["step"] = torch.tensor(float(step), dtype=torch.float32, device=_step_device(group, param))


def allocate_distributed_optimizer_state(optimizer: Any) -> None:
    """Give a fresh Megatron ``DistributedOptimizer`` on torch's Adam (no Apex / TE) its state.

    Its ``state_dict()``, which building the sharded state dict for a load calls, reads the
    common ``step`` of the allocated Adam state; before the first update there is none. Zero
    moments and ``step = 0`` are what the first update would allocate; the load overwrites them.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=_step_device(group, param))
                    state.setdefault("exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format))
                    state.setdefault("exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))
