"""Shared fixtures of the algorithm parity tests (test_algorithms, test_algorithms_losses): a mask
with every padding shape, random float64 inputs, NaN in padding, and float64 references."""
from __future__ import annotations

import math

import numpy as np
import torch

F64 = torch.float64

# Rows: full, right-padded, empty, length 1, left-padded, interior hole after an "EOS".
MASK_ROWS = [
    [1, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0],
    [0, 0, 1, 1, 1, 1, 1],
    [1, 1, 0, 1, 1, 0, 0],
]
B, T = len(MASK_ROWS), len(MASK_ROWS[0])
NORM = 16  # the constant normaliser of seq-mean-token-sum-norm (a response budget)


def mask_t(dtype=torch.bool) -> torch.Tensor:
    return torch.tensor(MASK_ROWS).to(dtype)


def rand(*shape, seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def with_garbage(x: torch.Tensor) -> torch.Tensor:
    """Fill padding positions with NaN: results must not depend on them."""
    return torch.where(mask_t(), x, torch.full_like(x, float("nan")))


def valid(b):
    return [t for t in range(T) if MASK_ROWS[b][t]]


def np_whiten(mat: np.ndarray, eps=1e-8) -> np.ndarray:
    """Whiten over valid entries (unbiased var); padding -> 0."""
    vals = [mat[b][t] for b in range(B) for t in valid(b)]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    out = np.zeros((B, T))
    for b in range(B):
        for t in valid(b):
            out[b][t] = (mat[b][t] - mean) / math.sqrt(var + eps)
    return out


def broadcast_ref(per_seq) -> np.ndarray:
    out = np.zeros((B, T))
    for b in range(B):
        for t in valid(b):
            out[b][t] = per_seq[b]
    return out


def close(actual: torch.Tensor, expected, atol=1e-10, rtol=1e-10):
    exp = torch.as_tensor(np.asarray(expected, dtype=np.float64))
    torch.testing.assert_close(actual.detach().to(F64), exp, atol=atol, rtol=rtol)
