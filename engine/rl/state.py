"""Everything an RL run carries from one step to the next, as one object.

:class:`RLState` holds the models (with their optimizers and schedulers), the prompt loader's
position, the KL controller, the step supervisor and the step counter. Checkpoints save the
models through :meth:`RLModels.trained` and the rest as JSON through :meth:`state_dict`; a
resumed run calls :meth:`load_state_dict` and continues bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.rl.models import RLModels


@dataclass
class RLState:
    """The state of one rank's RL run.

    Attributes:
        models: actor (+ its weight path and rollouts), reference, critic, reward model.
        loader: the prompt loader (its position is checkpointed).
        kl_ctrl: the KL coefficient controller (fixed or adaptive).
        supervisor: preemption flags and NaN/inf guard (:class:`hyflow.training.supervisor.StepSupervisor`).
        step: RL steps completed; the next step is ``step + 1`` and every random stream of a step
            (generation seeds, mini-batch assignment) is keyed by that number.
        stale_weights: the older generation weights of ``rollout.force_staleness`` (tests and
            benchmarks; :class:`hyflow.rl.staleness.StaleWeights`), not checkpointed.
    """

    models: RLModels
    loader: Any
    kl_ctrl: Any
    supervisor: Any
    step: int = 0
    stale_weights: Any = None

    def state_dict(self) -> dict[str, Any]:
        """The JSON-able part (models are saved separately, as dist checkpoints)."""
        return {"step": self.step, "data": self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "supervisor": self.supervisor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.loader.load_state_dict(state["data"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.supervisor.load_state_dict(state["supervisor"])
