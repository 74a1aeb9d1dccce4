"""Tests for the hybrid-engine layout fix-ups: torch references against an independent
construction from named blocks, Triton kernels bit for bit against the references (CPU
interpreter, ``TRITON_INTERPRET=1``), and a CUDA variant marked ``gpu``."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from hyflow.kernels import ASSEMBLE_KINDS, assemble
from hyflow.kernels import reshard_reference as ref

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not importable (pip install triton) - Triton kernel "
                            "tests skipped; torch references are still tested")


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- references vs named-block construction -------------------------------------------------

@pytest.mark.parametrize("s,f,rest", [(1, 3, (5,)), (2, 4, (3,)), (3, 5, (7,)), (4, 2, ()),
                                      (5, 1, (2, 3))])
def test_gate_up_reference(s, f, rest):
    gates = [_rand((f, *rest), 10 + j) for j in range(s)]
    ups = [_rand((f, *rest), 100 + j) for j in range(s)]
    gathered = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)])
    expect = torch.cat(gates + ups)
    got = ref.gate_up_deinterleave(gathered)
    assert got.shape == (2 * s * f, *rest) and torch.equal(got, expect)
    assert torch.equal(ref.gate_up_interleave(got, s), gathered)


@pytest.mark.parametrize("s,h,k", [(1, 3, 4), (2, 5, 3), (3, 1, 7), (4, 6, 1), (7, 3, 5)])
def test_row_concat_reference(s, h, k):
    blocks = [_rand((h, k), j) for j in range(s)]
    got = ref.row_concat(torch.stack(blocks))
    assert torch.equal(got, torch.cat(blocks, dim=1))
    assert torch.equal(ref.row_split(got, s), torch.stack(blocks))


@pytest.mark.parametrize("s,r,rest", [(1, 2, (3,)), (3, 4, ()), (4, 1, (2,))])
def test_column_concat_reference(s, r, rest):
    blocks = [_rand((r, *rest), j) for j in range(s)]
    got = ref.column_concat(torch.stack(blocks))
    assert torch.equal(got, torch.cat(blocks))
    assert torch.equal(ref.column_split(got, s), torch.stack(blocks))


@pytest.mark.parametrize("nq,ng,d,rest", [(4, 4, 2, (3,)), (8, 2, 3, (5,)), (6, 1, 4, ()),
                                          (12, 3, 1, (2,)), (2, 2, 5, ())])
def test_qkv_references(nq, ng, d, rest):
    q, k, v = _rand((nq * d, *rest), 1), _rand((ng * d, *rest), 2), _rand((ng * d, *rest), 3)
    qpg = nq // ng
    blocks = []
    for g in range(ng):  # [q heads of group g; k_g; v_g]
        blocks += [q[g * qpg * d:(g + 1) * qpg * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    grouped = torch.cat(blocks)
    assert torch.equal(ref.qkv_to_grouped(q, k, v, ng), grouped)
    for got, want in zip(ref.grouped_to_qkv(grouped, nq, ng, d), (q, k, v)):
        assert torch.equal(got, want)
    fused = torch.cat([q, k, v])
    assert torch.equal(ref.qkv_regroup(grouped, nq, ng, d), fused)
    assert torch.equal(ref.qkv_fused_to_grouped(fused, nq, ng, d), grouped)


def test_qkv_tp_shards_are_whole_groups():
    """TP shard t of the grouped layout is the grouped layout of shard t's heads and groups."""
    nq, ng, d, tp = 8, 4, 3, 2
    q, k, v = _rand((nq * d, 5), 1), _rand((ng * d, 5), 2), _rand((ng * d, 5), 3)
    grouped = ref.qkv_to_grouped(q, k, v, ng)
    for t, shard in enumerate(grouped.chunk(tp)):
        want = ref.qkv_to_grouped(q.chunk(tp)[t], k.chunk(tp)[t], v.chunk(tp)[t], ng // tp)
        assert torch.equal(shard, want)


def test_reference_errors():
    with pytest.raises(ValueError, match="even"):
        ref.gate_up_deinterleave(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="stacked"):
        ref.row_concat(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="rows"):
        ref.grouped_to_qkv(torch.zeros(10, 2), 4, 2, 2)
    with pytest.raises(ValueError, match="query groups"):
        ref.grouped_to_qkv(torch.zeros(12, 2), 3, 2, 2)


def test_assemble_dispatch_cpu():
    x = _rand((3, 8, 5))
    assert torch.equal(assemble("gate_up", x), ref.gate_up_deinterleave(x))
    assert torch.equal(assemble("row_concat", x), ref.row_concat(x))
    assert torch.equal(assemble("column_concat", x), ref.column_concat(x))
    w = _rand(((4 + 2 * 2) * 3, 5))
    assert torch.equal(assemble("qkv_regroup", w, num_heads=4, num_query_groups=2, head_dim=3),
                       ref.qkv_regroup(w, 4, 2, 3))
    out = torch.empty(8, 15)
    assert assemble("row_concat", x, out=out) is out and torch.equal(out, ref.row_concat(x))
    with pytest.raises(ValueError, match="unknown assemble kind"):
        assemble("transpose", x)
    with pytest.raises(TypeError, match="no extra arguments"):
        assemble("gate_up", x, head_dim=3)
    with pytest.raises(ValueError, match="backend"):
        assemble("gate_up", x, backend="cuda")
    with pytest.raises(ValueError, match="out must be"):
        assemble("row_concat", x, out=torch.empty(15, 8))
    assert set(ASSEMBLE_KINDS) == {"gate_up", "row_concat", "column_concat", "qkv_regroup"}


def test_triton_module_imports_without_triton_guard():
    from hyflow.kernels import reshard_triton

    assert reshard_triton.TRITON_AVAILABLE == HAVE_TRITON
    if not HAVE_TRITON:
        with pytest.raises(RuntimeError, match="not installed"):
            reshard_triton.row_concat(torch.zeros(2, 3, 4))


# ---- Triton vs reference, bit for bit -------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(dtype, shape, seed):
    """Random bit patterns (NaN payloads, infs and denormals included) viewed as ``dtype``."""
    it = _INT_VIEW[dtype]
    info = torch.iinfo(it)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64)
    return raw.to(it).view(dtype)


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(_INT_VIEW[a.dtype]), b.contiguous().view(_INT_VIEW[b.dtype]))


# (kind, gathered shape, kwargs): odd sizes, 1-D biases, a non-power-of-two wide case
CASES = [
    ("gate_up", (3, 2 * 5, 7), {}),
    ("gate_up", (1, 2 * 3, 1), {}),
    ("gate_up", (5, 2 * 1, 33), {}),
    ("gate_up", (2, 2 * 7, 300), {}),
    ("gate_up", (7, 2 * 3), {}),
    ("row_concat", (3, 5, 7), {}),
    ("row_concat", (1, 9, 1), {}),
    ("row_concat", (6, 1, 13), {}),
    ("row_concat", (2, 3, 301), {}),
    ("qkv_regroup", ((12 + 2 * 3) * 5, 7), dict(num_heads=12, num_query_groups=3, head_dim=5)),
    ("qkv_regroup", ((4 + 2 * 4) * 3, 3), dict(num_heads=4, num_query_groups=4, head_dim=3)),
    ("qkv_regroup", ((7 + 2) * 2,), dict(num_heads=7, num_query_groups=1, head_dim=2)),
    ("qkv_regroup", ((6 + 2 * 2) * 1, 259), dict(num_heads=6, num_query_groups=2, head_dim=1)),
]


def _reference(kind, x, kw):
    return {"gate_up": ref.gate_up_deinterleave, "row_concat": ref.row_concat,
            "qkv_regroup": ref.qkv_regroup}[kind](x, **kw)


def _triton(kind, x, kw, out=None):
    from hyflow.kernels import reshard_triton as T

    fn = {"gate_up": T.gate_up_deinterleave, "row_concat": T.row_concat,
          "qkv_regroup": T.qkv_regroup}[kind]
    return fn(x, **kw, out=out)


@pytest.fixture
def interpreter(monkeypatch):
    """Run Triton kernels on CPU tensors through the interpreter (kernels JIT lazily, per
    interpreter setting, so setting the variable after ``import triton`` is enough)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hyflow.kernels import reshard_triton

    assert reshard_triton.interpret_mode()
    return reshard_triton


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("kind,shape,kw", CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}"
                                                      for c in CASES])
def test_triton_interpreter_bit_exact(interpreter, kind, shape, kw, dtype):
    x = _bits(dtype, shape, seed=sum(shape) * 31 + len(kind))
    want = _reference(kind, x, kw)
    got = _triton(kind, x, kw)
    assert _same_bits(got, want)
    out = torch.empty_like(want)
    assert _triton(kind, x, kw, out=out) is out and _same_bits(out, want)


@needs_triton
def test_triton_interpreter_noncontiguous_and_dispatch(interpreter):
    x = _rand((4, 6, 9)).transpose(1, 2)  # [4, 9, 6] non-contiguous view
    assert _same_bits(_triton("row_concat", x, {}), ref.row_concat(x))
    y = _rand((4, 6, 10)).transpose(1, 2)  # [4, 10, 6]
    assert _same_bits(assemble("gate_up", y, backend="triton"), ref.gate_up_deinterleave(y))
    with pytest.raises(ValueError, match="out must be"):
        _triton("row_concat", x, {}, out=torch.empty(9, 24, dtype=torch.float16))


@needs_triton
def test_triton_requires_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from hyflow.kernels import reshard_triton

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        reshard_triton.row_concat(torch.zeros(2, 3, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_triton_cuda_bit_exact(monkeypatch, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for kind, shape, kw in CASES + [("gate_up", (4, 2 * 1024, 4096), {}),
                                    ("row_concat", (4, 4096, 1024), {})]:
        x = _bits(dtype, shape, seed=7).cuda()
        want = _reference(kind, x, kw)
        assert _same_bits(_triton(kind, x, kw), want)
        if kind != "qkv_regroup":
            assert _same_bits(assemble(kind, x), want)  # auto -> triton on CUDA


def test_import_guard_without_triton():
    """With triton unimportable the module still imports and reports TRITON_AVAILABLE=False."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "from hyflow.kernels import reshard_triton as T, assemble\n"
            "import torch\n"
            "assert T.TRITON_AVAILABLE is False\n"
            "x = torch.randn(2, 4, 3)\n"
            "assert torch.equal(assemble('gate_up', x), assemble('gate_up', x, backend='torch'))\n"
            "try:\n    T.row_concat(x)\n"
            "except RuntimeError as e:\n    assert 'not installed' in str(e)\n"
            "else:\n    raise SystemExit('no error')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("kind,shape", [("column_concat", (6, 5)), ("column_concat", (7,)),
                                        ("row_concat", (5, 3)), ("gate_up", (8, 3)), ("gate_up", (6,))])
@pytest.mark.parametrize("s", [1, 2, 4])
def test_place_shard_pieces_equal_assemble(kind, shape, s):
    """Shards delivered one at a time, cut at arbitrary row boundaries (also across the
    gate/up halves), land exactly where the stacked ``assemble`` puts them."""
    from hyflow.kernels import place_shard

    if kind == "row_concat" and len(shape) < 2:
        pytest.skip("row_concat needs 2-D shards")
    shards = _rand((s, *shape), seed=s)
    expected = assemble(kind, shards)
    out = torch.full_like(expected, float("nan"))
    gen = torch.Generator().manual_seed(7 + s)
    for j in torch.randperm(s, generator=gen).tolist():
        rows = shape[0]
        cuts = sorted({0, rows, *torch.randint(1, rows, (2,), generator=gen).tolist()})
        for a, b in zip(cuts, cuts[1:]):
            place_shard(kind, shards[j, a:b], j, s, out, row0=a)
    assert torch.equal(out, expected)


def test_place_shard_rejects_unknown_kind():
    from hyflow.kernels import place_shard

    with pytest.raises(ValueError, match="unsupported kind"):
        place_shard("qkv_regroup", torch.zeros(2, 2), 0, 1, torch.zeros(2, 2))
