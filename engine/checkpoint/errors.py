"""The errors a checkpoint can raise (a light module: no torch import)."""

from __future__ import annotations

from typing import Optional


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged, untrusted, or does not fit the model."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files do not match what was written: ``path`` is the checkpoint,
    ``file`` the first damaged file (relative to ``path``), ``reason`` a short tag for the
    kind of damage (``checksum``, ``size``, ``missing``, ``unreadable``) used to rename it."""

    def __init__(self, message: str, path: str, file: Optional[str] = None, reason: str = "damaged") -> None:
        super().__init__(message)
        self.path, self.file, self.reason = path, file, reason


class NonFiniteWeights(CheckpointError):
    """A model tensor holds NaN or inf (:mod:`hyflow.checkpoint.finite`): ``tensor`` names it on the
    rank that holds it; ``peer`` is True on the other ranks (they only learnt that some rank does)."""

    def __init__(self, message: str, tensor: Optional[str] = None, peer: bool = False) -> None:
        super().__init__(message)
        self.tensor, self.peer = tensor, peer
