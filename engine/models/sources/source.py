"""Streaming weight sources: read one HF tensor, or a slice of it, at a time.

A :class:`WeightSource` exposes HF tensor names, their shapes and dtypes from
headers only, and reads tensors or row / column ranges on demand. Converters
call :meth:`WeightSource.release` after each block they read, so mapped file
pages and open files never accumulate in the converter's resident memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class WeightSource(ABC):
    """Read-only access to a checkpoint's tensors by HF name."""

    #: e.g. ``"safetensors (3 shards)"``; for messages and reports.
    kind: str = ""

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` (from headers; no data is read)."""

    @abstractmethod
    def dtype(self, name: str) -> torch.dtype:
        """Dtype ``read`` returns for ``name``."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """The whole tensor (a new tensor, not a view of a mapped file)."""

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0)."""
        return self.read(name)[start:stop].clone()

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` (dim 1) of a matrix."""
        return self.read(name)[:, start:stop].contiguous()

    def nbytes(self, name: str) -> int:
        """Bytes of ``name`` as :meth:`read` returns it."""
        numel = 1
        for d in self.shape(name):
            numel *= d
        return numel * torch.empty((), dtype=self.dtype(name)).element_size()

    def release(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Close open files and drop caches (called between parameters)."""
