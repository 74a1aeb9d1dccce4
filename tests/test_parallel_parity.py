"""Training parity: the same tiny Llama trained at TP=2, PP=2, DP=2 (distributed
optimizer) and TP=2 x PP=2 ends with the loss and parameters of the 1-rank run.

All runs start from the same layout-independent init and see the same global
batch (4 sequences = 2 micro-batches of 2 on one rank, 1 per rank at DP=2), so in
exact arithmetic they are identical; fp32 round-off must stay below 1e-5.
"""

import pytest
import torch

from hyflow.models.description import tiny_llama
from hyflow.models.weights import random_full_state_dict
from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

STEPS = 4
SEQ = 16
MICRO = 2
GLOBAL_BATCH = 4


def _train(tp: int, pp: int, dp: int, distributed_optimizer: bool, spec: str = "local",
           vpp=None):
    import torch.distributed as dist

    from hyflow.jobs.lm import arith_batch
    from hyflow.models.builder import build_model_chunks
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import gather_full_state_dict, load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from hyflow.training.step import train_step

    groups = init_training_groups(Layout(tp=tp, pp=pp, dp=dp, vpp=vpp), seed=7)
    desc = tiny_llama(vocab_size=200)
    models = build_model_chunks(desc, groups, spec=spec)
    initial = random_full_state_dict(desc, seed=3)
    for vp_stage, model in enumerate(models):
        load_full_state_dict(model, initial, desc, groups, vp_stage=vp_stage if vpp else None)
    chunks = wrap_ddp(models, groups, distributed_optimizer)
    optimizer, scheduler = build_optimizer(
        chunks, OptimConfig(lr=2e-3, clip_grad=1.0, distributed_optimizer=distributed_optimizer), STEPS)
    gen = torch.Generator().manual_seed(11)
    n_micro = GLOBAL_BATCH // (MICRO * dp)
    losses = []
    for _ in range(STEPS):
        batches = [arith_batch(desc.vocab_size, MICRO, SEQ, 5, gen) for _ in range(GLOBAL_BATCH // MICRO)]
        mine = batches[groups.dp_rank * n_micro:(groups.dp_rank + 1) * n_micro]
        stats = train_step(chunks, optimizer, scheduler, mine, groups=groups)
        losses.append(stats["lm_loss"])  # the token mean over every data-parallel rank
    full = {}
    for vp_stage, model in enumerate(models):
        full.update(gather_full_state_dict(model, desc, groups, vp_stage=vp_stage if vpp else None))
    return (losses, full) if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, 1, 1, 1, False)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _assert_matches(result, reference):
    losses, params = result
    ref_losses, ref_params = reference
    assert set(params) == set(ref_params)
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    worst = max(ref_params, key=lambda n: _rel(params[n], ref_params[n]))
    assert _rel(params[worst], ref_params[worst]) <= 1e-5, worst


def test_reference_run_learns(reference):
    losses, params = reference
    assert losses[-1] < losses[0] - 0.05, losses
    initial = random_full_state_dict(tiny_llama(vocab_size=200), seed=3)
    moved = sum(not torch.equal(initial[n], params[n]) for n in params)
    assert moved == len(params)  # every tensor was updated


@pytest.mark.parametrize("tp,pp,dp,distopt", [
    (2, 1, 1, False),
    (1, 2, 1, False),
    (1, 1, 2, True),
    (2, 2, 1, False),
], ids=["tp2", "pp2-1f1b", "dp2-distopt", "tp2xpp2"])
def test_layout_matches_single_rank(reference, tp, pp, dp, distopt):
    result = run_on_ranks(_train, tp * pp * dp, tp, pp, dp, distopt)[0]
    _assert_matches(result, reference)


def test_interleaved_pipeline_matches_single_rank(reference):
    # pp=2 x vpp=2: four one-layer chunks, interleaved 1F1B over 2 micro-batches.
    result = run_on_ranks(_train, 2, 1, 2, 1, False, "local", 2)[0]
    _assert_matches(result, reference)


def test_sdpa_spec_matches_local_spec(reference):
    result = run_on_ranks(_train, 2, 2, 1, 1, False, "sdpa")[0]
    _assert_matches(result, reference)
