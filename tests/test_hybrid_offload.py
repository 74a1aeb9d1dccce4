"""Gradient buffers and optimizer state leave memory during generation and come back exact.

Two identical 2-rank runs (TP=2 training, TP=1 generation): one step, a train -> gen ->
train round trip, one more step; one run offloads, the other does not. While generating,
the offloading run's grad buffers and Adam moments hold no storage; afterwards both runs
end with bit-identical weights and optimizer state.
"""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _run(offload: bool, distributed_optimizer: bool) -> dict:
    from hyflow.hybrid.executor import HybridEngine
    from hyflow.jobs.lm import arith_batch
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from hyflow.training.step import train_step

    groups = init_training_groups(Layout(tp=2), seed=3)
    desc = tiny_llama(vocab_size=200, num_attention_heads=8, num_query_groups=4)
    model = build_gpt_model(desc, groups)
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    chunks = wrap_ddp([model], groups, distributed_optimizer=distributed_optimizer)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-3), 10)
    batch = [arith_batch(desc.vocab_size, 2, 12, 5, torch.Generator().manual_seed(0))]
    train_step(chunks, optimizer, scheduler, batch, groups=groups)
    engine = HybridEngine(chunks[0], desc, groups, (1, 1), optimizer=optimizer,
                          offload_grad_buffers=offload, offload_optimizer=offload)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer
    moments = [v for st in inner.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    grads = [b.grad_data for b in chunks[0].buffers]
    gen = engine.to_generation()
    during = {"moment_bytes": sum(m.untyped_storage().nbytes() for m in moments),
              "grad_bytes": sum(g.untyped_storage().nbytes() for g in grads),
              "gen_params": {n: p.detach().clone() for n, p in gen.named_parameters()}}
    engine.to_training()
    stats = train_step(chunks, optimizer, scheduler, batch, groups=groups)
    return {"during": during, "moments": len(moments), "loss": stats["lm_loss"],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": [m.clone() for m in moments]}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distopt"])
def test_offload_frees_state_during_generation_and_restores_it_exactly(distributed_optimizer):
    plain = run_on_ranks(_run, 2, False, distributed_optimizer)
    offloaded = run_on_ranks(_run, 2, True, distributed_optimizer)
    for rank, (a, b) in enumerate(zip(plain, offloaded)):
        assert a["moments"] > 0 and a["during"]["moment_bytes"] > 0 and a["during"]["grad_bytes"] > 0
        assert b["during"]["moment_bytes"] == 0 and b["during"]["grad_bytes"] == 0, rank
        for name, value in a["during"]["gen_params"].items():  # generation weights unaffected
            assert torch.equal(b["during"]["gen_params"][name], value), (rank, name)
        assert a["loss"] == b["loss"], rank
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]), rank
        assert all(torch.equal(x, y) for x, y in zip(a["state"], b["state"])), rank
