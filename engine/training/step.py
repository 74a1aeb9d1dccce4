"""One optimizer step over micro-batches through Megatron's pipeline schedule.

``get_forward_backward_func`` picks the schedule for the layout (no pipelining, 1F1B, or
interleaved 1F1B with virtual stages); it calls our ``forward_step`` for each micro-batch, which
runs the model and hands back a loss function. The same entry point serves language-model losses
(the LM job, the RL job's SFT warm-up) and, through ``loss_fn``, the RL losses.

**Loss normalisation.** A loss function returns its micro-batch's *contribution* to the step's
loss, already divided by denominators that span the whole step on every data-parallel rank (e.g.
``sum(loss * mask) / global token count``: :func:`token_mean_weights`). :func:`train_step` undoes
the averaging Megatron applies on top (the schedule divides by the number of micro-batches, DDP by
the data-parallel size), so the gradient is the gradient of the sum of the contributions. Hence the
loss, its gradients and its statistics do not depend on how rows are split into micro-batches or
over data-parallel ranks, and ranks may run different numbers of micro-batches of different shapes
(``variable_seq_lengths`` lets the pipeline stages exchange shapes).

**Statistics** are contributions too: each loss function names them (``loss_fn.names``), they are
summed over micro-batches, all-reduced over the data-parallel group and broadcast from the last
pipeline stage, as one device tensor (no pickled objects).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from hyflow.models.positions import explicit_positions
from hyflow.models.routing_replay import replaying
from hyflow.training.moe_losses import router_loss_stats
from hyflow.training.output_head import Hidden, hidden_states, wants_hidden

Batch = dict
#: loss_fn(output, batch) -> (this micro-batch's contribution to the loss, {name: detached 0-d contribution})
LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def explicit_pgs(groups):
    """A placement pool's groups (``groups.pool`` set), which Megatron's globals do not describe;
    None for the groups Megatron's global state holds."""
    return groups.pgs if getattr(groups, "pool", None) is not None else None


def data_group(groups):
    """The group DDP averages gradients over: data-parallel x context-parallel ranks (each CP rank
    holds a share of every sequence, so its tokens count like another DP rank's)."""
    group = getattr(groups.pgs, "dp_cp", None)
    return group if group is not None else groups.pgs.dp


def token_mean_weights(micro_batches: Sequence[Batch], mask_key: str, dp_group) -> None:
    """Add ``loss_weight = mask / (mask tokens of every micro-batch on every DP rank)`` to each
    micro-batch (in place): summed contributions are then the token mean of the whole step."""
    device = micro_batches[0][mask_key].device
    count = torch.zeros((), dtype=torch.float64, device=device)
    for mb in micro_batches:
        count += mb[mask_key].sum(dtype=torch.float64)
    if dp_group is not None and dp_group.size() > 1:
        dist.all_reduce(count, group=dp_group)
    denominator = count.clamp(min=1).float()
    for mb in micro_batches:
        mb["loss_weight"] = mb[mask_key].float() / denominator


class LMLoss:
    """Cross entropy weighted per token: ``sum(loss * loss_weight)``; ``output`` is Megatron's
    per-token loss [b, s]. Without ``loss_weight`` in the micro-batches, :meth:`prepare` (called by
    :func:`train_step`) weights ``loss_mask`` for the token mean of the whole step."""

    names = ("lm_loss",)

    def prepare(self, micro_batches: Sequence[Batch], groups) -> None:
        if "loss_weight" not in micro_batches[0]:
            token_mean_weights(micro_batches, "loss_mask", data_group(groups))

    def __call__(self, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (output.float() * batch["loss_weight"]).sum()
        return loss, {"lm_loss": loss.detach()}


lm_loss = LMLoss()


def packed_seq_params(batch: Batch):
    """Megatron's THD description of a packed row (Transformer Engine attention), or None."""
    if "cu_seqlens" not in batch:
        return None
    cu, longest = batch["cu_seqlens"], batch["max_seqlen"]
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _forward_step(loss_fn: LossFn, with_labels: bool, scale: float, data_iterator, model):
    batch = next(data_iterator)
    thd = packed_seq_params(batch)
    # packed rows restart positions per sequence (TE's THD attention does it from cu_seqlens)
    positions = batch["position_ids"] if batch.get("packed") and thd is None else None
    head = contextlib.nullcontext() if not wants_hidden(loss_fn) else hidden_states(model)
    # a mixture-of-experts batch may carry the rollout's experts per token: ``routing`` is replayed,
    # ``recorded_routing`` only compared with the router's own choice (hyflow.models.routing_replay)
    replay = replaying(model, batch["routing"]) if "routing" in batch else \
        replaying(model, batch.get("recorded_routing"), apply=False)
    with explicit_positions(model, positions), head as capture, replay:
        output = model(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"] if with_labels else None,
            **({"packed_seq_params": thd} if thd is not None else {}),
        )
    weight = getattr(capture, "weight", None)
    return output, partial(_loss_wrapper, loss_fn, batch, scale, weight)


def _loss_wrapper(loss_fn: LossFn, batch: Batch, scale: float, weight, output: torch.Tensor):
    # a hidden-state loss (``loss_fn.hidden_states``) applies the output layer itself
    loss, stats = loss_fn(output if weight is None else Hidden(output, weight), batch)
    return loss * scale, stats


def forward_backward(chunks: Sequence[torch.nn.Module], micro_batches: Sequence[Batch], *,
                     loss_fn: LossFn = lm_loss, with_labels: bool = True,
                     forward_only: bool = False, pgs=None, dp_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """Run forward (and backward) over ``micro_batches``; return per-micro-batch stats.

    Stats are only produced on the last pipeline stage (an empty list elsewhere). Micro-batches may
    differ in shape. ``pgs`` (a ProcessGroupCollection) runs a model built for a layout other than
    Megatron's global one. ``dp_size``: the data-parallel size DDP averages gradients over (the
    loss contributions are scaled back, see the module docstring).
    """
    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    shapes = {tuple(mb["tokens"].shape) for mb in micro_batches}
    first = micro_batches[0]["tokens"].shape
    n_chunks = len(chunks)
    iterators = [iter(micro_batches) for _ in range(n_chunks)] if n_chunks > 1 else iter(micro_batches)
    extra = {}
    config = chunks[0].config
    if pgs is not None:
        pp_size = pgs.pp.size()
        schedule = get_forward_backward_func(pp_size=pp_size, vp_size=n_chunks if n_chunks > 1 else None)
        extra["pg_collection"] = pgs
        if pp_size > 1:
            extra["p2p_communicator"] = P2PCommunicator(pp_group=pgs.pp, config=config)
    else:
        schedule = get_forward_backward_func()
    scale = 1.0 if forward_only else float(len(micro_batches) * dp_size)
    variable = config.variable_seq_lengths
    config.variable_seq_lengths = variable or len(shapes) > 1  # stages exchange each tensor's shape
    try:
        return schedule(
            forward_step_func=partial(_forward_step, loss_fn, with_labels, scale),
            data_iterator=iterators,
            model=list(chunks) if n_chunks > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            # micro-batches hold this CP rank's share of the sequence; the schedule wants the whole one
            seq_length=first[1] * getattr(config, "context_parallel_size", 1),
            micro_batch_size=first[0],
            forward_only=forward_only,
            **extra,
        )
    finally:
        config.variable_seq_lengths = variable


def train_step(chunks, optimizer, scheduler, micro_batches: Sequence[Batch], *, groups,
               loss_fn: LossFn = lm_loss, with_labels: bool = True) -> dict[str, float]:
    """Zero grads, forward/backward all micro-batches, step the optimizer.

    ``groups``: the model's :class:`~hyflow.parallel.groups.ParallelGroups`. Returns each of
    ``loss_fn.names`` summed over micro-batches and data-parallel ranks (identical on every rank),
    plus ``grad_norm``, ``lr`` and ``update_ok`` (and a mixture-of-experts model's router losses,
    ``moe/...``: :mod:`hyflow.training.moe_losses`).
    """
    prepare = getattr(loss_fn, "prepare", None)
    if prepare is not None:
        prepare(micro_batches, groups)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # DDP averages over DP x CP ranks and the schedule multiplies by the CP size: net, DP
    stats = forward_backward(chunks, micro_batches, loss_fn=loss_fn, with_labels=with_labels,
                             dp_size=groups.pgs.dp.size(), pgs=explicit_pgs(groups))
    update_ok, grad_norm, _ = optimizer.step()
    if update_ok and scheduler is not None:
        scheduler.step(increment=1)
    out = reduce_stats(stats, getattr(loss_fn, "names", ()), groups)
    config = chunks[0].config
    if config.num_moe_experts:  # the routers' aux losses, reduced like the loss
        out.update(router_loss_stats(groups, len(micro_batches), config.num_layers))
    out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    out["update_ok"] = float(bool(update_ok))
    out["lr"] = optimizer.param_groups[0]["lr"]
    return out


def reduce_stats(stats: list[dict[str, torch.Tensor]], names: Sequence[str], groups) -> dict[str, float]:
    """``names`` summed over the micro-batches' ``stats`` (last pipeline stage) and over the
    data-parallel ranks, the same on every rank: one all-reduce and one broadcast of a vector."""
    if not names:
        return {}
    vec = torch.zeros(len(names), dtype=torch.float64, device=groups.device)
    for s in stats:
        vec += torch.stack([s[k].detach().to(device=groups.device, dtype=torch.float64) for k in names])
    dp, pp = data_group(groups), groups.pgs.pp
    if dp.size() > 1:
        dist.all_reduce(vec, group=dp)
    if pp.size() > 1:
        dist.broadcast(vec, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
    return dict(zip(names, vec.tolist()))


def position_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Positions 0..s-1 for every row of a right-padded batch, on the batch's device."""
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
