"""Routing replay (R3): record each token's experts in the rollout, route the training forwards
through the same experts.

A mixture-of-experts router picks each token's top-k experts from its logits. The sampler and the
trainer compute those logits with different kernels, shapes and layouts, so near-ties flip and a
sampled token can go through other experts in the training forward than in the rollout: the
policy ratio then compares two different networks. Rollout routing replay records the rollout's
choice per token and layer and makes the training (and old-log-prob) forwards use it, while the
probabilities still come from the current router logits at those experts, so the router keeps its
gradient (facts from the R3 paper, arXiv 2507.18071, and Megatron-Core's own ``RouterReplay``).

The hook is Megatron-Core's: ``TopKRouter.routing`` asks ``router.router_replay`` for the top-k
(``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``).
:class:`RouterHook` is installed there on every router of a model (:func:`router_hooks`); it always
runs Megatron's own top-k, then in ``record`` mode keeps the indices, in ``replay`` mode replaces
the indices of every token that has a recorded choice and gathers the scores at them, and counts
the tokens whose own choice differs (``rollout/routing_mismatch``). Unlike Megatron's class, the
targets are per call and per model (no class-level list of every router ever built), and tokens
without a record (the last sampled token, padding) keep their own routing.

Recorded routing travels as **expert id + 1** (0 = no record) in ``uint8`` (``int32`` beyond 254
experts: :func:`routing_dtype`; NCCL and gloo move both, not ``int16``), shaped
``[tokens, layers, top_k]`` per sample and ``[B, S, layers, top_k]`` in a batch, so the zero padding
every batch helper adds means "route it yourself".
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["RouterHook", "router_hooks", "recording", "replaying", "take_recorded", "mismatch_counts",
           "reset_mismatch", "routing_dtype"]


def routing_dtype(num_experts: int) -> torch.dtype:
    """The dtype of recorded routing (expert id + 1) for ``num_experts`` experts."""
    return torch.uint8 if num_experts < 255 else torch.int32


class RouterHook:
    """The object Megatron-Core's router consults for its top-k (see the module docstring)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer  # global 0-based decoder layer
        self.mode: Optional[str] = None  # None | "record" | "replay" | "compare"
        self.recorded: Optional[torch.Tensor] = None  # [tokens, k] expert id + 1 (routing_dtype)
        self.target: Optional[torch.Tensor] = None  # [tokens, k] long, expert id + 1 (0: none)
        self.mismatched = 0  # tokens whose own top-k differs from the target (device tensor or 0)
        self.compared = 0

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode == "record":
            self.recorded = (indices.detach() + 1).to(routing_dtype(scores.shape[1]))
        elif self.mode in ("replay", "compare") and self.target is not None:
            target = self.target
            if target.shape != indices.shape:
                raise ValueError(f"routing replay of layer {self.layer}: {tuple(target.shape[:1])} recorded tokens x "
                                 f"top-{target.shape[-1]} for {indices.shape[0]} tokens x top-{topk}; the recorded "
                                 "routing does not belong to this batch")
            known = target[:, 0] > 0
            wanted = torch.where(known.unsqueeze(1), target - 1, indices)
            differs = (torch.sort(wanted, dim=1).values != torch.sort(indices, dim=1).values).any(dim=1) & known
            self.mismatched = self.mismatched + differs.sum()
            self.compared = self.compared + known.sum()
            if self.mode == "replay":
                indices = wanted
                values = scores.gather(1, indices)
        return values, indices


def router_hooks(model: torch.nn.Module) -> list[RouterHook]:
    """The :class:`RouterHook` of every router of ``model`` (a GPTModel, possibly wrapped),
    installed on first use; empty for a dense model."""
    module = getattr(model, "module", model)
    hooks = getattr(module, "_hyflow_router_hooks", None)
    if hooks is None:
        # Megatron (seconds) only when this runs: `hyflow --help` imports this module
        from megatron.core.transformer.moe.router import TopKRouter

        hooks = []
        for sub in module.modules():
            if isinstance(sub, TopKRouter):
                sub.router_replay = RouterHook(sub.layer_number - 1)
                hooks.append(sub.router_replay)
        module._hyflow_router_hooks = hooks
    return hooks


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[list[RouterHook]]:
    """Every router of ``model`` keeps its last call's top-k (``hook.recorded``) inside the block."""
    hooks = router_hooks(model)
    for h in hooks:
        h.mode, h.recorded = "record", None
    try:
        yield hooks
    finally:
        for h in hooks:
            h.mode, h.recorded = None, None


def take_recorded(hooks: list[RouterHook]) -> Optional[torch.Tensor]:
    """The last forward's choices ``[layers, tokens, k]`` (the hooks' layer order), and clears them."""
    if not hooks or hooks[0].recorded is None:
        return None
    out = torch.stack([h.recorded for h in hooks])
    for h in hooks:
        h.recorded = None
    return out


def _local_tokens(routing: torch.Tensor, layer: int, model) -> torch.Tensor:
    """``routing[b, s, layers, k]``'s layer in the router's token order: ``[s, b]`` flattened, and
    under sequence parallelism this TP rank's slice of the sequence."""
    per_layer = routing[:, :, layer].transpose(0, 1)  # [s, b, k]
    config = model.config
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        group = model.pg_collection.tp
        per_layer = per_layer.chunk(group.size(), dim=0)[group.rank()]
    return per_layer.reshape(-1, per_layer.shape[-1]).long()


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routing: Optional[torch.Tensor], apply: bool = True) -> Iterator[None]:
    """Route the forward(s) inside the block through ``routing`` ``[b, s, layers, k]`` (expert id + 1,
    0 = the router's own choice), the same tokens as the model's input; ``apply=False`` only counts
    how many tokens the router would send elsewhere (:func:`mismatch_counts`). ``routing=None``:
    nothing changes."""
    hooks = router_hooks(model) if routing is not None else []
    module = getattr(model, "module", model)
    for h in hooks:
        h.mode, h.target = ("replay" if apply else "compare"), _local_tokens(routing, h.layer, module)
    try:
        yield
    finally:
        for h in hooks:
            h.mode, h.target = None, None


def reset_mismatch(models) -> None:
    """Forget the mismatch counts of ``models``' routers (this rank only)."""
    for model in models:
        for h in router_hooks(model):
            h.mismatched, h.compared = 0, 0


def mismatch_counts(models, groups) -> tuple[float, float]:
    """(tokens x layers routed differently from the record, tokens x layers with a record) since the
    last call, summed over the layout (pipeline stages, data-parallel ranks, and the TP ranks'
    sequence slices under sequence parallelism); resets the counts. Collective."""
    vec = torch.zeros(2, dtype=torch.float64, device=groups.device)
    for model in models:
        for h in router_hooks(model):
            vec[0] += float(h.mismatched) if not torch.is_tensor(h.mismatched) else h.mismatched.double().item()
            vec[1] += float(h.compared) if not torch.is_tensor(h.compared) else h.compared.double().item()
            h.mismatched, h.compared = 0, 0
    if groups.layout.sequence_parallel and groups.pgs.tp.size() > 1:
        dist.all_reduce(vec, group=groups.pgs.tp)
    for group in (groups.pgs.pp, getattr(groups.pgs, "dp_cp", None) or groups.pgs.dp):
        if group.size() > 1:
            dist.all_reduce(vec, group=group)
    return float(vec[0]), float(vec[1])
