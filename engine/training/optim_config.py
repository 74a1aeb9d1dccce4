"""Optimizer settings (a light module: no torch or Megatron imports, so configs
validate before anything heavy is loaded)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hyflow.config import ConfigError


@dataclass
class OptimConfig:
    """Optimizer settings for one trained role.

    Attributes:
        lr: peak learning rate.
        min_lr: floor of the decay schedule.
        weight_decay: decoupled weight decay (AdamW).
        adam_beta1: Adam beta1.
        adam_beta2: Adam beta2.
        adam_eps: Adam epsilon.
        clip_grad: global gradient-norm clip (0 disables).
        warmup_steps: linear warm-up steps.
        decay_style: ``constant``, ``linear`` or ``cosine`` after warm-up.
        distributed_optimizer: shard optimizer state over data-parallel ranks (ZeRO-1).
    """

    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    distributed_optimizer: bool = False

    def validate(self) -> None:
        # Every number must be finite: a NaN passes every ``<`` / ``>`` test below unnoticed.
        for name in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ConfigError(f"must be a finite number, got {value}", key=name)
        if self.lr <= 0:
            raise ConfigError(f"must be > 0, got {self.lr}", key="lr")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"must be in [0, lr={self.lr}], got {self.min_lr}", key="min_lr")
        if self.weight_decay < 0:
            raise ConfigError(f"must be >= 0, got {self.weight_decay}", key="weight_decay")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"must be in [0, 1), got {getattr(self, name)}", key=name)
        if self.adam_eps <= 0:
            raise ConfigError(f"must be > 0, got {self.adam_eps}", key="adam_eps")
        if self.clip_grad < 0:
            raise ConfigError(f"must be >= 0, got {self.clip_grad}", key="clip_grad")
        if self.warmup_steps < 0:
            raise ConfigError(f"must be >= 0, got {self.warmup_steps}", key="warmup_steps")
