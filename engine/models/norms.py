"""RMSNorm for Megatron's local and SDPA layer specs, sequence parallelism included.

Megatron's ``WrappedTorchNorm`` (what the local spec uses without Apex) refuses
``sequence_parallel``: under it a norm sees only its rank's slice of the sequence, so its
weight's gradient must be summed over the tensor-parallel group. This norm is torch's
``RMSNorm`` with Megatron's constructor and the ``sequence_parallel`` mark Megatron's
``finalize_model_grads`` reads to do that all-reduce (what Transformer Engine's norms carry).
Parameter names (``weight``) are those of ``WrappedTorchNorm``'s module, so checkpoints are
unchanged.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built like a Megatron norm module: ``(config, hidden_size, eps)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"hyflow's models use RMSNorm, got normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
