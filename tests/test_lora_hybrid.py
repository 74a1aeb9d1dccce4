"""The hybrid engine with a LoRA actor (hyflow.hybrid.adapter_sync): the base reaches the
generation layout once, each later transition moves only the adapters (the planner's adapter
bytes, a small fraction of the weights) and merges them there; the generation model scores like
the adapted training model; the base comes back bit for bit and training goes on."""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

SEQ = 12


def _scenario(tp, pp, tp_g, pp_g):
    import copy

    import torch.distributed as dist

    from hyflow.hybrid.executor import HybridEngine
    from hyflow.jobs.lm import arith_batch
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.lora import apply_lora
    from hyflow.models.lora_config import LoRAConfig
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rl.step_losses import logprob_scorer
    from hyflow.testing.rl import score_rows
    from hyflow.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from hyflow.training.step import train_step

    world = dist.get_world_size()
    groups = init_training_groups(Layout(tp=tp, pp=pp, dp=world // (tp * pp)), seed=3)
    desc = tiny_llama(vocab_size=200, num_attention_heads=8, num_query_groups=4)
    model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0), seed=2)
    chunks = wrap_ddp([model], groups, distributed_optimizer=False)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=5e-2), 10)
    gen = torch.Generator().manual_seed(0)
    batch = [arith_batch(desc.vocab_size, 2, SEQ, 5, gen)]
    train_step(chunks, optimizer, scheduler, batch, groups=groups)  # B != 0: the adapters matter
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    engine = HybridEngine(chunks[0], desc, groups, (tp_g, pp_g))
    tokens = torch.randint(0, desc.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(5))
    train_score = lambda: score_rows(chunks, groups, tokens, logprob_scorer(desc.vocab_size, groups.pgs.tp))  # noqa: E731
    out = {"rounds": [], "adapter_bytes": engine.adapters.plan.bytes_recv[dist.get_rank()],
           "weight_bytes": engine.plan.bytes_recv[dist.get_rank()], "describe": engine.describe()}
    for _ in range(3):
        want = train_score()
        gen_model = engine.to_generation()
        gen_groups = copy.copy(engine.gen_groups)
        gen_groups.pool = "generation"  # the schedule takes the generation groups, not Megatron's globals
        got = score_rows([gen_model], gen_groups, tokens, logprob_scorer(desc.vocab_size, gen_groups.pgs.tp))
        out["rounds"].append((((got - want).abs().max()).item(), engine.stats.bytes_received))
        engine.to_training()
        out.setdefault("base_exact", []).append(
            all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base))
        stats = train_step(chunks, optimizer, scheduler, batch, groups=groups)  # the adapters move on
        out.setdefault("trains", []).append(stats["update_ok"] == 1.0)
    return out


CASES = [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 1)]  # TP merge, PP merge, identical layouts (dp=2)


@pytest.mark.parametrize("tp,pp,tp_g,pp_g", CASES, ids=["tp2-to-tp1", "pp2-to-pp1", "in-place-dp2"])
def test_lora_transitions_move_adapters_only(tp, pp, tp_g, pp_g):
    results = run_on_ranks(_scenario, 2, tp, pp, tp_g, pp_g)
    for rank, r in enumerate(results):
        assert "LoRA: transitions move the adapters only" in r["describe"]
        for i, (diff, received) in enumerate(r["rounds"]):
            assert diff <= 2e-5, (rank, i, diff)  # merged generation weights score as the adapted model
            # the first transition brings the base and the adapters, the others the adapters only
            assert received == (r["weight_bytes"] if i == 0 else 0) + r["adapter_bytes"], (rank, i, received)
        assert all(r["base_exact"]) and all(r["trains"]), rank
        if (tp, pp) != (tp_g, pp_g):
            assert 0 < r["adapter_bytes"] < r["weight_bytes"] / 10, rank
        else:
            assert r["adapter_bytes"] == r["weight_bytes"] == 0
