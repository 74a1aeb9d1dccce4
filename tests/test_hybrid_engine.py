"""The hybrid engine executor on gloo: every (TP, PP) -> (TP_g, PP_g) with <= 4 ranks.

* the generation-layout model's logits equal the training-layout model's (fp32, 1e-5);
* greedy decoding (full forward each step) picks the same tokens in both layouts;
* bytes received equal the planner's per-rank number;
* train -> gen -> train (three times) leaves parameters and optimizer state bit-identical,
  and training continues afterwards.
"""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

SEQ = 12


def _logits(chunk, pgs, tokens):
    """Full-vocabulary logits [b, s, V] through the pipeline (None off the last stage)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hyflow.training.step import forward_backward, position_ids

    captured = []

    def keep(output, batch):
        full = gather_from_tensor_model_parallel_region(output, group=pgs.tp)
        captured.append(full.detach().clone())
        return output.sum() * 0, {}

    batch = {"tokens": tokens, "position_ids": position_ids(tokens), "labels": tokens,
             "loss_mask": torch.ones_like(tokens, dtype=torch.float)}
    forward_backward([chunk], [batch], loss_fn=keep, with_labels=False, forward_only=True, pgs=pgs)
    last = dist.get_global_rank(pgs.pp, pgs.pp.size() - 1)
    payload = [captured[0] if captured else None]
    dist.broadcast_object_list(payload, src=last, group=pgs.pp)
    return payload[0]


def _greedy(chunk, pgs, prompt, steps, vocab):
    tokens = prompt
    for _ in range(steps):
        nxt = _logits(chunk, pgs, tokens)[:, -1, :vocab].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompt.shape[1]:]


def _optimizer_state(optimizer):
    sd = optimizer.state_dict()
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj.clone()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
    walk("", sd)
    return flat


def trained_once(desc, groups):
    """(model, DDP chunks, optimizer, scheduler, batch) of ``desc`` in ``groups``' layout from the
    layout-independent init, after one training step (non-trivial Adam state)."""
    from hyflow.jobs.lm import arith_batch
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from hyflow.training.step import train_step

    model = build_gpt_model(desc, groups)
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    chunks = wrap_ddp([model], groups, distributed_optimizer=False)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-3), 10)
    batch = [arith_batch(desc.vocab_size, 2, SEQ, 5, torch.Generator().manual_seed(0))]
    train_step(chunks, optimizer, scheduler, batch, groups=groups)
    return model, chunks, optimizer, scheduler, batch


def _scenario(tp, pp, tp_g, pp_g, tied, stage_layers=None, num_layers=4):
    import torch.distributed as dist

    from hyflow.hybrid.executor import HybridEngine
    from hyflow.models.description import tiny_llama
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.training.step import train_step

    world = dist.get_world_size()
    groups = init_training_groups(Layout(tp=tp, pp=pp, dp=world // (tp * pp), stage_layers=stage_layers), seed=3)
    desc = tiny_llama(vocab_size=200, tied_embeddings=tied, num_attention_heads=8, num_query_groups=4,
                      num_layers=num_layers)
    model, chunks, optimizer, scheduler, batch = trained_once(desc, groups)
    engine = HybridEngine(chunks[0], desc, groups, (tp_g, pp_g))
    tokens = torch.randint(0, desc.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(5))
    want = _logits(model, groups.pgs, tokens)
    want_greedy = _greedy(model, groups.pgs, tokens[:, :4], 4, desc.vocab_size)
    params0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt0 = _optimizer_state(optimizer)

    results = {}
    for round_ in range(3):
        gen_model = engine.to_generation()
        if round_ == 0:
            got = _logits(gen_model, engine.gen_groups.pgs, tokens)
            results["logits"] = (want, got)
            results["greedy"] = (want_greedy, _greedy(gen_model, engine.gen_groups.pgs, tokens[:, :4], 4,
                                                      desc.vocab_size))
            results["bytes"] = (engine.stats.bytes_received, engine.plan.bytes_recv[dist.get_rank()])
            results["released"] = engine.stats.released_training_bytes
            results["gen_bytes"] = (engine.stats.generation_bytes, engine.plan.gen_bytes[dist.get_rank()])
            results["gen_layers"] = len(gen_model.decoder.layers)
            train_ptrs = {p.data_ptr() for p in model.parameters()}
            results["in_place"] = (engine.in_place, all(p.data_ptr() in train_ptrs for p in gen_model.parameters()))
        engine.to_training()
    same_params = all(torch.equal(params0[n], p) for n, p in model.named_parameters())
    opt1 = _optimizer_state(optimizer)
    same_opt = opt0.keys() == opt1.keys() and all(torch.equal(opt0[k], opt1[k]) for k in opt0)
    stats = train_step(chunks, optimizer, scheduler, batch, groups=groups)
    results["identical"] = (same_params, same_opt)
    results["trains_after"] = stats["update_ok"] == 1.0 and stats["lm_loss"] == stats["lm_loss"]
    return results


CASES = [
    # (tp, pp, tp_g, pp_g, world, tied)
    (2, 1, 1, 1, 2, False),
    (1, 2, 1, 1, 2, True),
    (2, 1, 2, 1, 4, False),   # identity layout with dp=2
    (2, 1, 1, 1, 4, True),    # dp=2 training, 4 generation replicas
    (4, 1, 2, 1, 4, False),
    (4, 1, 1, 1, 4, True),
    (2, 2, 1, 1, 4, False),
    (2, 2, 2, 1, 4, True),
    (2, 2, 1, 2, 4, False),
    (1, 4, 1, 2, 4, False),
    (1, 4, 1, 1, 4, True),
]


@pytest.mark.parametrize("tp,pp,tp_g,pp_g,world,tied", CASES,
                         ids=[f"tp{c[0]}pp{c[1]}-to-tp{c[2]}pp{c[3]}-w{c[4]}{'-tied' if c[5] else ''}" for c in CASES])
def test_reshard_round_trip(tp, pp, tp_g, pp_g, world, tied):
    results = run_on_ranks(_scenario, world, tp, pp, tp_g, pp_g, tied)
    for rank, r in enumerate(results):
        want, got = r["logits"]
        assert got.shape == want.shape
        assert ((got - want).norm() / want.norm()).item() <= 1e-5, rank
        assert torch.equal(*r["greedy"]), rank
        measured, planned = r["bytes"]
        assert measured == planned, (rank, measured, planned)
        if (tp, pp) == (tp_g, pp_g):  # identical layouts: generation reads the training weights in place
            assert r["in_place"] == (True, True) and r["released"] == 0 and r["gen_bytes"][0] == 0, rank
        else:
            assert r["in_place"] == (False, False), rank
            assert r["gen_bytes"][0] == r["gen_bytes"][1], (rank, r["gen_bytes"])
            assert r["released"] > 0  # the training copy was freed during generation
        assert r["identical"] == (True, True), rank
        assert r["trains_after"], rank


UNEVEN = [
    # (tp, pp, tp_g, pp_g, world, tied, stage_layers, num_layers)
    (1, 2, 1, 1, 2, True, (1, 3), 4),
    (1, 4, 1, 2, 4, False, (2, 1, 1, 2), 6),
]


@pytest.mark.parametrize("tp,pp,tp_g,pp_g,world,tied,split,layers", UNEVEN,
                         ids=[f"pp{c[1]}-{'-'.join(map(str, c[6]))}-to-pp{c[3]}" for c in UNEVEN])
def test_reshard_round_trip_of_uneven_stages(tp, pp, tp_g, pp_g, world, tied, split, layers):
    """Uneven training stages (Layout.stage_layers): generation stages merge them, the logits and
    greedy tokens equal training's, and the training state comes back bit-identical."""
    results = run_on_ranks(_scenario, world, tp, pp, tp_g, pp_g, tied, split, layers, timeout=900)
    p = pp // pp_g
    for rank, r in enumerate(results):
        want, got = r["logits"]
        assert ((got - want).norm() / want.norm()).item() <= 1e-5, rank
        assert torch.equal(*r["greedy"]), rank
        assert r["bytes"][0] == r["bytes"][1] and r["gen_bytes"][0] == r["gen_bytes"][1], rank
        gen_stage = (rank // (world // pp)) // p
        assert r["gen_layers"] == sum(split[gen_stage * p:(gen_stage + 1) * p]), rank
        assert r["identical"] == (True, True) and r["trains_after"], rank
