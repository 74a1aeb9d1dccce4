"""Finite weights: no NaN / inf is written into a checkpoint, and none is loaded from one.

A NaN that reached the weights (a bad update, a damaged or hand-edited checkpoint written without
a manifest) would otherwise be saved again under a fresh manifest, which then vouches for it, and
exported to serving. :func:`check_finite` runs on every save and every load (resume, export,
generate, reference / critic initialisation): one fused max-abs reduction over all of a rank's
tensors (``torch._foreach_norm`` with ``ord=inf``: NaN propagates, large finite values cannot
overflow as a 2-norm of bf16 / fp16 would), one host sync, and one scalar all-reduce so every
rank raises together. The rank holding the tensor names it; the others say a peer did.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from hyflow.checkpoint.errors import NonFiniteWeights


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return unwrap_model(module)


def named_tensors(models: Mapping[str, Any]) -> Iterable[tuple[str, torch.Tensor]]:
    """``(model/tensor name, tensor)`` of every floating-point parameter and buffer of
    ``models`` (name -> a module, a list of pipeline chunks, or None for a model this rank does
    not hold)."""
    for label, module in models.items():
        if module is None:
            continue
        chunks = module if isinstance(module, (list, tuple)) else [module]
        for i, chunk in enumerate(chunks):
            prefix = f"{label}/" if len(chunks) == 1 else f"{label}/chunk{i}/"
            chunk = _unwrap(chunk)
            for name, t in list(chunk.named_parameters()) + list(chunk.named_buffers()):
                if t is not None and t.is_floating_point() and t.numel():
                    yield prefix + name, t.detach()


@torch.no_grad()
def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity (one fused reduction per device)."""
    by_device: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    for name, t in named:
        if not t.numel():  # no element, nothing to check (and no identity for a max)
            continue
        names, tensors = by_device.setdefault(t.device, ([], []))
        names.append(name)
        tensors.append(t)
    bad = []
    for names, tensors in by_device.values():
        maxabs = torch.stack([n.float() for n in torch._foreach_norm(tensors, float("inf"))])
        finite = torch.isfinite(maxabs)
        if not bool(finite.all()):  # the one host sync of the common case
            bad += [names[i] for i in (~finite).nonzero().flatten().tolist()]
    return bad


def check_finite(models: Mapping[str, Any], what: str, device: Optional[torch.device] = None,
                 group: Any = None, rank_note: str = "") -> None:
    """Raise :class:`~hyflow.checkpoint.errors.NonFiniteWeights` unless every tensor of ``models``
    is finite on every rank of ``group`` (collective when a process group exists; default: the
    world). ``what`` says what was being done (``saving checkpoint step 4 to ...``); the message
    names the first non-finite tensor and how many there are."""
    bad = nonfinite_names(named_tensors(models))
    if dist.is_available() and dist.is_initialized():
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
                else torch.device("cpu")
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        anywhere = bool(flag.item() > 0)
        where = f" on rank {dist.get_rank()}{rank_note}"
    else:
        anywhere, where = bool(bad), ""
    if not anywhere:
        return
    if not bad:
        raise NonFiniteWeights(f"non-finite weights while {what}: another rank holds them (see its error)",
                               tensor=None, peer=True)
    more = f" (and {len(bad) - 1} more tensor(s): {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" \
        if len(bad) > 1 else ""
    raise NonFiniteWeights(f"{bad[0]} holds NaN or inf{where}{more} while {what}: refusing to go on with "
                           "non-finite weights (they would be saved, trained on and exported)", tensor=bad[0])
