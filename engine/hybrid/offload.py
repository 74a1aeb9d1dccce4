"""Optimizer state out of device memory while the actor generates.

Generation needs room for the generation buffer and the KV cache; Adam's two moments
(and, with bf16 training, the fp32 main weights) are 2-3x the actor's weights and idle
until the next update. :class:`OptimizerStateOffload` copies them to host memory (pinned
on CUDA) and frees their device storage; :meth:`restore` brings them back bit for bit
into the *same* tensor objects, so the optimizer and anything viewing them stay valid.

On CUDA both copies are asynchronous (pinned host memory) on the current stream: the caching
allocator hands a freed block only to work queued after the copy that reads it, and the restore
is queued after the offload. The freed blocks stay in PyTorch's cache (no ``empty_cache()`` per
transition, which would return them to the driver and make the next ``cudaMalloc`` of the
generation's KV cache and of the restore pay for it again).

Megatron-Core's ``MegatronOptimizer.offload_to_cpu`` does a similar move but rebinds
``p.data`` of every optimizer parameter, which for fp32 training are the model's own
weights (here: released or resharded during generation), so it is not used.
"""

from __future__ import annotations

import torch


def _inner_optimizers(optimizer) -> list:
    chained = getattr(optimizer, "chained_optimizers", None)
    parts = chained if chained is not None else [optimizer]
    return [getattr(p, "optimizer", p) for p in parts if getattr(p, "optimizer", p) is not None]


class OptimizerStateOffload:
    """Moves an optimizer's state tensors (not the model's weights) to host and back."""

    def __init__(self, optimizer, model_params) -> None:
        self.optimizer = optimizer
        self._model_params = list(model_params)
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _tensors(self) -> list[torch.Tensor]:
        # Never the model's weights, nor views of their storage (the distributed optimizer's
        # fp32 shards are views of the DDP parameter buffer).
        seen = {p.untyped_storage().data_ptr() for p in self._model_params}
        out = []
        for inner in _inner_optimizers(self.optimizer):
            candidates = [v for state in inner.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor)]
            candidates += [p for g in inner.param_groups for p in g["params"]]
            for t in candidates:
                storage = t.untyped_storage()
                if storage.nbytes() == 0 or t.dim() == 0 or storage.data_ptr() in seen:
                    continue  # scalars (Adam's step) stay; shared storages move once
                seen.add(storage.data_ptr())
                out.append(t)
        return out

    @torch.no_grad()
    def offload(self) -> int:
        """Copy the state to host and free its device storage; returns the bytes freed."""
        if self._saved:
            return 0
        freed = 0
        for t in self._tensors():
            storage = t.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=t.is_cuda)
            host.copy_(whole, non_blocking=t.is_cuda)
            freed += storage.nbytes()
            storage.resize_(0)
            self._saved.append((t, host))
        return freed

    @torch.no_grad()
    def restore(self) -> None:
        """Reallocate the device storage and copy the state back."""
        for t, host in self._saved:
            storage = t.untyped_storage()
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).copy_(host, non_blocking=t.is_cuda)
        self._saved = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)
