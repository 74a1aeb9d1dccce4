"""A forced off-policy lag for tests and benchmarks (``rollout.force_staleness = k``).

The generator samples with the actor's weights of ``k`` steps ago while the update starts from
the current ones: the situation of asynchronous / one-step-off training, reproduced inside the
synchronous step so that rollout corrections (TIS, MIS, IcePop) can be tested and compared on
it. Not a training mode (``hyflow.rl`` has none of the overlap such a mode buys).

How: the generation model's parameters are views of one flat buffer that the weight path fills
from the training weights (:meth:`hyflow.roles.WeightPath.generation_weights`, a weight path
whose ``capabilities.stale_weights`` is set: the colocated hybrid engine). :meth:`swap_in` keeps a
copy of that buffer (the current weights) and loads the one of ``k`` steps ago into it;
:meth:`swap_out` puts the current weights back before the engine returns to training (which
refills the training weights from the buffer). ``k + 1`` copies of the generation weights stay
in host or device memory.
"""

from __future__ import annotations

from collections import deque

import torch

from hyflow.roles import WeightPath


class StaleWeights:
    """Generation with the weights of ``lag`` steps ago (the first ``lag`` steps use the oldest
    weights there are: the initial ones)."""

    def __init__(self, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"lag must be >= 1, got {lag}")
        self.lag = lag
        self._history: deque[torch.Tensor] = deque()  # oldest first
        self._current: torch.Tensor | None = None

    @torch.no_grad()
    def swap_in(self, weights: WeightPath) -> None:
        """After ``weights.to_generation()``: load the stale weights into the generation model."""
        flat = _flat(weights)
        self._current = flat.clone()
        self._history.append(self._current)
        if len(self._history) > self.lag + 1:
            self._history.popleft()
        flat.copy_(self._history[0])

    @torch.no_grad()
    def swap_out(self, weights: WeightPath) -> None:
        """Before ``weights.to_training()``: the current weights back into the buffer."""
        if self._current is not None:
            _flat(weights).copy_(self._current)
            self._current = None


def _flat(weights: WeightPath) -> torch.Tensor:
    flat = weights.generation_weights()
    if flat is None:  # the preflight refuses such configs (hyflow.jobs.rl_preflight.check_role_capabilities)
        raise RuntimeError(f"{type(weights).__name__} holds no generation weights of its own to swap "
                           "(rollout.force_staleness needs a weight path with capabilities.stale_weights)")
    return flat
