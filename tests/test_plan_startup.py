"""`hyflow plan`'s start-up phase against measured start-up memory, and the hybrid engine's build
holding the generation weights once.

* 2 CPU ranks build an RL job's models exactly as the job does (``build_rl_models``) under the
  tensor tracker (:mod:`hyflow.plan.measure`); the peak is within 10% of the plan's start-up figure
  for two layouts (TP2 fp32 -> TP_g 1; PP2 bf16 with the distributed optimizer -> PP_g 1);
* the hybrid engine's set-up with the generation buffer counted as the CUDA path holds it (allocator
  memory from acquire to release): the peak is one generation copy, not two (the generation model
  is built on ``meta``; before, it owned its parameters while the buffer was acquired);
* the 1024-GPU preset's start-up by hand, and every phase fits in 80 GB.
"""

from __future__ import annotations

import os

import pytest

from hyflow.plan.core import PlanOptions, build_plan
from hyflow.testing import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30
# quickstart's job with a model large enough that tensors dominate (10.5 MB of fp32 weights)
MODEL = ["model.hidden_size=256", "model.ffn_hidden_size=512", "model.num_layers=4", "model.vocab_size=512",
         "model.num_attention_heads=8", "model.num_query_groups=4", "actor.sft_warmup_steps=0"]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [
    ["actor.layout.tp=2"],
    ["actor.layout.tp=1", "actor.layout.pp=2", "actor.dtype=bf16", "actor.optim.distributed_optimizer=true"],
], ids=["tp2-fp32", "pp2-bf16-distopt"])
def test_startup_peak_matches_the_plan(layout):
    from hyflow.plan.measure import measure_rl_startup

    out = run_on_ranks(measure_rl_startup, 2, os.path.join(REPO, "configs", "quickstart.yaml"), MODEL + layout)
    assert not out[0]["errors"]
    estimate = out[0]["estimate_bytes"]
    assert out[0]["estimate_phase"].startswith("start-up")
    measured = max(r["tensor_peak_bytes"] for r in out)
    assert abs(measured - estimate) <= 0.10 * estimate, (measured, estimate, out[0]["estimate_items"])


def _engine_build_peak(tp: int, pp: int, tp_g: int, pp_g: int):
    from hyflow.hybrid.executor import HybridEngine
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.plan.measure import TensorMemoryTracker, device_buffer_accounting

    desc = tiny_llama(hidden_size=128, ffn_hidden_size=256, num_layers=4, vocab_size=512)
    groups = init_training_groups(Layout(tp=tp, pp=pp))
    model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
    load_full_state_dict(model, random_full_state_dict(desc, 1), desc, groups)
    tracker = TensorMemoryTracker()
    with tracker, device_buffer_accounting(tracker):
        engine = HybridEngine(model, desc, groups, (tp_g, pp_g), transport="collective")
    return tracker.peak, engine.buffer.nbytes, sum(p.numel() for p in engine.gen_model.parameters())


@pytest.mark.multirank
def test_hybrid_engine_set_up_holds_the_generation_weights_once():
    for peak, buffer, numel in run_on_ranks(_engine_build_peak, 2, 2, 1, 1, 1):
        assert buffer > 0 and numel * 4 == buffer
        # the buffer (and a few bytes of RoPE tables), never the generation model's own copy too
        assert buffer <= peak <= 1.05 * buffer, (peak, buffer)


def test_1024_preset_start_up_by_hand_and_every_phase_fits():
    plan = build_plan(os.path.join(REPO, "configs", "qwen2_72b_1024gpu.yaml"), [],
                      PlanOptions(world_size=1024, megatron_ranks=()))
    assert not plan.errors, plan.errors
    (startup,) = [p for p in plan.phases if p.phase.startswith("start-up")]
    # stages 1 and 2 hold 21 layers: each layer's matrices / TP 8, its 2 norms whole
    layer = (877_684_736 - 2 * 8192) // 8 + 2 * 8192
    params = 21 * layer
    assert params == 2_304_223_488
    # the generation shard (TP_g=4) of the 72,714,592,256 parameters (vocabulary padded to
    # 152,576), the 161 norms whole
    norms = (2 * 80 + 1) * 8192
    generation = ((72_714_592_256 - norms) // 4 + norms) * 2
    by_hand = params * 2 + params * 4 + params * 4 / 32 + generation  # bf16, fp32 grads, master / DP
    assert startup.total == pytest.approx(by_hand, rel=1e-6)
    assert startup.get("generation buffer") == generation
    assert startup.total / GIB == pytest.approx(47.0, abs=0.05)
    # before: the generation model's own parameters too, 80.9 GiB
    for phase in plan.phases:
        assert phase.total * (1 + plan.fragmentation) + plan.reserve_bytes <= plan.gpu_memory_bytes, phase.phase
    assert plan.fits
