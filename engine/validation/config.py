"""Validation settings of the RL job's ``rollout`` section (light module: no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hyflow.config import ConfigError
from hyflow.config.checks import check_finite, check_positive


@dataclass
class ValKwargs:
    """How validation samples (verl's ``rollout.val_kwargs``): greedy by default, or ``n`` samples
    at a temperature; every validation uses the same seeds, so two validations of the same
    weights give the same numbers (and ``hyflow eval`` of the checkpoint gives them too)."""

    n: int = field(default=1, metadata={
        "unit": "responses per prompt", "help": "responses per validation prompt (the N of mean@N, best@N)"})
    do_sample: bool = field(default=False, metadata={
        "help": "false: greedy decoding whatever the temperature (verl's default); true: sample with "
                "temperature / top_k / top_p"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature when do_sample (0 = greedy)"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 or -1 = off)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1 = off)"})
    seed: int = field(default=0, metadata={"help": "base seed of validation sampling (keyed per prompt and sample)"})

    def validate(self) -> None:
        check_positive(self, "n")
        check_finite(self, "temperature", "top_p")
        if self.top_k == -1:  # verl's "off"
            self.top_k = 0
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"need temperature >= 0, top_k >= 0 (or -1) and 0 < top_p <= 1; got "
                              f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}")
        if self.n > 1 and not self.do_sample:
            raise ConfigError(f"n={self.n} greedy responses would all be the same: set "
                              "rollout.val_kwargs.do_sample=true (and a temperature) or n=1", key="n")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0
