"""A model that run checkpoints save: its DDP chunks, optimizer and LR scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hyflow.checkpoint.errors import CheckpointError


@dataclass
class TrainedModel:
    """A model saved in every checkpoint, with its optimizer and LR scheduler (None: frozen)."""

    chunks: list
    optimizer: Any = None
    scheduler: Any = None

    @property
    def absent(self) -> bool:
        """No part of the model lives on this rank (a rank of another pool, ``trainer.mode:
        one_step_off``): it joins the checkpoint's collectives (Megatron's dist_checkpointing runs
        them over the world) with nothing to write or read. Rank 0 must hold the models."""
        return not self.chunks

    @property
    def module(self) -> torch.nn.Module:
        """The model inside the DDP wrapper (one chunk: virtual pipeline stages are not supported)."""
        if len(self.chunks) != 1:
            raise CheckpointError(f"checkpointing supports one model chunk per rank, got {len(self.chunks)} "
                                  "(virtual pipeline stages)")
        return getattr(self.chunks[0], "module", self.chunks[0])
