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
    "pack_row_stats",
    "unpack_row_stats",
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


# ----------------------------------------------------- per-row statistics over many ranks
#
# Statistics that must describe the whole batch (all data-parallel ranks) are returned per row
# (``dict[str, Tensor[B]]``) by the functions that compute them. A key ending in ``_max`` is a
# maximum, every other key a sum. ``pack_row_stats`` reduces the rows this rank holds into two
# float64 vectors (one all-reduce with SUM, one with MAX); ``unpack_row_stats`` turns the
# reduced vectors back into a dict of floats for the metric helpers.


def pack_row_stats(rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums [K], maxima [M])`` float64 over this rank's rows, keys in sorted order.

    All-reduce ``sums`` with SUM and ``maxima`` with MAX over the data-parallel group, then
    :func:`unpack_row_stats`. An empty batch gives zeros (every maximum here is of a
    non-negative quantity)."""
    sums = sorted(k for k in rows if not k.endswith("_max"))
    maxima = sorted(k for k in rows if k.endswith("_max"))
    device = next(iter(rows.values())).device if rows else None
    s = torch.stack([rows[k].double().sum() for k in sums]) if sums else torch.zeros(0, dtype=torch.float64,
                                                                                      device=device)
    m = (torch.stack([rows[k].double().amax() if rows[k].numel() else
                      torch.zeros((), dtype=torch.float64, device=device) for k in maxima])
         if maxima else torch.zeros(0, dtype=torch.float64, device=device))
    return s, m


def unpack_row_stats(keys, sums: torch.Tensor, maxima: torch.Tensor) -> dict[str, float]:
    """Inverse of :func:`pack_row_stats` for the same ``keys`` (one host transfer)."""
    keys = list(keys)
    s_keys = sorted(k for k in keys if not k.endswith("_max"))
    m_keys = sorted(k for k in keys if k.endswith("_max"))
    values = torch.cat([sums.double().flatten(), maxima.double().flatten()]).tolist()
    return dict(zip(s_keys + m_keys, values))
