"""Tests for hyflow.hybrid.reshard_plan / reshard_table: rank mapping, bytes, memory, rejections, and a bit-exact
simulation of the plan's slice moves against Megatron-style sharding (no process groups)."""
from __future__ import annotations

import time
from fractions import Fraction

import pytest
import torch

from hyflow.hybrid import (
    ParamSpec, ReshardPlanError, gpt_param_specs, megatron_local_name, plan_reshard, rank_plan,
    reshard_formula_bytes,
)
from hyflow.hybrid.reshard_plan import TP_STAGING_SLOT, staging_slot_bytes
from hyflow.hybrid.reshard_table import send_moves
from hyflow.kernels import reference as ref


def _train_coord(plan, rank):
    """(tp, pp, dp) of a rank in the plan's training layout."""
    c = plan.train.coords(rank)
    return c["tp"], c["pp"], c["dp"]


def _small_gpt(**kw):
    cfg = dict(num_layers=8, hidden=16, num_heads=16, num_query_groups=8, head_dim=4,
               ffn_hidden=32, padded_vocab=64)
    cfg.update(kw)
    return gpt_param_specs(**cfg)


def _layouts(max_world=1024):
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            for dp in (1, 3, 32):
                if tp * pp * dp > max_world:
                    continue
                for tpg in (d for d in (1, 2, 4, 8) if tp % d == 0):
                    for ppg in (d for d in (1, 2, 4) if pp % d == 0):
                        out.append((tp, pp, dp, tpg, ppg))
    return out


LAYOUTS = _layouts()


def _ids(lay):
    return "tp{}pp{}dp{}-g{}x{}".format(*lay)


# ---- rank mapping ---------------------------------------------------------------------------

def _assert_partition(groups, world, size):
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(world))
    assert all(len(g) == size for g in groups)


@pytest.mark.parametrize("lay", LAYOUTS, ids=_ids)
def test_groups_partition_and_strides(lay):
    TP, PP, DP, TPg, PPg = lay
    W, s, p = TP * PP * DP, TP // TPg, PP // PPg
    plan = plan_reshard(_small_gpt(), (TP, PP, DP), (TPg, PPg), W)
    assert plan.micro_dp_size == s * p == TP * PP // (TPg * PPg)
    assert plan.gen_dp_size == DP * s * p
    _assert_partition(plan.gen_tp_groups, W, TPg)
    _assert_partition(plan.gen_pp_groups, W, PPg)
    _assert_partition(plan.micro_dp_groups, W, s * p)
    _assert_partition(plan.gen_dp_groups, W, DP * s * p)
    for g in plan.gen_tp_groups:  # stride TP/TP_g in the training tp dimension
        assert all(b - a == s for a, b in zip(g, g[1:]))
        assert [plan.gen_coord(r)[0] for r in g] == list(range(TPg))
        assert len({plan.gen_coord(r)[1:] for r in g}) == 1
    for g in plan.gen_pp_groups:  # stride p stages
        assert all(b - a == p * DP * TP for a, b in zip(g, g[1:]))
        assert [plan.gen_coord(r)[1] for r in g] == list(range(PPg))
        assert len({(plan.gen_coord(r)[0], plan.gen_coord(r)[2]) for r in g}) == 1
    for g in plan.micro_dp_groups:  # s consecutive tp ranks x p consecutive stages, one dp
        coords = [_train_coord(plan, r) for r in g]
        assert len({c[2] for c in coords}) == 1
        assert sorted({c[0] for c in coords}) == list(range(coords[0][0], coords[0][0] + s))
        assert sorted({c[1] for c in coords}) == list(range(coords[0][1], coords[0][1] + p))
        gens = [plan.gen_coord(r) for r in g]
        assert len({gc[:2] for gc in gens}) == 1
        dp = coords[0][2]
        assert [gc[2] for gc in gens] == list(range(dp * s * p, (dp + 1) * s * p))
    for g in plan.gen_dp_groups:
        assert [plan.gen_coord(r)[2] for r in g] == list(range(DP * s * p))
    step = max(1, W // 16)
    for r in range(0, W, step):
        rp = rank_plan(plan, r)
        assert r in rp.micro_dp_group and r in rp.gen_tp_group and r in rp.gen_pp_group
        assert rp.micro_dp_group[rp.micro_dp_rank] == r
        tp, pp, dp = rp.train_coord
        assert plan.train.rank_of(tp=tp, pp=pp, dp=dp) == r == pp * DP * TP + dp * TP + tp
        assert rp.gen_coord == (tp // s, pp // p, dp * s * p + (pp % p) * s + tp % s)


# ---- bytes and memory -----------------------------------------------------------------------

def _uniform(specs):
    """Only TP-sharded decoder-layer parameters: the setting of the closed formula."""
    return [sp for sp in specs if sp.layer is not None and sp.tp_kind != "replicated"]


@pytest.mark.parametrize("lay", LAYOUTS, ids=_ids)
def test_bytes_match_formula_on_uniform_model(lay):
    TP, PP, DP, TPg, PPg = lay
    specs = _uniform(_small_gpt(qkv_bias=True))
    plan = plan_reshard(specs, (TP, PP, DP), (TPg, PPg))
    M = sum(sp.nbytes for sp in specs)
    formula = Fraction((TP * PP - TPg * PPg) * M, TPg * PPg * TP * PP)
    assert plan.model_bytes == M and plan.formula_bytes == formula
    assert all(b == formula for b in plan.bytes_recv)
    assert all(b == formula for b in plan.bytes_sent)
    assert all(g == Fraction(M, TPg * PPg) for g in plan.gen_bytes)
    assert all(t == Fraction(M, TP * PP) for t in plan.train_bytes)
    assert all(e == formula for e in plan.extra_bytes)  # own shard lives inside the buffer
    assert plan.total_bytes_moved == formula * TP * PP * DP
    # TP-merge staging: s slots, each this stage's shards (all of them here) or TP_STAGING_SLOT
    own = Fraction(M, TP * PP)
    staging = (TP // TPg) * staging_slot_bytes(int(own), TP_STAGING_SLOT) if TP > TPg else 0
    assert plan.peak_extra_bytes == formula + staging


@pytest.mark.parametrize("lay", LAYOUTS, ids=_ids)
def test_bytes_full_gpt(lay):
    TP, PP, DP, TPg, PPg = lay
    specs = _small_gpt(qk_layernorm=True)
    plan = plan_reshard(specs, (TP, PP, DP), (TPg, PPg))
    W, p = TP * PP * DP, PP // PPg
    sharded = sum(sp.nbytes for sp in specs if sp.tp_kind != "replicated")
    rep = sum(sp.nbytes for sp in specs if sp.tp_kind == "replicated")
    # TP-sharded: exactly the formula in total; replicated: each of the p-1 other stages' TP
    # ranks needs a full copy.
    expect = reshard_formula_bytes(sharded, plan.train, plan.gen) * W + DP * TP * (p - 1) * rep
    assert plan.total_bytes_moved == expect == sum(plan.bytes_sent)
    # Memory: a rank holds its generation stage's shards, nothing more.
    L, layers_g = 8, 8 // PPg
    per_layer = [sum(sp.nbytes // (TPg if sp.tp_kind != "replicated" else 1)
                     for sp in specs if sp.layer == i) for i in range(L)]
    emb = 64 * 16 * 2 // TPg
    for r in range(0, W, max(1, W // 32)):
        j = plan.gen_coord(r)[1]
        expect_gen = sum(per_layer[j * layers_g:(j + 1) * layers_g])
        expect_gen += emb if j == 0 else 0
        expect_gen += (emb + 16 * 2) if j == PPg - 1 else 0
        assert plan.gen_bytes[r] == expect_gen
        assert plan.train_bytes[r] <= plan.gen_bytes[r]
        assert plan.extra_bytes[r] == plan.gen_bytes[r] - plan.train_bytes[r]
        rp = rank_plan(plan, r)
        assert sum(m.nbytes for m in rp.moves if not m.is_local) == plan.bytes_recv[r]
        assert sum(m.nbytes for m in rp.moves if m.is_local) == plan.train_bytes[r]
        assert sum(m.nbytes for m in rp.moves) == rp.gen_bytes
    bound = Fraction(sharded, TPg * PPg) + Fraction(rep, PPg) + 2 * emb  # pinned ends
    assert max(plan.gen_bytes) <= bound


def test_large_plan_is_fast():
    specs = gpt_param_specs(80, 8192, 64, 8, 128, 29568, 152064, qkv_bias=True)
    t0 = time.perf_counter()
    plan = plan_reshard(specs, (8, 4, 32), (2, 1), world_size=1024)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"planning 1024 ranks took {elapsed:.2f}s"
    assert len(plan.bytes_recv) == 1024 and plan.gen_dp_size == 32 * 16
    rp = rank_plan(plan, 1023)
    assert rp.gen_coord == (1, 0, 31 * 16 + 3 * 4 + 3) and len(rp.micro_dp_group) == 16
    assert sum(plan.bytes_recv) == sum(plan.bytes_sent)


# ---- bit-exact simulation -------------------------------------------------------------------

def _stages(spec, pp, L):
    if spec.layer is not None:
        return {spec.layer // (L // pp)}
    return {"first": {0}, "last": {pp - 1}, "first_and_last": {0, pp - 1}}[spec.pp_stage]


def _shard(spec, w, rank, n):
    """Megatron's TP sharding of global ``w`` into ``n`` shards, shard ``rank``."""
    if spec.tp_kind == "replicated":
        return w
    if spec.fixup == "gate_up":
        g, u = w.chunk(2, dim=0)
        return torch.cat([g.chunk(n, 0)[rank], u.chunk(n, 0)[rank]])
    return w.chunk(n, dim=spec.shard_dim)[rank].contiguous()


def _globals(specs, nq, ng, d, gen):
    out = {}
    for sp in specs:
        if "linear_qkv" in sp.name:  # build from HF-style q, k, v
            rest = sp.global_shape[1:]
            q, k, v = (torch.randn((n * d, *rest), generator=gen) for n in (nq, ng, ng))
            out[sp.name] = ref.qkv_to_grouped(q, k, v, ng)
            out[sp.name + "#hf"] = (q, k, v)
        else:
            out[sp.name] = torch.randn(sp.global_shape, generator=gen)
    return out


SIM_LAYOUTS = [(TP, PP, DP, TPg, PPg) for (TP, PP, DP, TPg, PPg) in _layouts(8)]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("lay", SIM_LAYOUTS, ids=_ids)
def test_simulated_reshard_is_bit_exact(lay, tied):
    TP, PP, DP, TPg, PPg = lay
    W, s, p, L = TP * PP * DP, TP // TPg, PP // PPg, 4
    nq, ng, d = 16, 8, 2
    specs = gpt_param_specs(L, 6, nq, ng, d, 24, 40, tied_embeddings=tied, qkv_bias=True,
                            qk_layernorm=True, dtype_bytes=4)
    plan = plan_reshard(specs, (TP, PP, DP), (TPg, PPg), W)
    glob = _globals(specs, nq, ng, d, torch.Generator().manual_seed(W * 97 + TPg * 7 + PPg))
    by_name = {sp.name: sp for sp in specs}
    train = [{sp.name: _shard(sp, glob[sp.name], tp, TP) for sp in specs
              if pp in _stages(sp, PP, L)} for tp, pp, _ in (_train_coord(plan, r) for r in range(W))]
    sent = [0] * W
    for r in range(W):
        tp, pp, dp = _train_coord(plan, r)
        tg, pg = tp // s, pp // p
        rp = rank_plan(plan, r)
        expect = {sp.name: _shard(sp, glob[sp.name], tg, TPg) for sp in specs
                  if pg in _stages(sp, PPg, L)}
        assert list(rp.gen_offsets) == [n for n in (sp.name for sp in specs) if n in expect]
        assert set(train[r]) <= set(expect)  # everything the rank trains on is generated too
        bufs = {n: torch.full_like(e, float("nan")) for n, e in expect.items()}
        hits = {n: torch.zeros(e.shape, dtype=torch.int32) for n, e in expect.items()}
        for mv in rp.moves:
            assert mv.src_rank in rp.micro_dp_group
            src = train[mv.src_rank][mv.param]  # the source really holds this shard
            bufs[mv.param].narrow(mv.dim, mv.dst_offset, mv.length).copy_(
                src.narrow(mv.dim, mv.src_offset, mv.length))
            hits[mv.param].narrow(mv.dim, mv.dst_offset, mv.length).add_(1)
            if not mv.is_local:
                sent[mv.src_rank] += mv.nbytes
        for n, e in expect.items():
            assert torch.equal(hits[n], torch.ones_like(hits[n])), f"{n} not covered once"
            assert torch.equal(bufs[n], e), f"rank {r}: {n} differs"
        # Zero redundancy: the local moves are exactly the training shard, read back from the
        # generation buffer.
        for n, shard in train[r].items():
            back = torch.full_like(shard, float("nan"))
            for mv in (m for m in rp.moves if m.is_local and m.param == n):
                back.narrow(mv.dim, mv.src_offset, mv.length).copy_(
                    bufs[n].narrow(mv.dim, mv.dst_offset, mv.length))
            assert torch.equal(back, shard), f"rank {r}: {n} training shard not inside gen shard"
        assert sum(m.nbytes for m in rp.moves if not m.is_local) == plan.bytes_recv[r]
        # Gather-buffer path: stack the s source shards, run the reference fix-up.
        for n, e in expect.items():
            sp = by_name[n]
            if sp.tp_kind == "replicated":
                continue
            srcs = sorted({m.src_rank for m in rp.moves if m.param == n})
            gathered = torch.stack([train[x][n] for x in srcs])
            if sp.fixup == "gate_up":
                got = ref.gate_up_deinterleave(gathered)
                assert torch.equal(ref.gate_up_interleave(got, s), gathered)
            elif sp.fixup == "row_concat":
                got = ref.row_concat(gathered)
                assert torch.equal(ref.row_split(got, s), gathered)
            else:
                got = ref.column_concat(gathered)
            assert torch.equal(got, e), f"rank {r}: gathered {n} fix-up differs"
            if sp.fixup == "qkv_grouped":  # generation shard = HF heads of this tp rank
                q, k, v = glob[n + "#hf"]
                parts = ref.grouped_to_qkv(e, nq // TPg, ng // TPg, d)
                for got_part, full in zip(parts, (q, k, v)):
                    assert torch.equal(got_part, full.chunk(TPg, 0)[tg])
    assert tuple(sent) == plan.bytes_sent
    for r in (0, W - 1):
        outgoing = send_moves(plan, r)
        assert all(m.src_rank == r != m.dst_rank for m in outgoing)
        assert sum(m.nbytes for m in outgoing) == plan.bytes_sent[r]


# ---- rejections -----------------------------------------------------------------------------

@pytest.mark.parametrize("specs_kw,train,gen,world,needles", [
    ({}, (2, 2, 2), (1, 1), 10, ["world_size=10", "TP=2", "PP=2", "DP=2", "= 8"]),
    ({}, (8, 1, 1), (3, 1), None, ["TP_g=3", "TP=8", "[1, 2, 4, 8]"]),
    ({}, (2, 1, 1), (4, 1), None, ["TP_g=4", "TP=2"]),
    ({}, (1, 4, 1), (1, 3), None, ["PP_g=3", "PP=4"]),
    ({}, (1, 2, 1), (1, 4), None, ["PP_g=4", "PP=2"]),
    (dict(num_heads=6, num_query_groups=6), (8, 1, 1), (4, 1), None,
     ["attention heads = 6", "generation TP_g=4"]),
    (dict(num_heads=6, num_query_groups=6), (4, 1, 1), (2, 1), None,
     ["attention heads = 6", "training TP=4"]),
    (dict(num_heads=8, num_query_groups=2), (8, 1, 1), (4, 1), None,
     ["query groups = 2", "generation TP_g=4"]),
    (dict(num_heads=8, num_query_groups=2), (4, 1, 1), (2, 1), None,
     ["query groups = 2", "training TP=4"]),
    (dict(num_layers=6), (1, 4, 1), (1, 4), None, ["num_layers=6", "PP_g=4"]),
    (dict(num_layers=6), (1, 4, 1), (1, 2), None, ["num_layers=6", "training PP=4"]),
    (dict(ffn_hidden=12), (8, 1, 1), (8, 1), None, ["ffn hidden size = 12", "TP_g=8"]),
    (dict(ffn_hidden=12), (8, 1, 1), (2, 1), None, ["ffn hidden size = 12", "training TP=8"]),
    (dict(padded_vocab=100), (8, 1, 1), (8, 1), None, ["padded vocab size = 100", "TP_g=8"]),
    (dict(padded_vocab=100), (8, 1, 1), (1, 1), None, ["padded vocab size = 100", "TP=8"]),
], ids=["world", "tpg-divides", "tpg-larger", "ppg-divides", "ppg-larger", "heads-gen",
        "heads-train", "groups-gen", "groups-train", "layers-gen", "layers-train", "ffn-gen",
        "ffn-train", "vocab-gen", "vocab-train"])
def test_rejections_name_the_numbers(specs_kw, train, gen, world, needles):
    cfg = dict(num_heads=16, num_query_groups=8)
    cfg.update(specs_kw)
    with pytest.raises(ReshardPlanError) as exc:
        plan_reshard(_small_gpt(**cfg), train, gen, world)
    msg = str(exc.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert isinstance(exc.value, ValueError)


def test_bad_specs_rejected():
    with pytest.raises(ReshardPlanError, match="tp_kind"):
        ParamSpec("x", (4,), tp_kind="diagonal", layer=0)
    with pytest.raises(ReshardPlanError, match="exactly one"):
        ParamSpec("x", (4,))
    with pytest.raises(ReshardPlanError, match="needs tp_kind 'row'"):
        ParamSpec("x", (4, 4), tp_kind="column", fixup="row_concat", layer=0)
    dup = [ParamSpec("x", (4,), layer=0), ParamSpec("x", (4,), layer=0)]
    with pytest.raises(ReshardPlanError, match="duplicate"):
        plan_reshard(dup, (1, 1, 1), (1, 1))
    with pytest.raises(ReshardPlanError, match="layer 5"):
        plan_reshard([ParamSpec("x", (4,), layer=5)], (1, 1, 1), (1, 1), num_layers=4)
    from types import SimpleNamespace as NS

    with pytest.raises(ReshardPlanError, match="cp=2"):
        plan_reshard(_small_gpt(), NS(tp=2, pp=1, dp=1, cp=2), (1, 1))
    with pytest.raises(ReshardPlanError, match="vpp=2"):
        plan_reshard(_small_gpt(), NS(tp=2, pp=2, dp=1, vpp=2), (1, 1))
    with pytest.raises(ReshardPlanError, match=r"\(2, 0, 1\)"):
        plan_reshard(_small_gpt(), (2, 0, 1), (1, 1))
    with pytest.raises(ReshardPlanError, match="rows along dim 1"):
        plan_reshard([ParamSpec("x", (4, 6), tp_kind="row", layer=0)], (4, 1, 1), (1, 1))


# ---- small helpers --------------------------------------------------------------------------

def test_spec_helpers_and_names():
    specs = gpt_param_specs(80, 64, 8, 4, 8, 128, 256, tied_embeddings=True)
    names = {sp.name: sp for sp in specs}
    assert "output_layer.weight" not in names
    emb = names["embedding.word_embeddings.weight"]
    assert emb.pp_stage == "first_and_last" and emb.stages(4, 80) == (0, 3)
    assert megatron_local_name(emb, 4, 80, 3) == "output_layer.weight"
    assert megatron_local_name(emb, 4, 80, 0) == emb.name
    qkv = names["decoder.layers.37.self_attention.linear_qkv.weight"]
    assert qkv.global_shape == ((8 + 8) * 8, 64) and qkv.fixup == "qkv_grouped"
    assert qkv.stages(4, 80) == (1,)
    local = megatron_local_name(qkv, 4, 80, 1)
    assert local == "decoder.layers.17.self_attention.linear_qkv.weight"
    fc1 = names["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.global_shape == (256, 64) and fc1.fixup == "gate_up"
    plan = plan_reshard(specs, (4, 4, 2), (2, 2))
    pr = plan.param(fc1.name)
    assert [(pc.src_slot, pc.src_offset, pc.dst_offset, pc.length) for pc in pr.pieces] == [
        (0, 0, 0, 32), (0, 32, 64, 32), (1, 0, 32, 32), (1, 32, 96, 32)]
    assert pr.gen_stages == (0,) and plan.param(emb.name).gen_stages == (0, 1)
    assert "TP_g=2" in plan.summary()
    # objects with .tp/.pp/.dp are accepted too
    same = plan_reshard(specs, plan.train, plan.gen)
    assert same.bytes_recv == plan.bytes_recv
