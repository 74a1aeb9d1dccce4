"""Masked reductions shared by the advantage estimators, KL penalties and losses.

All functions take a value tensor ``x`` and a ``mask`` broadcastable to it. The mask may
be bool, integer or floating point; a floating mask acts as per-element weights. Positions
where ``mask == 0`` are *excluded*, even when ``x`` holds NaN/inf there (padding garbage
never leaks into a result). Empty selections reduce to ``0`` rather than NaN.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

Dim = Optional[Union[int, tuple[int, ...]]]

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "last_token_index",
    "scatter_to_last_token",
]


#: Sums a tensor over the ranks that share a batch (an all-reduce), or None for one rank.
Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


def _prepare(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcast ``mask`` to ``x``, cast it to ``x.dtype`` and zero ``x`` where masked out."""
    mask = mask.to(device=x.device)
    keep = mask != 0
    x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x, mask.to(x.dtype).expand_as(x)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    r"""Weighted sum :math:`\sum_i m_i x_i` over ``dim`` (all elements when ``None``)."""
    x, m = _prepare(x, mask)
    if dim is None:
        return (x * m).sum()
    return (x * m).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, reduce: Reduce = None) -> torch.Tensor:
    r"""Weighted mean :math:`\sum_i m_i x_i / \sum_i m_i`; ``0`` where :math:`\sum_i m_i = 0`.

    ``reduce`` (with ``dim=None``): sums a tensor over the ranks that share the batch (e.g. an
    all-reduce over the data-parallel group), so the mean is over every rank's elements."""
    x, m = _prepare(x, mask)
    if dim is None:
        num, den = (x * m).sum(), m.sum()
        if reduce is not None:
            num, den = reduce(torch.stack([num, den])).unbind()
    else:
        num, den = (x * m).sum(dim=dim), m.sum(dim=dim)
    return num / torch.where(den != 0, den, torch.ones_like(den))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, reduce: Reduce = None) -> torch.Tensor:
    r"""Masked variance over all elements.

    .. math::
        \mu = \frac{\sum_i m_i x_i}{N},\quad
        \sigma^2 = \frac{\sum_i m_i (x_i-\mu)^2}{N}\cdot\frac{N}{N-1}\ \text{(if unbiased)},
        \quad N = \sum_i m_i .

    The Bessel factor is skipped when :math:`N \le 1` (the variance is then ``0``). ``reduce``: as
    for :func:`masked_mean` (statistics over every rank's elements).
    """
    mean = masked_mean(x, mask, reduce=reduce)
    var = masked_mean((x - mean) ** 2, mask, reduce=reduce)
    if unbiased:
        n = _prepare(x, mask)[1].sum()
        if reduce is not None:
            n = reduce(n)
        var = torch.where(n > 1, var * n / torch.where(n > 1, n - 1, torch.ones_like(n)), var)
    return var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
    reduce: Reduce = None,
) -> torch.Tensor:
    r"""Normalise ``x`` with statistics of its valid elements.

    .. math::
        \hat x_i = \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}}
        \quad\text{or, with}\ \texttt{shift\_mean=False},\quad
        \hat x_i = \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}} + \mu ,

    with :math:`\mu, \sigma^2` from :func:`masked_mean` / :func:`masked_var` (over every rank's
    elements with ``reduce``). Masked-out positions of the result are ``0``.
    """
    mean = masked_mean(x, mask, reduce=reduce)
    var = masked_var(x, mask, unbiased=unbiased, reduce=reduce)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return _prepare(out, mask)[0]


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with ``mask != 0`` along the last dim; ``-1`` for an empty row."""
    keep = (mask != 0).long()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(keep)
    return torch.where(keep.bool(), positions, torch.full_like(positions, -1)).amax(dim=-1)


def scatter_to_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Place a per-sequence score on the last valid token: ``out[b, last(b)] = scores[b]``.

    ``scores`` is ``[B]``, ``mask`` is ``[B, T]``; the result is ``[B, T]`` in ``scores.dtype``
    and zero elsewhere. Rows with no valid token stay all-zero (their score is dropped).
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [B]={mask.shape[0]}, got {tuple(scores.shape)}")
    idx = last_token_index(mask)
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    valid = idx >= 0
    rows = torch.arange(mask.shape[0], device=scores.device)[valid]
    out[rows, idx[valid]] = scores[valid]
    return out
