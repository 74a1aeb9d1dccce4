"""Hybrid engine: the actor trains in (TP, PP, DP) and generates in (TP_g, PP_g, DP * d_g)
on the same ranks.

* :mod:`~hyflow.hybrid.param_specs`: the model side of a reshard (one ``ParamSpec`` per parameter);
* :mod:`~hyflow.hybrid.reshard_plan`: the reshard between the two layouts (pure arithmetic);
* :mod:`~hyflow.hybrid.reshard_table`: one rank's table of routes, what the executor runs;
* :mod:`~hyflow.hybrid.generation_groups`: the generation-side process groups;
* :mod:`~hyflow.hybrid.executor`: :class:`HybridEngine`, the transitions;
* :mod:`~hyflow.hybrid.transport`, :mod:`~hyflow.hybrid.generation_buffer`, :mod:`~hyflow.hybrid.offload`:
  how bytes move, the generation buffer, optimizer state out of the way.

The layout fix-up kernels live in ``hyflow.kernels``. Importing this package does not import torch.
"""
from hyflow.hybrid.param_specs import ParamSpec, ReshardPlanError, gpt_param_specs, megatron_local_name
from hyflow.hybrid.reshard_plan import ParamReshard, ReshardPlan, SlicePiece, plan_reshard, reshard_formula_bytes
from hyflow.hybrid.reshard_table import Move, RankPlan, RankTable, Route, rank_plan, rank_table

__all__ = [
    "Move", "ParamReshard", "ParamSpec", "RankPlan", "RankTable",
    "ReshardPlan", "ReshardPlanError", "Route", "SlicePiece", "gpt_param_specs", "megatron_local_name",
    "plan_reshard", "rank_plan", "rank_table", "reshard_formula_bytes",
]
