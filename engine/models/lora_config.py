"""LoRA settings of a trained model (``actor.lora``, ``critic.lora``). A light module (no torch):
configs validate before anything heavy is imported; the layers are :mod:`hyflow.models.lora`."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from hyflow.config import ConfigError

#: The Megatron linear layers an adapter can sit on (the dense decoder's four per layer).
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: Hugging Face / PEFT module names -> the fused Megatron layer holding them.
HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


@dataclass
class LoRAConfig:
    """Low-rank adapters on the model's linear layers: ``W x + (alpha / rank) B A x``, with ``A``
    [rank, in] drawn like PEFT's (Kaiming-uniform) and ``B`` [out, rank] zero, so the adapted model
    starts as the base model exactly. Only the adapters train (the base weights get no gradient,
    no optimizer state, no gradient buffer); the reference is the base with the adapters off."""

    rank: int = field(default=16, metadata={"help": "adapter rank r (the inner dimension of B A)"})
    alpha: float = field(default=32.0, metadata={"help": "scale numerator: the update is (alpha / rank) B A"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the adapter's input during training"})
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS), metadata={
        "help": "Megatron layers that get adapters: linear_qkv (fused q/k/v), linear_proj (o_proj), "
                "linear_fc1 (fused gate/up), linear_fc2 (down_proj)"})

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of B A."""
        return self.alpha / self.rank

    def validate(self) -> None:
        problems = []
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            problems.append(f"rank must be a positive integer, got {self.rank!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            problems.append(f"alpha must be a finite number > 0, got {self.alpha}")
        if not (math.isfinite(self.dropout) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            problems.append(f"targets is empty; name one or more of {', '.join(LORA_TARGETS)}")
        for target in self.targets:
            if target in LORA_TARGETS:
                continue
            if target in HF_TARGETS:
                problems.append(f"target {target!r} is a Hugging Face name: the Megatron layers fuse q/k/v into "
                                f"linear_qkv and gate/up into linear_fc1, so use {HF_TARGETS[target]!r}")
            else:
                close = difflib.get_close_matches(target, LORA_TARGETS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"unknown target {target!r}{hint}; known: {', '.join(LORA_TARGETS)}")
        duplicates = sorted({t for t in self.targets if self.targets.count(t) > 1})
        if duplicates:
            problems.append(f"targets lists {', '.join(duplicates)} more than once")
        if problems:
            raise ConfigError("; ".join(problems))

    def to_dict(self) -> dict:
        """Plain data (checkpoints record it)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}
