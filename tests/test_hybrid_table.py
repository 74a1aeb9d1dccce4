"""The per-rank reshard table (hyflow.hybrid.reshard_table), run in a simulation without process
groups: executing every rank's routes as the executor does (copies, TP-merge gathers with the
fix-up kernels, PP-merge publish/receive streams) builds exactly the generation shards of
Megatron-style sharding, and the training shards come back out of them bit for bit."""
from __future__ import annotations

import pytest
import torch

from hyflow.hybrid import gpt_param_specs, megatron_local_name, plan_reshard, rank_table
from hyflow.hybrid.reshard_table import VIA_COPY, VIA_PP_MERGE, VIA_TP_MERGE
from hyflow.parallel.layout import Layout
from hyflow.kernels import place_shard, take_shard


def _train_coord(plan, rank):
    """(tp, pp, dp) of a rank in the plan's training layout."""
    c = plan.train.coords(rank)
    return c["tp"], c["pp"], c["dp"]


def _stages(spec, pp, L, split=None):
    if spec.layer is not None:
        split = split or [L // pp] * pp
        return {next(q for q in range(pp) if spec.layer < sum(split[:q + 1]))}
    return {"first": {0}, "last": {pp - 1}, "first_and_last": {0, pp - 1}}[spec.pp_stage]


def _shard(spec, w, rank, n):
    if spec.tp_kind == "replicated":
        return w
    if spec.fixup == "gate_up":
        g, u = w.chunk(2, dim=0)
        return torch.cat([g.chunk(n, 0)[rank], u.chunk(n, 0)[rank]])
    return w.chunk(n, dim=spec.shard_dim)[rank].contiguous()


LAYOUTS = [(tp, pp, dp, tpg, ppg) for tp in (1, 2, 4) for pp in (1, 2, 4) for dp in (1, 2)
           if tp * pp * dp <= 8 for tpg in (1, 2, 4) if tp % tpg == 0 for ppg in (1, 2, 4) if pp % ppg == 0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("lay", LAYOUTS, ids=["tp{}pp{}dp{}-g{}x{}".format(*lay) for lay in LAYOUTS])
def test_executing_the_tables_builds_the_generation_shards(lay, tied):
    _simulate(*lay, tied)


UNEVEN = [(1, 2, 1, 1, 1, (1, 5)), (2, 2, 1, 1, 1, (4, 2)), (1, 2, 2, 1, 2, (1, 5)), (1, 4, 1, 1, 2, (2, 1, 1, 2)),
          (2, 4, 1, 2, 1, (3, 1, 1, 1)), (1, 4, 2, 1, 4, (1, 2, 2, 1))]


@pytest.mark.parametrize("lay", UNEVEN, ids=["tp{}pp{}dp{}-g{}x{}-".format(*lay[:5]) + "-".join(map(str, lay[5]))
                                             for lay in UNEVEN])
def test_tables_of_an_uneven_stage_split(lay):
    """Uneven training stages (Layout.stage_layers): each generation stage holds the layers of the
    training stages it merges, numbered from its own first layer."""
    *dims, split = lay
    plan = _simulate(*dims, True, L=6, split=split)
    assert plan.train_split == split
    p = dims[1] // dims[4]
    assert plan.gen_split == tuple(sum(split[j * p:(j + 1) * p]) for j in range(dims[4]))


def _simulate(TP, PP, DP, TPg, PPg, tied, L=4, split=None):
    """Execute every rank's table as the executor does; check the generation shards and the way back."""
    W = TP * PP * DP
    specs = gpt_param_specs(L, 6, 8, 4, 2, 12, 40, tied_embeddings=tied, qkv_bias=True, dtype_bytes=4)
    train_layout = (TP, PP, DP) if split is None else Layout(tp=TP, pp=PP, dp=DP, stage_layers=split)
    plan = plan_reshard(specs, train_layout, (TPg, PPg), W, num_layers=L)
    tsplit, gsplit = (None, None) if split is None else (plan.train_split, plan.gen_split)
    gen = torch.Generator().manual_seed(W * 31 + TPg * 5 + PPg)
    glob = {sp.name: torch.randn(sp.global_shape, generator=gen) for sp in specs}
    # Each rank's training model, keyed by its stage-local names (what the executor looks up).
    train = []
    for r in range(W):
        tp, pp, _ = _train_coord(plan, r)
        train.append({megatron_local_name(sp, PP, L, pp, tsplit): _shard(sp, glob[sp.name], tp, TP)
                      for sp in specs if pp in _stages(sp, PP, L, tsplit)})
    tables = [rank_table(plan, r) for r in range(W)]
    bufs = [torch.full((t.numel,), float("nan")) for t in tables]
    views = [{rt.gen_name: b[rt.offset:rt.offset + rt.numel].view(rt.shape) for rt in t.routes}
             for t, b in zip(tables, bufs)]
    recv = [0] * W
    for r, t in enumerate(tables):  # copies and TP merges
        for rt in t.own_routes:
            if rt.via == VIA_COPY:
                views[r][rt.gen_name].copy_(train[r][rt.train_name])
            else:
                assert rt.via == VIA_TP_MERGE
                for j, peer in enumerate(t.tp_merge_ranks):
                    place_shard(rt.fixup, train[peer][rt.train_name], j, t.tp_merge_size, views[r][rt.gen_name])
                    recv[r] += 0 if peer == r else train[peer][rt.train_name].numel() * 4
    for r, t in enumerate(tables):  # PP merges: peers' published streams, in order
        for j, stream in t.pp_receive:
            peer = t.pp_merge_ranks[j]
            published = [(n, views[peer][n]) for n, _ in tables[peer].pp_publish]  # the peer's stream
            assert [numel for _, numel in stream] == [v.numel() for _, v in published]
            for (name, _), (pub_name, value) in zip(stream, published):
                if name is not None:
                    assert name == pub_name
                    assert t.pp_merge_ranks.index(r) in dict(tables[peer].pp_publish)[name]
                    views[r][name].copy_(value)
                    recv[r] += value.numel() * 4
    for r, t in enumerate(tables):
        tp, pp, _ = _train_coord(plan, r)
        tg, pg, _ = plan.gen_coord(r)
        expect = {megatron_local_name(sp, PPg, L, pg, gsplit): _shard(sp, glob[sp.name], tg, TPg)
                  for sp in specs if pg in _stages(sp, PPg, L, gsplit)}
        assert set(views[r]) == set(expect)
        for name, value in expect.items():
            assert torch.equal(views[r][name], value), (r, name)
        assert recv[r] == plan.bytes_recv[r], r
        assert all(rt.via == VIA_PP_MERGE for rt in t.routes if rt.src_stage != pp)
        for rt in t.own_routes:  # the training shard comes back out of the generation shard
            back = torch.empty_like(train[r][rt.train_name])
            if rt.via == VIA_TP_MERGE:
                take_shard(rt.fixup, views[r][rt.gen_name], t.tp_slot, t.tp_merge_size, back)
            else:
                back.copy_(views[r][rt.gen_name])
            assert torch.equal(back, train[r][rt.train_name]), (r, rt.gen_name)
    return plan


def test_table_names_sources_by_stage_local_name():
    """PP=4 -> PP_g=2 tied: stage 1 takes the embedding from stage 0; stage 2 takes layer 3 and
    the tied output layer (stage 3's ``output_layer.weight``) from stage 3, and publishes its
    own layer to stage 3."""
    specs = gpt_param_specs(4, 8, 2, 2, 4, 16, 32, tied_embeddings=True)
    plan = plan_reshard(specs, (1, 4, 1), (1, 2))
    t1 = {r.gen_name: r for r in rank_table(plan, 1).routes}
    emb = t1["embedding.word_embeddings.weight"]
    assert (emb.src_stage, emb.train_name, emb.via) == (0, "embedding.word_embeddings.weight", VIA_PP_MERGE)
    t2 = rank_table(plan, 2)
    routes = {r.gen_name: r for r in t2.routes}
    out = routes["output_layer.weight"]
    assert (out.src_stage, out.train_name, out.via) == (3, "output_layer.weight", VIA_PP_MERGE)
    fc2 = routes["decoder.layers.1.mlp.linear_fc2.weight"]  # global layer 3 on stage 3 (local 0)
    assert (fc2.src_stage, fc2.train_name) == (3, "decoder.layers.0.mlp.linear_fc2.weight")
    assert dict(t2.pp_publish)["decoder.layers.0.mlp.linear_fc2.weight"] == (1,)
    assert t2.pp_merge_ranks == (2, 3) and t2.tp_merge_ranks == (2,)
    assert sum(r.numel for r in t2.routes) == t2.numel and t2.routes[-1].offset + t2.routes[-1].numel == t2.numel
