"""Plain-torch references for the hybrid-engine layout fix-ups.

Train -> generation (after the micro-DP all-gather of ``s`` training TP shards):

* :func:`gate_up_deinterleave` ``[s, 2*f, *rest] -> [2*s*f, *rest]``: each GLU ``linear_fc1``
  shard is ``[gate_j; up_j]``; the generation shard is ``[gate_0..gate_{s-1}; up_0..up_{s-1}]``.
* :func:`row_concat` ``[s, h, k] -> [h, s*k]``: row-parallel shards laid side by side on dim 1.
* :func:`column_concat` ``[s, r, *rest] -> [s*r, *rest]``: plain column/vocab/grouped-QKV merge.

Generation -> train (the inverses, returning the ``s`` training shards stacked on dim 0):
:func:`gate_up_interleave`, :func:`row_split`, :func:`column_split`.

QKV layouts (``nq`` heads, ``ng`` query groups, head dim ``d``; pass the per-shard counts for a
TP shard). Megatron's fused ``linear_qkv`` is *grouped*: for each group ``[q heads of the group
(nq/ng*d rows); k_g (d rows); v_g (d rows)]``. HF checkpoints keep separate q, k, v and inference
engines usually fuse them as ``[q; k; v]``:

* :func:`qkv_to_grouped` / :func:`grouped_to_qkv`: separate q, k, v <-> grouped;
* :func:`qkv_regroup` / :func:`qkv_fused_to_grouped`: grouped <-> fused ``[q; k; v]``.

All functions work on weights (``[rows, h]``) and biases (``[rows]``) alike; outputs are new
contiguous tensors.
"""
from __future__ import annotations

import torch

__all__ = [
    "gate_up_deinterleave", "gate_up_interleave", "row_concat", "row_split", "column_concat",
    "column_split", "qkv_to_grouped", "grouped_to_qkv", "qkv_regroup", "qkv_fused_to_grouped",
]


def _check_stacked(x: torch.Tensor, min_dim: int, what: str) -> None:
    if x.dim() < min_dim:
        raise ValueError(f"{what}: expected a stacked [s, ...] tensor with >= {min_dim} dims, "
                         f"got shape {tuple(x.shape)}")


def gate_up_deinterleave(gathered: torch.Tensor) -> torch.Tensor:
    """``[s, 2*f, *rest]`` of ``[g_j; u_j]`` blocks -> ``[2*s*f, *rest]`` = ``[g_0..; u_0..]``."""
    _check_stacked(gathered, 2, "gate_up_deinterleave")
    s, two_f, *rest = gathered.shape
    if two_f % 2:
        raise ValueError(f"gate_up_deinterleave: dim 1 ({two_f}) must be even (gate + up)")
    f = two_f // 2
    return gathered.reshape(s, 2, f, *rest).transpose(0, 1).reshape(2 * s * f, *rest)


def gate_up_interleave(gen: torch.Tensor, s: int) -> torch.Tensor:
    """Inverse of :func:`gate_up_deinterleave`: ``[2*s*f, *rest] -> [s, 2*f, *rest]``."""
    rows, *rest = gen.shape
    if rows % (2 * s):
        raise ValueError(f"gate_up_interleave: {rows} rows do not split into 2 x {s} blocks")
    f = rows // (2 * s)
    return gen.reshape(2, s, f, *rest).transpose(0, 1).reshape(s, 2 * f, *rest)


def row_concat(gathered: torch.Tensor) -> torch.Tensor:
    """``[s, h, k] -> [h, s*k]``: row-parallel shards side by side along dim 1."""
    _check_stacked(gathered, 3, "row_concat")
    s, h, k = gathered.shape
    return gathered.permute(1, 0, 2).reshape(h, s * k)


def row_split(gen: torch.Tensor, s: int) -> torch.Tensor:
    """Inverse of :func:`row_concat`: ``[h, s*k] -> [s, h, k]``."""
    h, cols = gen.shape
    if cols % s:
        raise ValueError(f"row_split: {cols} columns do not split into {s} shards")
    return gen.reshape(h, s, cols // s).permute(1, 0, 2).contiguous()


def column_concat(gathered: torch.Tensor) -> torch.Tensor:
    """``[s, r, *rest] -> [s*r, *rest]`` (column/vocab-parallel and grouped QKV)."""
    _check_stacked(gathered, 2, "column_concat")
    return gathered.reshape(gathered.shape[0] * gathered.shape[1], *gathered.shape[2:]).clone()


def column_split(gen: torch.Tensor, s: int) -> torch.Tensor:
    """Inverse of :func:`column_concat`: ``[s*r, *rest] -> [s, r, *rest]``."""
    if gen.shape[0] % s:
        raise ValueError(f"column_split: {gen.shape[0]} rows do not split into {s} shards")
    return gen.reshape(s, gen.shape[0] // s, *gen.shape[1:]).clone()


def _qkv_dims(rows: int, nq: int, ng: int, d: int, what: str) -> int:
    if nq % ng:
        raise ValueError(f"{what}: {nq} heads are not divisible by {ng} query groups")
    if rows != (nq + 2 * ng) * d:
        raise ValueError(f"{what}: {rows} rows != (nq + 2*ng) * d = ({nq} + 2*{ng}) * {d}")
    return nq // ng


def qkv_to_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   num_query_groups: int) -> torch.Tensor:
    """Separate ``q [nq*d, *rest]``, ``k/v [ng*d, *rest]`` -> grouped ``[(nq+2ng)*d, *rest]``."""
    ng = num_query_groups
    if k.shape != v.shape or k.shape[0] % ng:
        raise ValueError(f"qkv_to_grouped: k {tuple(k.shape)} / v {tuple(v.shape)} do not hold "
                         f"{ng} query groups")
    d = k.shape[0] // ng
    rest = tuple(q.shape[1:])
    if q.shape[0] % (ng * d):
        raise ValueError(f"qkv_to_grouped: q rows {q.shape[0]} not a multiple of ng*d={ng * d}")
    qpg = q.shape[0] // (ng * d)
    parts = (q.reshape(ng, qpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest))
    return torch.cat(parts, dim=1).reshape(ng * (qpg + 2) * d, *rest)


def grouped_to_qkv(w: torch.Tensor, num_heads: int, num_query_groups: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped ``[(nq+2ng)*d, *rest]`` -> separate contiguous ``(q, k, v)``."""
    nq, ng, d = num_heads, num_query_groups, head_dim
    qpg = _qkv_dims(w.shape[0], nq, ng, d, "grouped_to_qkv")
    rest = tuple(w.shape[1:])
    g = w.reshape(ng, (qpg + 2) * d, *rest)
    q, k, v = torch.split(g, [qpg * d, d, d], dim=1)
    return (q.reshape(nq * d, *rest).contiguous(), k.reshape(ng * d, *rest).contiguous(),
            v.reshape(ng * d, *rest).contiguous())


def qkv_regroup(w: torch.Tensor, num_heads: int, num_query_groups: int,
                head_dim: int) -> torch.Tensor:
    """Grouped -> fused ``[q; k; v]`` (the layout of e.g. vLLM's ``QKVParallelLinear``)."""
    return torch.cat(grouped_to_qkv(w, num_heads, num_query_groups, head_dim), dim=0)


def qkv_fused_to_grouped(w: torch.Tensor, num_heads: int, num_query_groups: int,
                head_dim: int) -> torch.Tensor:
    """Inverse of :func:`qkv_regroup`: fused ``[q; k; v]`` -> grouped."""
    nq, ng, d = num_heads, num_query_groups, head_dim
    _qkv_dims(w.shape[0], nq, ng, d, "qkv_fused_to_grouped")
    q, k, v = torch.split(w, [nq * d, ng * d, ng * d], dim=0)
    return qkv_to_grouped(q, k, v, ng)
