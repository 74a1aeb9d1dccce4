"""RoPE frequencies of every scaling family, computed as transformers computes them.

:func:`inv_freq` returns the inverse frequencies ``[head_dim / 2]`` (float32) of a
:class:`~hyflow.models.description.ModelDescription` for a forward whose longest row
has ``seq_len`` tokens; :func:`attention_factor` the factor HF multiplies cos / sin by.

Families (``rope_scaling.type``; formulas from the papers / HF's ``rope_scaling`` docs):

* none: ``theta ** (-2i / d)``;
* ``linear``: divided by ``factor`` (position interpolation);
* ``llama3``: Llama 3.1's wavelength-dependent interpolation;
* ``dynamic`` (dynamic NTK): up to ``max_position_embeddings`` tokens the plain
  frequencies; for a longer forward of ``L`` tokens the base grows to
  ``theta * (factor L / max_pos - (factor - 1)) ** (d / (d - 2))``;
* ``yarn``: per-dimension blend of interpolated (``/ factor``) and original frequencies
  over a linear ramp between the ``beta_fast`` / ``beta_slow`` correction dimensions, and
  an attention factor (``0.1 ln(factor) + 1``, or the ``mscale`` / ``mscale_all_dim``
  ratio, or ``attention_factor`` given);
* ``longrope``: per-dimension ``short_factor`` up to ``original_max_position_embeddings``
  tokens, ``long_factor`` beyond, and attention factor
  ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``.

Precision: every step is float32 in the same order of operations as transformers 5, so
the frequencies are bit-identical to HF's; at 32K positions a 1-ulp difference in a
frequency moves the angle by ~1e-3 rad, which is visible in logits.

Length dependence (``dynamic``, ``longrope``): transformers picks the frequencies of a
forward from ``max(position_ids) + 1``. hyflow does the same per forward in training (the
padded sequence length, or the packed sequence's longest segment) and per *row* in
generation (the row's own last position + 1: a row is generated exactly as HF's
``generate`` generates it alone, independent of what else is in the batch). Keys already in
the KV cache keep the frequencies they were rotated with, as in HF. Two consequences,
both inherent to these families: a generated token's log-prob can differ from the one a
training forward of the whole sequence computes once the sequence passes the original
context; and chunked prefill of a prompt longer than that context rotates each chunk with
the frequencies of its chunk end. HF's module also *caches* the longest length it has seen
(a later, shorter forward above the original context reuses the longer length's
frequencies); hyflow is stateless: every forward behaves like a freshly loaded HF model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from hyflow.models.description import ModelDescription

#: families whose frequencies depend on the sequence length of the forward
LENGTH_DEPENDENT = ("dynamic", "longrope")


def _exponents(dim: int) -> torch.Tensor:
    """``2i / d`` for i < d / 2, float32."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _plain(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def _llama3(desc: "ModelDescription") -> torch.Tensor:
    s = desc.rope_scaling
    inv = _plain(desc.rope_theta, desc.head_dim)
    context = s.original_max_position_embeddings
    low_wavelen, high_wavelen = context / s.low_freq_factor, context / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _dynamic(desc: "ModelDescription", seq_len: Optional[int]) -> torch.Tensor:
    s, d, max_pos = desc.rope_scaling, desc.head_dim, desc.max_position_embeddings
    if seq_len is None or seq_len <= max_pos:
        # HF's initial frequencies: the formula at L = max_pos, in Python floats.
        base = desc.rope_theta * ((s.factor * max_pos / max_pos) - (s.factor - 1)) ** (d / (d - 2))
    else:
        # HF's update path: L is a tensor (max(position_ids) + 1), so float32 arithmetic.
        length = torch.tensor(seq_len, dtype=torch.int64)
        base = desc.rope_theta * ((s.factor * length / max_pos) - (s.factor - 1)) ** (d / (d - 2))
    return 1.0 / (base ** _exponents(d))


def _yarn_correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """Dimension whose wavelength fits ``rotations`` times in ``context`` tokens."""
    return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _yarn(desc: "ModelDescription") -> torch.Tensor:
    s, d, theta = desc.rope_scaling, desc.head_dim, desc.rope_theta
    pos_freqs = theta ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (s.factor * pos_freqs)
    low = _yarn_correction_dim(s.beta_fast, d, theta, s.original_max_position_embeddings)
    high = _yarn_correction_dim(s.beta_slow, d, theta, s.original_max_position_embeddings)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency per dimension
    return interpolated * (1 - keep) + extrapolated * keep


def _longrope(desc: "ModelDescription", seq_len: Optional[int]) -> torch.Tensor:
    s, d = desc.rope_scaling, desc.head_dim
    long = seq_len is not None and seq_len > s.original_max_position_embeddings
    ext = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
    return 1.0 / (ext * desc.rope_theta ** _exponents(d))


def inv_freq(desc: "ModelDescription", seq_len: Optional[int] = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32) for a forward of ``seq_len`` tokens.

    ``seq_len`` matters only for the length-dependent families (``dynamic``, ``longrope``);
    ``None`` gives their short-context frequencies."""
    s = desc.rope_scaling
    if s is None:
        return _plain(desc.rope_theta, desc.head_dim)
    if s.type == "linear":
        inv = _plain(desc.rope_theta, desc.head_dim)
        inv /= s.factor
        return inv
    if s.type == "llama3":
        return _llama3(desc)
    if s.type == "dynamic":
        return _dynamic(desc, seq_len)
    if s.type == "yarn":
        return _yarn(desc)
    if s.type == "longrope":
        return _longrope(desc, seq_len)
    raise ValueError(f"unknown rope_scaling.type {s.type!r}")


def attention_factor(desc: "ModelDescription") -> float:
    """The factor HF multiplies RoPE's cos and sin by (so q.k scales by its square)."""
    s = desc.rope_scaling
    if s is None or s.type not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.type == "longrope":
        if s.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


def softmax_scale(desc: "ModelDescription") -> Optional[float]:
    """Attention softmax scale that applies :func:`attention_factor` (None: the default
    ``1 / sqrt(head_dim)``). HF scales q and k each by the factor; scaling the scores by
    its square is the same product."""
    factor = attention_factor(desc)
    if factor == 1.0:
        return None
    return factor * factor / math.sqrt(desc.head_dim)
