"""Model descriptions: the architecture of a Llama / Qwen2 / Mistral decoder, or of a
mixture-of-experts one (Qwen3-MoE, Qwen2-MoE, Mixtral: :class:`MoEDescription`).

A :class:`ModelDescription` is what the engine needs to build a Megatron
``GPTModel`` and what the converters write next to a checkpoint
(``model.json``). It holds no parallelism: layouts are separate objects.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from hyflow.config import ConfigError
from hyflow.models.rope import LENGTH_DEPENDENT, inv_freq

DENSE_FAMILIES = ("llama", "qwen2", "mistral")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
DESCRIPTION_FILE = "model.json"


class ModelDescriptionError(ConfigError):
    """A model description that cannot describe a valid model."""


ROPE_TYPES = ("linear", "llama3", "dynamic", "yarn", "longrope")


@dataclass
class RopeScaling:
    """RoPE frequency scaling, as in HF ``rope_scaling`` (see :mod:`hyflow.models.rope`).

    Attributes:
        type: ``linear`` (positions divided by ``factor``), ``llama3`` (Llama 3.1's
            wavelength-dependent scaling), ``dynamic`` (dynamic NTK: the base grows with
            the sequence length past ``max_position_embeddings``), ``yarn`` (NTK-by-parts
            interpolation with attention scaling) or ``longrope`` (per-dimension factors).
        factor: scaling factor (the context extension ratio).
        low_freq_factor: llama3 only.
        high_freq_factor: llama3 only.
        original_max_position_embeddings: llama3 / yarn / longrope: the pre-scaling context.
        beta_fast: yarn: rotations where the ramp to interpolation starts (HF default 32).
        beta_slow: yarn: rotations where it ends (HF default 1).
        mscale: yarn: with ``mscale_all_dim``, the attention factor is the ratio of
            ``0.1 * m * ln(factor) + 1`` for the two.
        mscale_all_dim: yarn: see ``mscale``.
        attention_factor: yarn / longrope: explicit attention factor (null = derived).
        truncate: yarn: round the correction range to whole dimensions (HF default true).
        short_factor: longrope: per-dimension factors (head_dim / 2 of them) up to the
            original context.
        long_factor: longrope: per-dimension factors beyond it.
    """

    type: str = "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    short_factor: Optional[list[float]] = None
    long_factor: Optional[list[float]] = None

    def validate(self, head_dim: Optional[int] = None) -> None:
        if self.type not in ROPE_TYPES:
            raise ModelDescriptionError(
                f"rope_scaling.type={self.type!r} is not supported; use one of {', '.join(ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ModelDescriptionError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelDescriptionError(
                "rope_scaling: high_freq_factor must exceed low_freq_factor "
                f"({self.high_freq_factor} <= {self.low_freq_factor})"
            )
        if not isinstance(self.original_max_position_embeddings, int) or \
                self.original_max_position_embeddings <= 0:
            raise ModelDescriptionError("rope_scaling.original_max_position_embeddings must be a positive "
                                        f"integer, got {self.original_max_position_embeddings!r}")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ModelDescriptionError(
                f"rope_scaling.attention_factor must be > 0 or null, got {self.attention_factor}")
        if self.type == "yarn" and self.beta_fast < self.beta_slow:
            raise ModelDescriptionError(
                f"rope_scaling: yarn needs beta_fast >= beta_slow ({self.beta_fast} < {self.beta_slow})")
        if self.type == "longrope":
            for name in ("short_factor", "long_factor"):
                value = getattr(self, name)
                if not isinstance(value, list) or (head_dim is not None and len(value) != head_dim // 2):
                    want = f"{head_dim // 2} numbers (head_dim / 2)" if head_dim else "a list of numbers"
                    raise ModelDescriptionError(
                        f"rope_scaling.{name} of longrope must be {want}, got "
                        f"{len(value) if isinstance(value, list) else value!r}")


SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")


@dataclass
class MoEDescription:
    """The mixture-of-experts MLP of every decoder layer (Megatron-Core's ``MoELayer``).

    Attributes:
        num_experts: routed experts per layer.
        top_k: experts each token is sent to.
        ffn_hidden_size: SwiGLU intermediate size of one routed expert.
        score_function: ``softmax`` or ``sigmoid`` router scores.
        pre_softmax: softmax over all experts before the top-k (the chosen probabilities are
            not renormalised: HF ``norm_topk_prob: false``); false: softmax over the top-k
            logits (renormalised: Mixtral, HF ``norm_topk_prob: true``).
        topk_scaling_factor: multiplies the chosen probabilities (null = 1).
        shared_expert_ffn_hidden_size: intermediate size of the shared expert every token
            goes through (null = none; Qwen2-MoE has one).
        shared_expert_gate: the shared expert's output is scaled by ``sigmoid(x . w)``
            (Qwen2-MoE).
        load_balancing: ``aux_loss`` (Switch-style load-balancing loss over the micro-batch),
            ``seq_aux_loss`` (per sequence) or ``none``.
        aux_loss_coeff: weight of the load-balancing loss (HF ``router_aux_loss_coef``).
        z_loss_coeff: weight of the router z-loss (null = off).
    """

    num_experts: int = 8
    top_k: int = 2
    ffn_hidden_size: int = 128
    score_function: str = "softmax"
    pre_softmax: bool = False
    topk_scaling_factor: Optional[float] = None
    shared_expert_ffn_hidden_size: Optional[int] = None
    shared_expert_gate: bool = False
    load_balancing: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: Optional[float] = None

    def validate(self) -> None:
        for name in ("num_experts", "top_k", "ffn_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelDescriptionError(f"model.moe.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ModelDescriptionError(
                f"model.moe.top_k={self.top_k} exceeds num_experts={self.num_experts}; a token cannot "
                "pick more experts than there are")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ModelDescriptionError(f"model.moe.score_function={self.score_function!r}; use one of "
                                        f"{', '.join(SCORE_FUNCTIONS)}")
        if self.load_balancing not in LOAD_BALANCING:
            raise ModelDescriptionError(f"model.moe.load_balancing={self.load_balancing!r}; use one of "
                                        f"{', '.join(LOAD_BALANCING)}")
        shared = self.shared_expert_ffn_hidden_size
        if shared is not None and (not isinstance(shared, int) or shared <= 0):
            raise ModelDescriptionError(
                f"model.moe.shared_expert_ffn_hidden_size must be a positive integer or null, got {shared!r}")
        if self.shared_expert_gate and shared is None:
            raise ModelDescriptionError("model.moe.shared_expert_gate needs a shared expert "
                                        "(set shared_expert_ffn_hidden_size)")
        if self.aux_loss_coeff < 0 or (self.z_loss_coeff is not None and self.z_loss_coeff < 0):
            raise ModelDescriptionError("model.moe.aux_loss_coeff and z_loss_coeff must be >= 0")

    def expert_parameters(self, hidden: int) -> int:
        """Parameters of one routed expert (SwiGLU: gate, up, down)."""
        return 3 * hidden * self.ffn_hidden_size

    def layer_parameters(self, hidden: int, active: bool = False) -> int:
        """Parameters of one MoE MLP: router, experts (``top_k`` of them when ``active``),
        shared expert and its gate."""
        experts = (self.top_k if active else self.num_experts) * self.expert_parameters(hidden)
        shared = 3 * hidden * (self.shared_expert_ffn_hidden_size or 0)
        return hidden * self.num_experts + experts + shared + (hidden if self.shared_expert_gate else 0)


@dataclass
class ModelDescription:
    """Architecture of a decoder-only transformer (Llama-style blocks).

    Attributes:
        family: ``llama``, ``qwen2``, ``mistral`` (dense) or ``qwen3_moe``, ``qwen2_moe``,
            ``mixtral`` (mixture of experts: ``moe`` is set).
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
        qk_layernorm: RMSNorm over each query and key head before RoPE (Qwen3).
        moe: the mixture-of-experts MLP (null: a dense SwiGLU MLP of ``ffn_hidden_size``).
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
    qk_layernorm: bool = False
    moe: Optional[MoEDescription] = None
    tied_embeddings: bool = False
    init_method_std: float = 0.02
    tokenizer: Optional[str] = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if isinstance(self.moe, dict):
            known = {f.name for f in fields(MoEDescription)}
            unknown = sorted(set(self.moe) - known)
            if unknown:
                raise ModelDescriptionError(f"unknown model.moe keys {unknown}; valid keys: {sorted(known)}")
            self.moe = MoEDescription(**self.moe)
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
            self.rope_scaling.validate(self.head_dim)
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ModelDescriptionError(
                f"model family {self.family!r} is a {'mixture-of-experts' if self.family in MOE_FAMILIES else 'dense'}"
                f" model but model.moe is {'unset' if self.moe is None else 'set'}; "
                + ("describe its experts in model.moe" if self.moe is None else
                   f"use a mixture-of-experts family ({', '.join(MOE_FAMILIES)}) or drop model.moe"))
        if self.moe is not None:
            self.moe.validate()

    # ------------------------------------------------------------- derived
    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count of the unpadded model (embeddings counted once if tied); ``active``:
        what one token uses (``top_k`` routed experts per MoE layer)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        qkv = h * (self.num_attention_heads + 2 * self.num_query_groups) * d
        if self.qkv_bias:
            qkv += (self.num_attention_heads + 2 * self.num_query_groups) * d
        mlp = self.moe.layer_parameters(h, active) if self.moe is not None else 3 * h * f
        per_layer = qkv + self.query_projection_size * h + mlp + 2 * h + (2 * d if self.qk_layernorm else 0)
        emb = self.vocab_size * h
        return self.num_layers * per_layer + h + emb * (1 if self.tied_embeddings else 2)

    def expert_parameters(self) -> int:
        """Parameters in routed experts (all layers); 0 for a dense model."""
        return 0 if self.moe is None else self.num_layers * self.moe.num_experts * self.moe.expert_parameters(
            self.hidden_size)

    def inv_freq(self, seq_len: Optional[int] = None):
        """RoPE inverse frequencies ``[head_dim / 2]`` (float32, bit-identical to HF's) with
        scaling applied, for a forward of ``seq_len`` tokens (:func:`hyflow.models.rope.inv_freq`)."""
        return inv_freq(self, seq_len)

    @property
    def context_length(self) -> int:
        """Longest sequence the model is meant to run: ``max_position_embeddings``, or what the
        RoPE scaling extends the original context to (``factor x original`` for llama3 / yarn /
        longrope, ``factor x max_position_embeddings`` for dynamic NTK, whose HF threshold is
        ``max_position_embeddings`` itself), whichever is larger."""
        s = self.rope_scaling
        if s is None or s.type == "linear":
            return self.max_position_embeddings
        original = self.max_position_embeddings if s.type == "dynamic" else s.original_max_position_embeddings
        return max(self.max_position_embeddings, int(s.factor * original))

    @property
    def rope_length_dependent(self) -> bool:
        """True when the RoPE frequencies depend on the sequence length (dynamic, longrope)."""
        return self.rope_scaling is not None and self.rope_scaling.type in LENGTH_DEPENDENT

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


def tiny_moe(**overrides: Any) -> ModelDescription:
    """A tiny Qwen3-MoE-shaped model (8 experts, top-2, QK-norm) for tests and the CPU quickstart;
    ``moe`` overrides merge into its MoE settings."""
    moe = dict(num_experts=8, top_k=2, ffn_hidden_size=32, aux_loss_coeff=0.01)
    moe.update(overrides.pop("moe", None) or {})
    base = dict(family="qwen3_moe", vocab_size=256, hidden_size=64, num_layers=4, num_attention_heads=4,
                num_query_groups=2, ffn_hidden_size=128, max_position_embeddings=256, rope_theta=10000.0,
                norm_eps=1e-5, qk_layernorm=True, moe=MoEDescription(**moe))
    base.update(overrides)
    desc = ModelDescription(**base)
    desc.validate()
    return desc


def tiny_llama(**overrides: Any) -> ModelDescription:
    """A few-hundred-thousand-parameter Llama for tests and the CPU quickstart."""
    base = dict(family="llama", vocab_size=256, hidden_size=64, num_layers=4,
                num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                max_position_embeddings=256, rope_theta=10000.0, norm_eps=1e-5)
    base.update(overrides)
    desc = ModelDescription(**base)
    desc.validate()
    return desc
