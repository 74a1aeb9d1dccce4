r"""DAPO's data-side pieces (Yu et al., 2025): dynamic sampling and overlong reward shaping.

(Clip-higher, DAPO's third piece, is ``clip_ratio_high`` of the policy losses.)

* :func:`groups_with_signal` -- dynamic sampling keeps only groups (the responses to one
  prompt) whose rewards are not all equal: a group with zero reward variance has zero
  group-relative advantage and contributes no gradient, so it only dilutes the batch. The
  caller drops the other groups and generates more prompts until the batch is full.
* :func:`overlong_penalty` -- the soft overlong punishment added to the reward of responses
  that approach the length limit.
"""
from __future__ import annotations

import torch

from hyflow.algorithms.advantages import GroupIds, group_index

__all__ = ["groups_with_signal", "overlong_penalty"]


def groups_with_signal(scores: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    r"""``[B]`` bool: True for every row whose group's scores are not all identical
    (reward variance :math:`> 0`). A group of one response has no variance and is dropped.

    Exact comparison of the group's maximum and minimum, so scores that differ by any
    amount count as signal."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got {tuple(scores.shape)}")
    inv, n_groups = group_index(group_ids, device=scores.device)
    if inv.shape[0] != scores.shape[0]:
        raise ValueError(f"group_ids has {inv.shape[0]} entries, scores has {scores.shape[0]}")
    buf = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    gmax = buf.scatter_reduce(0, inv, scores, reduce="amax", include_self=False)
    gmin = buf.scatter_reduce(0, inv, scores, reduce="amin", include_self=False)
    return (gmax > gmin)[inv]


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    r"""DAPO's soft overlong punishment, a reward term per response (``[B]`` float32, :math:`\le 0`).

    With :math:`L` = ``max_length`` (the response budget), :math:`c` = ``buffer`` and
    :math:`\lambda` = ``penalty_factor``:

    .. math::
        R(|y|) = \lambda\cdot\begin{cases}
        0 & |y| \le L - c\\
        \dfrac{(L - c) - |y|}{c} & L - c < |y| \le L\\
        -1 & |y| > L
        \end{cases}
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be in (0, max_length={max_length}], got {buffer}")
    lengths = response_lengths.to(torch.float32)
    over = (lengths - (max_length - buffer)) / buffer
    return -penalty_factor * torch.clamp(over, min=0.0, max=1.0)
