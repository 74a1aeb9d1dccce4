"""Triton kernels for the hybrid-engine layout fix-ups (one pass, no intermediate copy).

Each kernel reads the gathered buffer once and writes the generation-layout output once; the
source index of every output element is computed arithmetically, so no index tensors are built.

* :func:`gate_up_deinterleave` ``[s, 2*f, *rest] -> [2*s*f, *rest]``
* :func:`row_concat` ``[s, h, k] -> [h, s*k]``
* :func:`qkv_regroup` grouped ``[(nq+2ng)*d, *rest]`` -> fused ``[q; k; v]``

Semantics match :mod:`hyflow.kernels.reshard_reference` bit for bit (pure data movement).
Importing this module never fails: without Triton, ``TRITON_AVAILABLE`` is False and the
entry points raise. Kernels are JIT-decorated lazily, once per value of ``TRITON_INTERPRET``,
so the interpreter (CPU tensors) can be switched on after ``import triton``.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Optional

import torch

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # ImportError, or a broken install (missing driver libs, ...)
    triton = tl = None
    TRITON_AVAILABLE = False

__all__ = ["TRITON_AVAILABLE", "interpret_mode", "gate_up_deinterleave", "row_concat",
           "qkv_regroup"]

_GATE_UP, _QKV = 0, 1


def interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false")


def _build() -> SimpleNamespace:
    """Define and JIT the kernels (called once per interpreter setting)."""

    @triton.jit
    def gather_rows(src, dst, n_rows, n_cols, A, B, C, MODE: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # dst[r, :] = src[src_row(r), :], both row-major [*, n_cols].
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        if MODE == 0:
            # gate_up (A = s, B = f): r = half*s*f + j*f + i  <-  j*2f + half*f + i
            half = rows // (A * B)
            rem = rows - half * (A * B)
            j = rem // B
            src_rows = j * (2 * B) + half * B + (rem - j * B)
        else:
            # qkv_regroup (A = heads per group, B = d, C = ng): q rows, then k, then v.
            group_rows = (A + 2) * B
            q_rows = C * A * B
            head = rows // B
            gq = head // A
            src_q = gq * group_rows + (head - gq * A) * B + (rows - head * B)
            rk = tl.maximum(rows - q_rows, 0)
            gk = rk // B
            src_k = gk * group_rows + A * B + (rk - gk * B)
            rv = tl.maximum(rows - q_rows - C * B, 0)
            gv = rv // B
            src_v = gv * group_rows + (A + 1) * B + (rv - gv * B)
            src_rows = tl.where(rows < q_rows, src_q, tl.where(rows < q_rows + C * B, src_k, src_v))
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        vals = tl.load(src + src_rows[:, None] * n_cols + cols[None, :], mask=mask)
        tl.store(dst + rows[:, None] * n_cols + cols[None, :], vals, mask=mask)

    @triton.jit
    def row_concat_kernel(src, dst, h, s, k, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # dst[r, j*k + c] = src[j, r, c]
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        j = cols // k
        c = cols - j * k
        mask = (rows < h)[:, None] & (cols < s * k)[None, :]
        src_off = (j * h * k + c)[None, :] + rows[:, None] * k
        vals = tl.load(src + src_off, mask=mask)
        tl.store(dst + rows[:, None] * (s * k) + cols[None, :], vals, mask=mask)

    return SimpleNamespace(gather_rows=gather_rows, row_concat=row_concat_kernel)


_KERNELS: dict[bool, SimpleNamespace] = {}


def _kernels(t: torch.Tensor) -> SimpleNamespace:
    if not TRITON_AVAILABLE:
        raise RuntimeError("hyflow.kernels.reshard_triton: triton is not installed "
                           "(pip install triton); use backend='torch'")
    interp = interpret_mode()
    if not (t.is_cuda or interp):
        raise RuntimeError("Triton reshard kernels need CUDA tensors, or TRITON_INTERPRET=1 "
                           f"for CPU tensors (got device {t.device})")
    if interp not in _KERNELS:
        _KERNELS[interp] = _build()
    return _KERNELS[interp]


def _blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_c = min(256, triton.next_power_of_2(max(n_cols, 1)))
    block_r = min(max(1, 4096 // block_c), triton.next_power_of_2(max(n_rows, 1)))
    return block_r, block_c


def _out(out: Optional[torch.Tensor], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be {tuple(shape)} {like.dtype} on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out


def _launch_rows(src: torch.Tensor, dst: torch.Tensor, mode: int, a: int, b: int, c: int) -> None:
    k = _kernels(src)
    n_rows = dst.shape[0]
    n_cols = dst.numel() // max(n_rows, 1)
    if dst.numel() == 0:
        return
    br, bc = _blocks(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, br), triton.cdiv(n_cols, bc))
    k.gather_rows[grid](src, dst, n_rows, n_cols, a, b, c, MODE=mode, BLOCK_R=br, BLOCK_C=bc)


def gate_up_deinterleave(gathered: torch.Tensor,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[s, 2*f, *rest] -> [2*s*f, *rest]`` (``[g_j; u_j]`` blocks -> ``[g_0..; u_0..]``)."""
    if gathered.dim() < 2 or gathered.shape[1] % 2:
        raise ValueError(f"gate_up_deinterleave: need [s, 2*f, ...], got {tuple(gathered.shape)}")
    s, two_f, *rest = gathered.shape
    src = gathered.contiguous()
    dst = _out(out, (s * two_f, *rest), src)
    _launch_rows(src, dst, _GATE_UP, s, two_f // 2, 0)
    return dst


def row_concat(gathered: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[s, h, k] -> [h, s*k]``."""
    if gathered.dim() != 3:
        raise ValueError(f"row_concat: need [s, h, k], got {tuple(gathered.shape)}")
    s, h, k = gathered.shape
    src = gathered.contiguous()
    dst = _out(out, (h, s * k), src)
    if dst.numel():
        kern = _kernels(src)
        br, bc = _blocks(h, s * k)
        grid = (triton.cdiv(h, br), triton.cdiv(s * k, bc))
        kern.row_concat[grid](src, dst, h, s, k, BLOCK_R=br, BLOCK_C=bc)
    return dst


def qkv_regroup(w: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Grouped ``[(nq+2ng)*d, *rest]`` -> fused ``[q; k; v]`` (same shape)."""
    nq, ng, d = num_heads, num_query_groups, head_dim
    if nq % ng or w.dim() < 1 or w.shape[0] != (nq + 2 * ng) * d:
        raise ValueError(f"qkv_regroup: shape {tuple(w.shape)} does not match nq={nq}, ng={ng}, "
                         f"d={d} (rows must be (nq + 2*ng) * d, nq divisible by ng)")
    src = w.contiguous()
    dst = _out(out, tuple(w.shape), src)
    _launch_rows(src, dst, _QKV, nq // ng, d, ng)
    return dst
