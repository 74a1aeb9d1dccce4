"""Hybrid engine: the actor trains in (TP, PP, DP) and generates in (TP_g, PP_g, DP * d_g)
on the same ranks. ``planner`` computes the reshard between the two layouts (pure arithmetic);
the layout fix-up kernels live in ``hyflow.kernels``.
"""
from hyflow.hybrid.planner import (  # noqa: F401
    GenerationShape,
    Move,
    ParallelShape,
    ParamReshard,
    ParamSpec,
    RankPlan,
    ReshardPlan,
    ReshardPlanError,
    SlicePiece,
    gpt_param_specs,
    megatron_local_name,
    plan_reshard,
    reshard_formula_bytes,
)

# Torch reference helpers for Megatron's grouped QKV layout, re-exported lazily so that
# ``import hyflow.hybrid`` stays free of torch.
_LAZY = ("qkv_to_grouped", "grouped_to_qkv", "qkv_regroup", "qkv_fused_to_grouped")


def __getattr__(name: str):
    if name in _LAZY:
        from hyflow.kernels import reshard_reference

        return getattr(reshard_reference, name)
    raise AttributeError(f"module 'hyflow.hybrid' has no attribute {name!r}")


__all__ = [
    "GenerationShape", "Move", "ParallelShape", "ParamReshard", "ParamSpec", "RankPlan",
    "ReshardPlan", "ReshardPlanError", "SlicePiece", "gpt_param_specs", "megatron_local_name",
    "plan_reshard", "reshard_formula_bytes", *_LAZY,
]
