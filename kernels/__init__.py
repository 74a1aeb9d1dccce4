"""Layout fix-up kernels (Triton) with plain-torch references."""
from __future__ import annotations

from typing import Optional

import torch

from hyflow.kernels import reshard_reference as reference

__all__ = ["ASSEMBLE_KINDS", "assemble", "place_shard", "take_shard", "reference"]

# kind -> what ``gathered`` is and what comes back
ASSEMBLE_KINDS = {
    "gate_up": "[s, 2*f, *rest] -> [2*s*f, *rest] (GLU fc1 de-interleave)",
    "row_concat": "[s, h, k] -> [h, s*k] (row-parallel shards side by side)",
    "column_concat": "[s, r, *rest] -> [s*r, *rest] (column/vocab/grouped QKV; no fix-up)",
    "qkv_regroup": "grouped [(nq+2ng)*d, *rest] -> fused [q; k; v]; needs num_heads, "
                   "num_query_groups, head_dim (per shard)",
}
_TRITON_KINDS = ("gate_up", "row_concat", "qkv_regroup")


def _resolve_backend(kind: str, t: torch.Tensor, backend: str) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch" or kind not in _TRITON_KINDS:
        return "torch"
    if backend == "triton":
        return "triton"
    if not t.is_cuda:
        return "torch"
    # optional dependency (triton): only for CUDA tensors, or when asked
    from hyflow.kernels import reshard_triton

    return "triton" if reshard_triton.TRITON_AVAILABLE else "torch"


def assemble(kind: str, gathered: torch.Tensor, out: Optional[torch.Tensor] = None,
             backend: str = "auto", **kwargs) -> torch.Tensor:
    """Turn gathered training shards into the generation layout (see ``ASSEMBLE_KINDS``).

    ``backend="auto"`` runs Triton on CUDA tensors (when installed) and torch otherwise;
    ``"triton"`` forces Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``). With ``out`` the
    result is written there and ``out`` is returned.
    """
    if kind not in ASSEMBLE_KINDS:
        raise ValueError(f"unknown assemble kind {kind!r}; expected one of "
                         f"{sorted(ASSEMBLE_KINDS)}")
    if kind != "qkv_regroup" and kwargs:
        raise TypeError(f"assemble({kind!r}) takes no extra arguments, got {sorted(kwargs)}")
    if _resolve_backend(kind, gathered, backend) == "triton":
        # optional dependency (triton): only for CUDA tensors, or when asked
        from hyflow.kernels import reshard_triton

        fn = {"gate_up": reshard_triton.gate_up_deinterleave,
              "row_concat": reshard_triton.row_concat,
              "qkv_regroup": reshard_triton.qkv_regroup}[kind]
        return fn(gathered, **kwargs, out=out)
    if out is not None and kind in _INTO:
        # One strided copy straight into ``out`` (no intermediate tensor).
        expected = _INTO_SHAPES[kind](gathered)
        if tuple(out.shape) != expected or out.dtype != gathered.dtype:
            raise ValueError(f"out must be {expected} {gathered.dtype}, got {tuple(out.shape)} {out.dtype}")
        return _INTO[kind](gathered, out)
    fn = {"gate_up": reference.gate_up_deinterleave, "row_concat": reference.row_concat,
          "column_concat": reference.column_concat, "qkv_regroup": reference.qkv_regroup}[kind]
    result = fn(gathered, **kwargs)
    if out is None:
        return result
    if tuple(out.shape) != tuple(result.shape) or out.dtype != result.dtype:
        raise ValueError(f"out must be {tuple(result.shape)} {result.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out.copy_(result)


def _gate_up_into(g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    s, two_f, *rest = g.shape
    out.view(2, s, two_f // 2, *rest).copy_(g.view(s, 2, two_f // 2, *rest).transpose(0, 1))
    return out


def _row_concat_into(g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    s, h, k = g.shape
    out.view(h, s, k).copy_(g.permute(1, 0, 2))
    return out


def _column_concat_into(g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.view(g.shape).copy_(g)
    return out


_INTO = {"gate_up": _gate_up_into, "row_concat": _row_concat_into, "column_concat": _column_concat_into}
_INTO_SHAPES = {
    "gate_up": lambda g: (g.shape[0] * g.shape[1], *g.shape[2:]),
    "row_concat": lambda g: (g.shape[1], g.shape[0] * g.shape[2]),
    "column_concat": lambda g: (g.shape[0] * g.shape[1], *g.shape[2:]),
}


def place_shard(kind: str, piece: torch.Tensor, index: int, s: int, out: torch.Tensor, row0: int = 0) -> None:
    """Write rows ``[row0, row0 + len(piece))`` of training shard ``index`` (of ``s``) into
    its place in the generation tensor ``out``: the per-shard form of :func:`assemble`,
    for transports that deliver shards one at a time (e.g. shared memory on one host).
    Placing every row of every shard gives exactly ``assemble(kind, stacked shards)``.
    """
    if kind == "column_concat":  # out = [shard_0; ...; shard_{s-1}]
        rows = out.shape[0] // s
        out.view(s, rows, *out.shape[1:])[index, row0:row0 + piece.shape[0]].copy_(piece)
    elif kind == "row_concat":  # out [h, s*k]: shard j is columns [j*k, (j+1)*k)
        k = out.shape[1] // s
        out[row0:row0 + piece.shape[0], index * k:(index + 1) * k].copy_(piece)
    elif kind == "gate_up":  # shard j = [gate_j; up_j]; out = [gate_0..gate_{s-1}; up_0..up_{s-1}]
        f = out.shape[0] // (2 * s)
        halves = out.view(2, s, f, *out.shape[1:])
        end = row0 + piece.shape[0]
        for half in (0, 1):  # a piece may straddle the gate/up boundary of its shard
            lo, hi = max(row0, half * f), min(end, (half + 1) * f)
            if lo < hi:
                halves[half, index, lo - half * f:hi - half * f].copy_(piece[lo - row0:hi - row0])
    else:
        raise ValueError(f"place_shard: unsupported kind {kind!r}; expected gate_up, row_concat "
                         "or column_concat")


def take_shard(kind: str, gen: torch.Tensor, index: int, s: int, out: torch.Tensor) -> None:
    """Copy training shard ``index`` (of ``s``) out of the generation tensor ``gen`` into ``out``:
    the inverse of :func:`place_shard` over a whole shard."""
    if kind == "column_concat":
        out.copy_(gen.view(s, gen.shape[0] // s, *gen.shape[1:])[index])
    elif kind == "row_concat":
        k = gen.shape[1] // s
        out.copy_(gen[:, index * k:(index + 1) * k])
    elif kind == "gate_up":
        f = gen.shape[0] // (2 * s)
        out.view(2, f, *gen.shape[1:]).copy_(gen.view(2, s, f, *gen.shape[1:])[:, index])
    else:
        raise ValueError(f"take_shard: unsupported kind {kind!r}; expected gate_up, row_concat "
                         "or column_concat")
