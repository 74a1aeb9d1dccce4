"""Expert-parallel training parity: a tiny MoE (8 experts, top-2, a gated shared expert,
load-balancing aux loss and z-loss) trained at EP=2 on 2 ranks equals the 1-rank EP=1 run.

Both start from the same layout-independent init and see the same global batch (4 sequences: 2
micro-batches of 2 on one rank, 1 per rank at DP=2); with EP=2 each rank holds 4 of the 8 experts
of every layer and tokens reach them by all-to-all. The LM loss, the routers' aux losses, every
gradient (after the step's reductions) and the parameters after one optimizer step must agree
within 1e-5 (relative, fp32).
"""

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

SEQ, MICRO, GLOBAL_BATCH = 16, 2, 4
TOL = 1e-5


def moe_desc():
    from hyflow.models.description import tiny_moe

    return tiny_moe(vocab_size=200, num_layers=2, moe=dict(shared_expert_ffn_hidden_size=48, shared_expert_gate=True,
                                                             aux_loss_coeff=0.01, z_loss_coeff=1e-3))


def _full_grads(model, desc, groups) -> dict:
    """Every parameter's reduced gradient (DDP's main_grad), gathered like the parameters."""
    from hyflow.models.weights import gather_full_state_dict

    module = getattr(model, "module", model)
    saved = {}
    for name, p in module.named_parameters():
        saved[name] = p.data
        p.data = p.main_grad.detach().to(p.dtype).view_as(p).clone()
    try:
        return gather_full_state_dict(model, desc, groups)
    finally:
        for name, p in module.named_parameters():
            p.data = saved[name]


def _train(tp: int, ep: int, dp: int, sequence_parallel: bool = False):
    import torch.distributed as dist

    from hyflow.jobs.lm import arith_batch
    from hyflow.models.builder import build_model_chunks
    from hyflow.models.weights import gather_full_state_dict, load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.training.moe_losses import router_loss_stats
    from hyflow.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from hyflow.training.step import lm_loss, forward_backward

    groups = init_training_groups(Layout(tp=tp, dp=dp, ep=ep, etp=1, sequence_parallel=sequence_parallel), seed=7)
    desc = moe_desc()
    models = build_model_chunks(desc, groups, spec="local")
    load_full_state_dict(models[0], random_full_state_dict(desc, seed=3), desc, groups)
    chunks = wrap_ddp(models, groups, False)
    optimizer, _ = build_optimizer(chunks, OptimConfig(lr=2e-3, clip_grad=1.0), 1)
    gen = torch.Generator().manual_seed(11)
    batches = [arith_batch(desc.vocab_size, MICRO, SEQ, 5, gen) for _ in range(GLOBAL_BATCH // MICRO)]
    n_micro = GLOBAL_BATCH // (MICRO * dp)
    mine = batches[groups.dp_rank * n_micro:(groups.dp_rank + 1) * n_micro]
    lm_loss.prepare(mine, groups)
    chunks[0].zero_grad_buffer()
    optimizer.zero_grad()
    stats = forward_backward(chunks, mine, loss_fn=lm_loss, dp_size=groups.pgs.dp.size())
    from hyflow.training.step import reduce_stats

    loss = reduce_stats(stats, ("lm_loss",), groups)["lm_loss"]
    router = router_loss_stats(groups, len(mine), desc.num_layers)
    grads = _full_grads(chunks[0], desc, groups)
    update_ok, grad_norm, _ = optimizer.step()
    params = gather_full_state_dict(chunks[0], desc, groups)
    out = dict(loss=loss, router=router, grads=grads, params=params, grad_norm=float(grad_norm), ok=update_ok)
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, 1, 1, 1)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _assert_matches(got, want) -> None:
    assert got["ok"] and want["ok"]
    assert abs(got["loss"] - want["loss"]) <= TOL * abs(want["loss"])
    assert set(got["router"]) == {"moe/load_balancing_loss", "moe/z_loss"} == set(want["router"])
    for name, value in want["router"].items():
        assert abs(got["router"][name] - value) <= TOL * abs(value), (name, got["router"], want["router"])
    assert abs(got["grad_norm"] - want["grad_norm"]) <= TOL * want["grad_norm"]
    for kind in ("grads", "params"):
        assert set(got[kind]) == set(want[kind])
        worst = max(want[kind], key=lambda n: _rel(got[kind][n], want[kind][n]))
        assert _rel(got[kind][worst], want[kind][worst]) <= TOL, (kind, worst, _rel(got[kind][worst], want[kind][worst]))


def test_reference_routes_and_trains(reference):
    grads = reference["grads"]
    experts = [n for n in grads if ".experts.local_experts." in n]
    assert len(experts) == 2 * 8 * 2  # every expert of both layers received tokens (and a gradient)
    assert all(grads[n].abs().sum() > 0 for n in experts)
    assert all(grads[n].abs().sum() > 0 for n in grads if n.endswith(("router.weight", "gate_weight")))
    assert reference["router"]["moe/load_balancing_loss"] > 0.5 and reference["router"]["moe/z_loss"] > 0


def test_expert_parallel_matches_single_rank(reference):
    _assert_matches(run_on_ranks(_train, 2, 1, 2, 2)[0], reference)


def test_expert_parallel_with_tensor_parallel_matches_single_rank(reference):
    """TP=2 with sequence parallelism and EP=2 x ETP=1 over the same 2 ranks (DP=1)."""
    _assert_matches(run_on_ranks(_train, 2, 2, 2, 1, True)[0], reference)
