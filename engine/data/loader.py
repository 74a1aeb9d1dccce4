"""Deterministic, resumable batching of a prompt dataset.

:class:`EpochSampler` yields batches of indices in an order fixed by ``(seed, epoch)``; its
``state_dict`` (epoch, index of the next batch) resumes the exact position after a checkpoint.
:class:`PromptLoader` turns those indices into :class:`~hyflow.data.dataset.PromptRecord` batches.
"""
from __future__ import annotations

import logging
from typing import Iterator, Optional

import numpy as np

from hyflow.data.dataset import DatasetError, PromptDataset, PromptRecord

__all__ = ["EpochSampler", "PromptLoader"]

_LOG = logging.getLogger(__name__)


class EpochSampler:
    """Batches of dataset indices; the order of epoch ``e`` depends only on ``(seed, e)``.

    Each epoch yields ``size // batch_size`` full batches (the tail is dropped, a different one
    each epoch when shuffling). ``state_dict()`` is the position of the *next* batch.
    """

    def __init__(self, size: int, batch_size: int, shuffle: bool = True, seed: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if size < batch_size:
            raise DatasetError(f"the dataset has {size} prompts, fewer than one batch of {batch_size} "
                               f"(data.train_batch_size)")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.epoch, self.index = 0, 0
        self._order: Optional[np.ndarray] = None

    @property
    def batches_per_epoch(self) -> int:
        return self.size // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next_indices(self) -> list[int]:
        """The next batch of indices (moving to the next epoch when this one is used up)."""
        if self.index + self.batch_size > self.size:
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.order(self.epoch)
        out = self._order[self.index:self.index + self.batch_size].tolist()
        self.index += self.batch_size
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": self.size,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position; the dataset size and seed must match."""
        for key in ("size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DatasetError(
                    f"cannot resume the data position: the checkpoint's {key}={state[key]!r} differs from "
                    f"this run's {getattr(self, key)!r} (the prompt order would not match)", key=key)
        self.epoch, self.index, self._order = int(state["epoch"]), int(state["index"]), None
        if state.get("batch_size", self.batch_size) != self.batch_size:
            _LOG.warning("data batch size changed on resume (%s -> %s); continuing at prompt %d of epoch %d",
                         state.get("batch_size"), self.batch_size, self.index, self.epoch)


class PromptLoader:
    """Endless batches of :class:`PromptRecord` with a resumable position."""

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool = True, seed: int = 1) -> None:
        self.dataset = dataset
        self.sampler = EpochSampler(len(dataset), batch_size, shuffle, seed)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def next_batch(self) -> list[PromptRecord]:
        return [self.dataset[i] for i in self.sampler.next_indices()]

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
