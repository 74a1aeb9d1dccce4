"""Model descriptions: the architecture of a Llama / Qwen2 / Mistral decoder.

A :class:`ModelDescription` is what the engine needs to build a Megatron
``GPTModel`` and what the converters write next to a checkpoint
(``model.json``). It holds no parallelism: layouts are separate objects.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Optional

from hyflow.config import ConfigError

FAMILIES = ("llama", "qwen2", "mistral")
DESCRIPTION_FILE = "model.json"


class ModelDescriptionError(ConfigError):
    """A model description that cannot describe a valid model."""


@dataclass
class RopeScaling:
    """RoPE frequency scaling, as in HF ``rope_scaling``.

    Attributes:
        type: ``linear`` (positions divided by ``factor``) or ``llama3``
            (wavelength-dependent scaling of Llama 3.1).
        factor: scaling factor.
        low_freq_factor: llama3 only.
        high_freq_factor: llama3 only.
        original_max_position_embeddings: llama3 only: the pre-scaling context.
    """

    type: Literal["linear", "llama3"] = "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self) -> None:
        if self.type not in ("linear", "llama3"):
            raise ModelDescriptionError(
                f"rope_scaling.type={self.type!r} is not supported; use 'linear' or 'llama3'"
            )
        if self.factor <= 0:
            raise ModelDescriptionError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelDescriptionError(
                "rope_scaling: high_freq_factor must exceed low_freq_factor "
                f"({self.high_freq_factor} <= {self.low_freq_factor})"
            )


@dataclass
class ModelDescription:
    """Architecture of a decoder-only transformer (Llama-style blocks).

    Attributes:
        family: ``llama``, ``qwen2`` or ``mistral``.
        vocab_size: tokenizer vocabulary (unpadded; TP padding is added at build).
        hidden_size: model width.
        num_layers: transformer blocks.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (grouped-query attention).
        ffn_hidden_size: SwiGLU intermediate size.
        max_position_embeddings: longest sequence the model supports.
        head_dim: per-head size; defaults to hidden_size // num_attention_heads.
        rope_theta: RoPE base.
        rope_scaling: optional RoPE scaling.
        norm_eps: RMSNorm epsilon.
        qkv_bias: bias on the Q/K/V projection (Qwen2).
        tied_embeddings: output layer shares the input embedding.
        init_method_std: std of the random init (for models built from scratch).
        tokenizer: path of the tokenizer (HF directory or sentencepiece model), if any.
        eos_token_ids: end-of-sequence ids of the tokenizer.
    """

    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_attention_heads: int = 32
    num_query_groups: Optional[int] = None
    ffn_hidden_size: int = 11008
    max_position_embeddings: int = 4096
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tied_embeddings: bool = False
    init_method_std: float = 0.02
    tokenizer: Optional[str] = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        """Raise :class:`ModelDescriptionError` naming the first inconsistent field."""
        if self.family not in FAMILIES:
            raise ModelDescriptionError(
                f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "num_query_groups", "ffn_hidden_size", "max_position_embeddings", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelDescriptionError(f"model.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ModelDescriptionError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.head_dim % 2:
            raise ModelDescriptionError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ModelDescriptionError("rope_theta and norm_eps must be positive")
        if self.rope_scaling is not None:
            self.rope_scaling.validate()

    # ------------------------------------------------------------- derived
    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count of the unpadded model (embeddings counted once if tied)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        qkv = h * (self.num_attention_heads + 2 * self.num_query_groups) * d
        if self.qkv_bias:
            qkv += (self.num_attention_heads + 2 * self.num_query_groups) * d
        per_layer = qkv + self.query_projection_size * h + 3 * h * f + 2 * h
        emb = self.vocab_size * h
        return self.num_layers * per_layer + h + emb * (1 if self.tied_embeddings else 2)

    def inv_freq(self):
        """RoPE inverse frequencies [head_dim/2] in float64 with scaling applied."""
        import torch

        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        s = self.rope_scaling
        if s is None:
            return inv
        if s.type == "linear":
            return inv / s.factor
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelDescription":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelDescriptionError(
                f"unknown model description keys {unknown}; valid keys: {sorted(known)}"
            )
        desc = cls(**data)
        desc.validate()
        return desc

    def save(self, directory: str) -> str:
        path = os.path.join(directory, DESCRIPTION_FILE)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
        return path

    @classmethod
    def load(cls, path: str) -> "ModelDescription":
        """Read a description from ``model.json`` or a directory containing one."""
        if os.path.isdir(path):
            path = os.path.join(path, DESCRIPTION_FILE)
        if not os.path.exists(path):
            raise ModelDescriptionError(
                f"no model description at {path}; convert a checkpoint with "
                "`hyflow convert hf2mcore`, which writes it"
            )
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelDescriptionError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(data)


def tiny_llama(**overrides: Any) -> ModelDescription:
    """A few-hundred-thousand-parameter Llama for tests and the CPU quickstart."""
    base = dict(family="llama", vocab_size=256, hidden_size=64, num_layers=4,
                num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                max_position_embeddings=256, rope_theta=10000.0, norm_eps=1e-5)
    base.update(overrides)
    desc = ModelDescription(**base)
    desc.validate()
    return desc
