"""The routers' auxiliary losses of a training step, as metrics.

Megatron-Core's routers add their load-balancing loss and z-loss to the gradient themselves
(``MoEAuxLossAutoScaler``: scaled by the schedule to a mean over micro-batches, then averaged
over data-parallel ranks by DDP, like the main loss) and record each one's unweighted value per
layer in a module-level tracker, summed over the step's micro-batches. :func:`router_loss_stats`
turns that tracker into one number per loss: the mean over MoE layers, micro-batches and
data-parallel ranks, the same on every rank, with three small all-reduces of one vector; then
clears it for the next step. Under tensor / context parallelism a load-balancing loss is split
into per-rank parts (local scores, global token counts: Megatron sums them over the TP x CP
group), while a z-loss is each rank's own tokens' mean (averaged over the group here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

#: Megatron's tracker name -> hyflow's metric name.
METRICS = {"load_balancing_loss": "moe/load_balancing_loss", "seq_load_balancing_loss": "moe/seq_load_balancing_loss",
           "global_load_balancing_loss": "moe/global_load_balancing_loss", "z_loss": "moe/z_loss"}


def router_loss_stats(groups, num_micro_batches: int, num_moe_layers: int) -> dict[str, float]:
    """Mean router losses of the step (see the module docstring); ``{}`` when no router recorded
    one (a dense model, or losses switched off). Collective over TP x CP, PP and DP x CP, so every
    rank of the layout must call it after the same step."""
    tracker = get_moe_layer_wise_logging_tracker()
    names = [n for n in METRICS if n in tracker]
    if not names:
        return {}
    device = groups.device
    vec = torch.stack([tracker[n]["values"].detach().to(device=device, dtype=torch.float64).sum()
                       for n in names] + [torch.tensor(float(num_micro_batches), dtype=torch.float64, device=device)])
    tp_cp = getattr(groups.pgs, "tp_cp", None) or groups.pgs.tp
    if tp_cp.size() > 1:
        dist.all_reduce(vec, group=tp_cp)
        for i, name in enumerate(names):  # parts of one loss add up; per-slice means average
            if tracker[name].get("reduce_group") is None:
                vec[i] /= tp_cp.size()
        vec[-1] /= tp_cp.size()
    if groups.pgs.pp.size() > 1:  # each stage holds its own layers' values
        last = vec[-1].clone()
        dist.all_reduce(vec, group=groups.pgs.pp)
        vec[-1] = last
    dp = getattr(groups.pgs, "dp_cp", None) or groups.pgs.dp
    if dp.size() > 1:
        dist.all_reduce(vec, group=dp)
    tracker.clear()  # not only zeroed: the next step's model may have another number of layers
    micro = vec[-1].clamp(min=1) * max(num_moe_layers, 1)
    return {METRICS[n]: float(vec[i] / micro) for i, n in enumerate(names)}
