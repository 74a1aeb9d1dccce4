"""The hybrid engine with a mixture-of-experts actor: training expert grid (EP, ETP, PP) ->
generation replicas holding every expert (EP_g = 1, ETP_g = TP_g), on gloo with <= 4 ranks.

* the generation model's logits equal the training model's (fp32, 1e-5) and greedy decoding
  picks the same tokens;
* bytes received equal the plan (dense reshard plan + expert exchange plan), per rank;
* train -> gen -> train (three times) leaves parameters and optimizer state bit-identical, and
  training continues afterwards.
"""

import pytest
import torch

from hyflow.testing import run_on_ranks
from hyflow.testing.multirank import default_timeout

pytestmark = pytest.mark.multirank
#: generous on a loaded box; HYFLOW_TEST_TIMEOUT raises it further
TIMEOUT = max(900.0, default_timeout())

SEQ = 12


def _logits(chunk, pgs, tokens):
    from test_hybrid_engine import _logits as logits

    was = chunk.training
    chunk.eval()  # MoE under TP without sequence parallelism runs in eval mode only (Megatron)
    try:
        return logits(chunk, pgs, tokens)
    finally:
        chunk.train(was)


def _scenario(tp, pp, ep, etp, tp_g, pp_g):
    import torch.distributed as dist

    from test_hybrid_engine import _greedy, _optimizer_state, trained_once

    from hyflow.hybrid.executor import HybridEngine
    from hyflow.models.description import tiny_moe
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.training.step import train_step

    world = dist.get_world_size()
    layout = Layout(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1).with_dp_for(world)
    groups = init_training_groups(layout, seed=3)
    desc = tiny_moe(vocab_size=200, num_attention_heads=8, num_query_groups=4,
                    moe=dict(shared_expert_ffn_hidden_size=48, shared_expert_gate=True))
    model, chunks, optimizer, scheduler, batch = trained_once(desc, groups)
    engine = HybridEngine(chunks[0], desc, groups, (tp_g, pp_g))
    tokens = torch.randint(0, desc.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(5))
    want = _logits(model, groups.pgs, tokens)
    params0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt0 = _optimizer_state(optimizer)
    results = {}
    for round_ in range(3):
        gen_model = engine.to_generation()
        if round_ == 0:
            results["logits"] = (want, _logits(gen_model, engine.gen_groups.pgs, tokens))
            gen_model.eval()
            results["greedy"] = _greedy(gen_model, engine.gen_groups.pgs, tokens[:, :4], 4, desc.vocab_size)
            gen_model.train()
            results["bytes"] = (engine.stats.bytes_received, engine.planned_bytes_received)
            results["experts_exchanged"] = engine.expert_exchange is not None
            experts = [n for n, _ in gen_model.named_parameters() if ".local_experts." in n]
            results["gen_experts"] = len(experts)
        engine.to_training()
    if not layout.sequence_parallel:  # growing sequences do not split over TP
        model.eval()
        results["greedy_train"] = _greedy(model, groups.pgs, tokens[:, :4], 4, desc.vocab_size)
        model.train()
    same_params = all(torch.equal(params0[n], p) for n, p in model.named_parameters())
    opt1 = _optimizer_state(optimizer)
    results["identical"] = (same_params, opt0.keys() == opt1.keys() and all(torch.equal(opt0[k], opt1[k])
                                                                            for k in opt0))
    stats = train_step(chunks, optimizer, scheduler, batch, groups=groups)
    results["trains_after"] = stats["update_ok"] == 1.0 and stats["lm_loss"] == stats["lm_loss"]
    return results


CASES = [
    # (tp, pp, ep, etp, tp_g, pp_g, world)
    (1, 1, 1, None, 1, 1, 2),  # the same expert grid: experts shared in place
    (1, 1, 2, None, 1, 1, 2),  # EP=2 (DP=2): every replica gathers all 8 experts
    (2, 1, 2, 1, 1, 1, 2),  # TP=2 x EP=2, ETP=1 -> TP_g=1
    (2, 1, 1, 2, 1, 1, 2),  # expert TP merged
    (2, 1, 2, 2, 2, 1, 4),  # TP=2, DP=2, EP=2 x ETP=2 -> TP_g=2
    (2, 2, 2, 1, 1, 1, 4),  # TP=2 x PP=2 x EP=2 -> one rank per replica
    (1, 2, 2, None, 1, 2, 4),  # PP=2 x EP=2 -> PP_g=2
]


@pytest.mark.parametrize("tp,pp,ep,etp,tp_g,pp_g,world", CASES,
                         ids=[f"tp{c[0]}pp{c[1]}ep{c[2]}etp{c[3] or c[0]}-to-tp{c[4]}pp{c[5]}-w{c[6]}" for c in CASES])
def test_expert_reshard_round_trip(tp, pp, ep, etp, tp_g, pp_g, world):
    results = run_on_ranks(_scenario, world, tp, pp, ep, etp, tp_g, pp_g, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        want, got = r["logits"]
        assert got.shape == want.shape
        assert ((got - want).norm() / want.norm()).item() <= 1e-5, rank
        if "greedy_train" in r:
            assert torch.equal(r["greedy"], r["greedy_train"]), rank
        assert r["greedy"].shape == (2, 4)
        measured, planned = r["bytes"]
        assert measured == planned, (rank, measured, planned)
        assert r["gen_experts"] == 2 * 8 * (4 // pp_g)  # every expert of the generation stage's layers
        assert r["experts_exchanged"] == ((tp, pp, ep, etp) != (1, 1, 1, None)), rank
        if ep > 1 or (etp or tp) != tp_g:
            assert measured > 0
        assert r["identical"] == (True, True), rank
        assert r["trains_after"], rank


def test_expert_exchange_plan_at_1024_ranks():
    """The exchange plan of a 235B-shaped layout is arithmetic: every rank receives its generation
    stage's experts at 1/TP_g minus what it holds, and the groups partition the ranks."""
    from hyflow.hybrid.expert_exchange import plan_expert_exchange
    from hyflow.hybrid.param_specs import model_param_specs
    from hyflow.hybrid.reshard_plan import plan_reshard
    from hyflow.models.description import ModelDescription, MoEDescription
    from hyflow.parallel.layout import Layout

    desc = ModelDescription(family="qwen3_moe", vocab_size=151936, hidden_size=4096, num_layers=94,
                            num_attention_heads=64, num_query_groups=4, head_dim=128, ffn_hidden_size=12288,
                            qk_layernorm=True, moe=MoEDescription(num_experts=128, top_k=8, ffn_hidden_size=1536))
    layout = Layout(tp=4, pp=8, ep=32, etp=1, sequence_parallel=True, stage_layers=[11] + [12] * 6 + [11]).with_dp_for(1024)
    plan = plan_reshard(model_param_specs(desc, 151936 + 128, 2), layout, (4, 4), num_layers=94)
    x = plan_expert_exchange(desc, layout, plan, 2)
    assert sorted(r for g in x.groups for r in g) == list(range(1024)) and len(x.groups[0]) == 32 * 8
    for rank in (0, 517, 1023):
        layers = len(x.gen_layers(rank))
        assert x.gen_bytes(rank) == layers * 128 * 3 * 4096 * (1536 // 4) * 2
        own = x.train_bytes(rank) // 4  # the quarter of its (full-width) experts that it keeps
        assert x.recv_bytes(rank) == x.gen_bytes(rank) - own, rank


@pytest.mark.parametrize("src,dst", [
    (dict(tp=1, pp=1, dp=2, ep=2), dict(tp=1, pp=1, dp=2)),
    (dict(tp=2, pp=2, dp=2, ep=4, etp=1), dict(tp=2, pp=1, dp=2)),
    (dict(tp=2, pp=1, dp=2, ep=2, etp=2), dict(tp=4, pp=2, dp=1)),
], ids=["ep2-to-tp1", "tp2pp2ep4etp1-to-tp2", "tp2ep2etp2-to-tp4pp2"])
def test_weight_sync_plans_every_expert_of_every_replica(src, dst):
    """One-step-off pools: the weight sync gives each generation rank every expert's columns of its
    TP shard, each element from exactly one piece, read from the expert grid's holder."""
    from hyflow.hybrid.param_specs import expert_param_specs
    from hyflow.models.description import tiny_moe
    from hyflow.parallel.layout import Layout
    from hyflow.placement.sync_planner import plan_weight_sync

    desc = tiny_moe(moe=dict(num_experts=8, ffn_hidden_size=32))
    specs = expert_param_specs(desc, 4)
    s, d = Layout(**src), Layout(**dst, start=100)
    plan = plan_weight_sync([], s, d, desc.num_layers, experts=specs, num_experts=8, bucket_bytes=4096)
    gen = torch.Generator().manual_seed(0)
    full = {x.name: torch.randn(x.global_shape, generator=gen) for x in specs}
    per, F = 8 // s.ep, 32
    held = {}  # (rank, local name) -> the source shard, sliced independently of the planner
    for x in specs:
        q = x.layer // (desc.num_layers // s.pp)
        local = f"decoder.layers.{x.layer % (desc.num_layers // s.pp)}.mlp.experts.local_experts.{x.expert % per}." \
                f"linear_{x.kind}.weight"
        w = F // s.expert_tp
        for a in range(s.expert_tp):
            block = full[x.name]
            shard = torch.cat([block[a * w:(a + 1) * w], block[F + a * w:F + (a + 1) * w]]) if x.kind == "fc1" \
                else block[:, a * w:(a + 1) * w]
            for edp in range(s.expert_dp):
                held[(s.expert_rank_of(etp=a, ep=x.expert // per, edp=edp, pp=q), local)] = shard
    got, hits = {}, {}
    for b in plan.buckets:
        for p in b.pieces:
            src_t = held[(p.src_rank, p.src_name)].narrow(p.dim, p.src_offset, p.length)
            x = next(x for x in specs if x.name == p.name)
            w = F // d.tp
            shape = (2 * w, x.hidden) if x.kind == "fc1" else (x.hidden, w)
            key = (p.dst_rank, p.dst_name)
            got.setdefault(key, torch.full(shape, float("nan")))
            hits.setdefault(key, torch.zeros(shape, dtype=torch.long))
            got[key].narrow(p.dim, p.dst_offset, p.length).copy_(src_t)
            hits[key].narrow(p.dim, p.dst_offset, p.length).add_(1)
    assert len(got) == d.dp * d.tp * len(specs)  # every rank: its stage's layers, every expert
    for (rank, name), value in got.items():
        t, qd = d.coords(rank)["tp"], d.coords(rank)["pp"]
        layer = qd * (desc.num_layers // d.pp) + int(name.split(".")[2])
        expert, kind = int(name.split(".")[6]), name.split(".")[7][len("linear_"):]
        block, w = full[f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_{kind}.weight"], F // d.tp
        want = torch.cat([block[t * w:(t + 1) * w], block[F + t * w:F + (t + 1) * w]]) if kind == "fc1" \
            else block[:, t * w:(t + 1) * w]
        assert torch.equal(value, want), (rank, name)
        assert bool((hits[(rank, name)] == 1).all())
    assert sum(plan.shard_bytes.values()) == d.dp * sum(x.nbytes for x in specs)
