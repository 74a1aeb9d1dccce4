"""One optimizer step over micro-batches through Megatron's pipeline schedule.

``get_forward_backward_func`` picks the schedule for the layout (no pipelining,
1F1B, or interleaved 1F1B with virtual stages); it calls our ``forward_step``
for each micro-batch, which runs the model and hands back a loss function. The
same entry point serves language-model losses (SFT, the quickstart warm-up) and,
through ``loss_fn``, the RL losses of the trainers.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

Batch = dict[str, torch.Tensor]
#: loss_fn(output, batch) -> (scalar loss for this micro-batch, {name: detached value})
LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def lm_loss(output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean cross entropy; ``output`` is Megatron's per-token loss [b, s]."""
    mask = batch["loss_mask"].to(output.dtype)
    loss = (output * mask).sum() / mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss in place by the micro-batch count.
    return loss, {"lm_loss": loss.detach().clone()}


def _forward_step(loss_fn: LossFn, with_labels: bool, data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"] if with_labels else None,
    )
    return output, partial(_loss_wrapper, loss_fn, batch)


def _loss_wrapper(loss_fn: LossFn, batch: Batch, output: torch.Tensor):
    return loss_fn(output, batch)


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    """Positions 0..s-1 for every row of a right-padded batch."""
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def forward_backward(chunks: Sequence[torch.nn.Module], micro_batches: Sequence[Batch], *,
                     loss_fn: LossFn = lm_loss, with_labels: bool = True,
                     forward_only: bool = False, pgs=None) -> list[dict[str, torch.Tensor]]:
    """Run forward (and backward) over ``micro_batches``; return per-micro-batch stats.

    Stats are only produced on the last pipeline stage (an empty list elsewhere).
    Every micro-batch must have the same [b, s] shape (pipeline sends are sized once).
    ``pgs`` (a ProcessGroupCollection) runs a model built for a layout other than
    Megatron's global one, e.g. the actor's generation layout.
    """
    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    shape = micro_batches[0]["tokens"].shape
    for mb in micro_batches:
        if mb["tokens"].shape != shape:
            raise ValueError(
                f"all micro-batches must share one shape for the pipeline schedule; got "
                f"{tuple(shape)} and {tuple(mb['tokens'].shape)} (pad to a common length)"
            )
    n_chunks = len(chunks)
    iterators = [iter(micro_batches) for _ in range(n_chunks)] if n_chunks > 1 else iter(micro_batches)
    extra = {}
    if pgs is not None:
        pp_size = pgs.pp.size()
        schedule = get_forward_backward_func(pp_size=pp_size, vp_size=n_chunks if n_chunks > 1 else None)
        extra["pg_collection"] = pgs
        if pp_size > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            extra["p2p_communicator"] = P2PCommunicator(pp_group=pgs.pp, config=chunks[0].config)
    else:
        schedule = get_forward_backward_func()
    return schedule(
        forward_step_func=partial(_forward_step, loss_fn, with_labels),
        data_iterator=iterators,
        model=list(chunks) if n_chunks > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        # micro-batches hold this CP rank's share of the sequence; the schedule wants the whole one
        seq_length=shape[1] * getattr(chunks[0].config, "context_parallel_size", 1),
        micro_batch_size=shape[0],
        forward_only=forward_only,
        **extra,
    )


def train_step(chunks, optimizer, scheduler, micro_batches: Sequence[Batch], *,
               loss_fn: LossFn = lm_loss, with_labels: bool = True,
               pp_group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """Zero grads, forward/backward all micro-batches, step the optimizer.

    Returns the mean of each stat over micro-batches (broadcast from the last
    pipeline stage so every rank reports the same numbers), plus ``grad_norm``,
    ``lr`` and ``update_ok``.
    """
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    stats = forward_backward(chunks, micro_batches, loss_fn=loss_fn, with_labels=with_labels)
    update_ok, grad_norm, _ = optimizer.step()
    if update_ok and scheduler is not None:
        scheduler.step(increment=1)
    out = _mean_stats(stats, pp_group)
    out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    out["update_ok"] = float(bool(update_ok))
    out["lr"] = optimizer.param_groups[0]["lr"]
    return out


def _mean_stats(stats: list[dict[str, torch.Tensor]], pp_group) -> dict[str, float]:
    """Average stats over micro-batches and share them from the last PP stage."""
    names = sorted(stats[0]) if stats else []
    local = {k: float(torch.stack([s[k].float() for s in stats]).mean()) for k in names}
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return local
    payload = [local if stats else None]
    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
    dist.broadcast_object_list(payload, src=last, group=pp_group)
    return dict(payload[0])
