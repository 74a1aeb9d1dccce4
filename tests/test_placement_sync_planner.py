"""The weight-sync planner, run on numpy arrays: every destination shard equals the slice an
independent sharding of the full weights gives it, every element arrives once, bytes match."""

import numpy as np
import pytest

from hyflow.hybrid.param_specs import gpt_param_specs, megatron_local_name
from hyflow.parallel.layout import Layout
from hyflow.placement.sync_planner import SyncPlanError, plan_weight_sync, summarize_weight_sync

L = 4


def _at(start, tp, pp=1, dp=1, split=None):
    """A pool's layout: tp x pp x dp from rank ``start``."""
    return Layout(tp=tp, pp=pp, dp=dp, stage_layers=split, start=start)


def _specs(tied=False, qkv_bias=False):
    # 8 heads, 4 query groups (GQA), head_dim 2, hidden 16, ffn 16, padded vocab 32, fp32
    return gpt_param_specs(L, 16, 8, 4, 2, 16, 32, tied_embeddings=tied, qkv_bias=qkv_bias, dtype_bytes=4)


def _full(specs, seed=0):
    rng = np.random.default_rng(seed)
    return {sp.name: rng.standard_normal(sp.global_shape).astype(np.float32) for sp in specs}


def _shard(spec, full, tp, k):
    """Megatron's TP shard k of tp of a full parameter (independent of the planner)."""
    dim = spec.shard_dim
    if dim is None:
        return full.copy()
    if spec.fixup == "gate_up":
        gate, up = np.split(full, 2, axis=0)
        return np.concatenate([np.split(gate, tp, axis=0)[k], np.split(up, tp, axis=0)[k]], axis=0)
    return np.split(full, tp, axis=dim)[k].copy()


def _holdings(specs, full, layout):
    """rank -> {local name: shard} for every rank of ``layout``."""
    out = {r: {} for r in layout.ranks}
    for sp in specs:
        split = layout.stage_layers
        for stage in sp.stages(layout.pp, L, split):
            name = megatron_local_name(sp, layout.pp, L, stage, split)
            for dp in range(layout.dp):
                for c in range(layout.cp):  # context-parallel ranks hold the same shards
                    for t in range(layout.tp):
                        out[layout.rank_of(tp=t, cp=c, pp=stage, dp=dp)][name] = _shard(sp, full[sp.name], layout.tp, t)
    return out


def _run(plan, src_hold, dst_layout, dst_expect):
    got = {r: {n: np.zeros_like(v) for n, v in names.items()} for r, names in dst_expect.items()}
    hits = {r: {n: np.zeros(v.shape, dtype=np.int64) for n, v in names.items()} for r, names in dst_expect.items()}
    received = {r: 0 for r in dst_layout.ranks}
    for b in plan.buckets:
        assert b.nbytes <= plan.bucket_bytes or len(b.pieces) == 1
        for p in b.pieces:
            src = np.take(src_hold[p.src_rank][p.src_name], range(p.src_offset, p.src_offset + p.length), axis=p.dim)
            index = [slice(None)] * src.ndim
            index[p.dim] = slice(p.dst_offset, p.dst_offset + p.length)
            got[p.dst_rank][p.dst_name][tuple(index)] = src
            hits[p.dst_rank][p.dst_name][tuple(index)] += 1
            assert p.nbytes == src.nbytes
            if not b.is_local:
                received[p.dst_rank] += src.nbytes
    return got, hits, received


def _synced_exactly(specs, src, dst):
    """The plan of ``src`` -> ``dst``, run on numpy: every destination element equals the independent
    sharding's, written once."""
    full = _full(specs)
    plan = plan_weight_sync(specs, src, dst, L)
    expect = _holdings(specs, full, dst)
    got, hits, _ = _run(plan, _holdings(specs, full, src), dst, expect)
    for r in dst.ranks:
        for name in expect[r]:
            np.testing.assert_array_equal(got[r][name], expect[r][name], err_msg=f"rank {r} {name}")
            assert (hits[r][name] == 1).all()
    return plan


CASES = [
    ((2, 1, 1), (1, 1, 2)),  # the acceptance shape: TP=2 training -> two TP_g=1 replicas
    ((1, 1, 2), (2, 1, 1)),  # generation wider than training
    ((2, 2, 1), (4, 1, 1)),
    ((1, 2, 2), (2, 2, 1)),
    ((4, 1, 1), (2, 2, 2)),
    ((2, 4, 1), (1, 1, 3)),
]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("src_shape,dst_shape", CASES)
def test_every_destination_shard_exact_once(src_shape, dst_shape, tied):
    specs = _specs(tied=tied, qkv_bias=True)
    full = _full(specs)
    src = _at(0, *src_shape)
    dst = _at(src.world_size, *dst_shape)  # disjoint pools
    plan = plan_weight_sync(specs, src, dst, L, bucket_bytes=2048)
    expect = _holdings(specs, full, dst)
    got, hits, received = _run(plan, _holdings(specs, full, src), dst, expect)
    for r in dst.ranks:
        assert set(got[r]) == set(expect[r])
        for name in expect[r]:
            np.testing.assert_array_equal(got[r][name], expect[r][name], err_msg=f"rank {r} {name}")
            assert (hits[r][name] == 1).all(), f"rank {r} {name}: elements written {np.unique(hits[r][name])} times"
        own = sum(v.nbytes for v in expect[r].values())
        # each rank receives exactly its slice: no full copy anywhere, nothing sent twice
        assert received[r] == plan.bytes_recv(r) == plan.shard_bytes[r] == own
    assert plan.total_bytes == sum(received.values())
    assert plan.rounds > 1  # the small bucket splits the pairs' traffic
    assert all(plan.bytes_recv(r) == 0 for r in src.ranks)


@pytest.mark.parametrize("src_shape,dst_shape", [((1, 2, 1, (1, 3)), (1, 1, 2)), ((2, 2, 1, (3, 1)), (1, 2, 1)),
                                                 ((1, 2, 1, (1, 3)), (1, 2, 1, (3, 1)))],
                         ids=["uneven-to-pp1", "uneven-to-even", "uneven-to-uneven"])
def test_uneven_stage_splits_sync_exactly(src_shape, dst_shape):
    """Layout.stage_layers on either side: each layer travels from the stage holding it to the
    stage that holds it there, under that stage's local layer number."""
    specs = _specs(tied=True)
    src = _at(0, *src_shape)
    dst = _at(src.world_size, *dst_shape)
    plan = _synced_exactly(specs, src, dst)
    # layer 1 lives on stage 1 (local 0) of a 1/3 split, on stage 0 (local 1) of a 3/1 split
    first = {p.src_name for b in plan.buckets for p in b.pieces if p.name == "decoder.layers.1.mlp.linear_fc2.weight"}
    assert first == {"decoder.layers.0.mlp.linear_fc2.weight" if src.stage_layers == (1, 3) else
                     "decoder.layers.1.mlp.linear_fc2.weight"}
    with pytest.raises(SyncPlanError, match="does not fill"):
        plan_weight_sync(specs, _at(0, 1, 2, 1, (1, 2)), dst, L)


def test_a_context_parallel_actor_sends_from_the_stage_that_holds_the_layer():
    """A pooled actor with cp=2 and pp=2: its second stage starts at pool rank tp*cp*dp = 2 (Megatron's
    order), which the pool's Layout knows (the removed ModelLayout dropped cp and read rank 1, the
    first stage's CP peer)."""
    src, dst = Layout(tp=1, cp=2, pp=2, start=0), _at(4, 1, 1, 2)
    plan = _synced_exactly(_specs(tied=True), src, dst)
    layer3 = {b.src_rank for b in plan.buckets for p in b.pieces if p.name.startswith("decoder.layers.3.")}
    assert layer3 == {2}  # stage 1, cp 0


def test_sources_spread_over_replicas_and_stay_in_the_source_pool():
    specs = _specs()
    src, dst = _at(0, 1, 1, 2), _at(2, 1, 1, 2)
    plan = plan_weight_sync(specs, src, dst, L)
    senders = {b.dst_rank: {b.src_rank} for b in plan.buckets}
    assert senders == {2: {0}, 3: {1}}  # replica j reads from source replica j mod DP_src
    assert plan.max_sent == plan.model_bytes  # each source replica sends the model once


def test_same_pool_other_layout_uses_local_copies():
    specs = _specs()
    src, dst = _at(0, 2, 1, 1), _at(0, 1, 1, 2)
    plan = plan_weight_sync(specs, src, dst, L)
    full = _full(specs)
    got, hits, _ = _run(plan, _holdings(specs, full, src), dst, _holdings(specs, full, dst))
    assert plan.local(0) and plan.total_bytes < 2 * plan.model_bytes


def test_layout_that_does_not_divide_is_named():
    with pytest.raises(SyncPlanError, match="query groups = 4 is not divisible by the destination tp=8"):
        plan_weight_sync(_specs(), _at(0, 2), _at(2, 8), L)
    with pytest.raises(SyncPlanError, match="pp=3 does not divide num_layers=4"):
        plan_weight_sync(_specs(), _at(0, 1, 3), _at(3, 1), L)


@pytest.mark.parametrize("src,dst", [
    (_at(0, 2, 1, 1), _at(2, 1, 1, 2)),
    (_at(0, 2, 2, 2, (1, 3)), _at(8, 1, 2, 3)),
    (_at(0, 4, 1, 1), _at(4, 2, 2, 2)),
    (_at(0, 1, 2, 3), _at(6, 2, 1, 4)),   # 4 replicas served by 3 source replicas
    (_at(0, 2, 1, 1), _at(0, 1, 1, 2)),   # one pool, two layouts: local copies
], ids=["tp2-to-2x", "pp2-uneven", "tp4-to-tp2pp2", "dp3-serves-4", "same-pool"])
def test_each_rank_plans_exactly_its_part_of_the_whole_plan(src, dst):
    """A job's rank plans only what it sends and receives: the same buckets (pieces, order, round)
    as the whole world's plan holds for it, and the one-replica summary has the whole plan's numbers."""
    specs = _specs(tied=True, qkv_bias=True)
    whole = plan_weight_sync(specs, src, dst, L, bucket_bytes=1024)
    for rank in sorted(set(src.ranks) | set(dst.ranks)):
        mine = plan_weight_sync(specs, src, dst, L, bucket_bytes=1024, rank=rank)
        assert mine.rank == rank and mine.buckets
        assert set(mine.buckets) == {b for b in whole.buckets if rank in (b.src_rank, b.dst_rank)}
        assert (mine.sends(rank), mine.recvs(rank), mine.local(rank)) == \
               (whole.sends(rank), whole.recvs(rank), whole.local(rank))
        assert mine.shard_bytes.get(rank) == whole.shard_bytes.get(rank)
    if set(src.ranks) & set(dst.ranks):
        with pytest.raises(SyncPlanError, match="overlap"):
            summarize_weight_sync(specs, src, dst, L, bucket_bytes=1024)
        return
    summary = summarize_weight_sync(specs, src, dst, L, bucket_bytes=1024)
    assert (summary.total_bytes, summary.buckets, summary.rounds, summary.max_recv, summary.max_sent) == \
           (whole.total_bytes, len(whole.buckets), whole.rounds, whole.max_recv, whole.max_sent)
    assert summary.max_shard_bytes == max(whole.shard_bytes.values())
    assert summary.max_peers == max(len({b.src_rank for b in whole.recvs(r)}) for r in dst.ranks)


def test_per_rank_planning_at_1024_ranks_is_a_rank_s_share():
    """The 1024-GPU preset's one_step_off pools (Qwen2-72B, TP8 x PP4 x DP16 -> TP_g 4 x DP 128): the
    whole plan has 576,000 pieces; a training rank plans the 8 replicas it serves, a generation rank
    its own slice (about 1.2K pieces each: ~0.05 and ~0.01 CPU s against ~4.4 s for the whole plan,
    2026-11-27 dev box)."""
    from hyflow.parallel.layout import pad_vocab_size

    specs = gpt_param_specs(80, 8192, 64, 8, 128, 29568, pad_vocab_size(152064, 8), qkv_bias=True, dtype_bytes=2)
    src, dst = _at(0, 8, 4, 16, (19, 21, 21, 19)), _at(512, 4, 1, 128)
    summary = summarize_weight_sync(specs, src, dst, 80)
    for rank in (0, 511, 512, 1023):
        mine = plan_weight_sync(specs, src, dst, 80, rank=rank)
        pieces = sum(len(b.pieces) for b in mine.buckets)
        assert 0 < pieces < 2000
        if rank in dst.ranks:  # its slice, once
            assert mine.bytes_recv(rank) == mine.shard_bytes[rank] <= summary.max_recv
        else:  # the 8 replicas it serves
            assert {dst.coords(b.dst_rank)["dp"] % src.dp for b in mine.buckets} == {src.coords(rank)["dp"]}
            assert mine.bytes_sent(rank) <= summary.max_sent
    replica0 = [plan_weight_sync(specs, src, dst, 80, rank=r) for r in range(512, 516)]
    assert summary.total_bytes == 128 * sum(p.bytes_recv(r) for p, r in zip(replica0, range(512, 516)))
    assert summary.buckets == 331_264  # the whole plan's (the review's count)
