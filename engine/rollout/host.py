"""Host-to-device transfer of per-step scheduling data (slots, positions, tokens, parameters).

The scheduler decides on the host (Python ints); each forward needs a few small index
tensors on the model's device. ``torch.tensor(values, device="cuda")`` copies from pageable
memory, which makes PyTorch synchronise the stream (the host waits for every queued kernel),
once per tensor per step. :func:`to_device` builds the tensor in pinned host memory and copies
it asynchronously instead (the caching host allocator keeps the block alive until the copy
has run), so a decode step never waits for the GPU except where it must read sampled tokens.
On CPU it is a plain ``torch.tensor``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or a list of equal-length lists) as a tensor on ``device``, without a
    host-device synchronisation on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    staged = torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True)
    return staged.to(device, non_blocking=True)
