"""`hyflow plan`'s step-time cost model at the 1024-GPU preset (Qwen2-72B, TP8 x PP4 x DP32, TP_g 4,
8 GPUs per node) against hand-computed numbers (the scale review of 2026-11-27):

* the reshard: the PP merge's groups (ranks 0/256/512/768) span four nodes, so its 25.5 GiB go at
  the network's 50 GB/s (>= 0.55 s), not NVLink's 450 GB/s (0.071 s);
* DDP's gradient traffic: per optimizer step a ring reduce-scatter of the fp32 gradients and an
  all-gather of the bf16 parameters of the biggest stage, 16 optimizer steps per RL step, ~4.3 s;
* the pipeline bubble: an update flushes after each mini-batch (32 micro-batches per rank, not the
  512 of the whole step): ~8.7% more update time.
"""

from __future__ import annotations

import os

import pytest

from hyflow.hybrid import gpt_param_specs, plan_reshard
from hyflow.jobs.registry import load_job_config
from hyflow.parallel.layout import Layout, pad_vocab_size
from hyflow.plan import throughput as tp
from hyflow.plan.stages import bubble_step_factor, job_head_layers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(REPO, "configs", "qwen2_72b_1024gpu.yaml")
SPLIT = (19, 21, 21, 19)
GB = 1e9


@pytest.fixture(scope="module")
def preset():
    cfg = load_job_config(PRESET, [])
    layout = Layout(tp=8, pp=4, dp=32, sequence_parallel=True, stage_layers=SPLIT)
    assert cfg.trained_actor_layout().with_dp_for(1024).stage_layers == SPLIT
    specs = gpt_param_specs(80, 8192, 64, 8, 128, 29568, pad_vocab_size(152064, 8), qkv_bias=True, dtype_bytes=2)
    return cfg, layout, plan_reshard(specs, Layout(tp=8, pp=4, dp=32, stage_layers=SPLIT), (4, 1))


def test_reshard_time_uses_the_network_for_merges_across_nodes(preset):
    cfg, _, plan = preset
    hw = tp.Hardware()
    # rank 0: its TP merge [0, 1] in node 0, its PP merge [0, 256, 512, 768] over nodes 0/32/64/96
    assert plan.tp_merge_ranks(0) == (0, 1) and plan.pp_merge_ranks(0) == (0, 256, 512, 768)
    pp = plan.bytes_recv_pp[0]
    assert pp / 2**30 == pytest.approx(25.51, abs=0.01) and plan.bytes_recv[0] / 2**30 == pytest.approx(29.69, abs=0.01)
    by_hand = (plan.bytes_recv[0] - pp) / 450e9 + pp / 50e9
    seconds = tp.reshard_seconds(plan, 8, hw)
    assert seconds == pytest.approx(by_hand, rel=1e-3)
    assert seconds >= 0.55  # was max(bytes_recv) / NVLink = 0.071 s
    # one node holding whole PP groups (a 4-GPU world, 8 GPUs a node): NVLink only
    small = plan_reshard(gpt_param_specs(4, 64, 4, 4, 16, 128, 512), Layout(tp=2, pp=2, dp=1), (1, 1))
    assert tp.reshard_seconds(small, 8, hw) == pytest.approx(max(small.bytes_recv) / 450e9, rel=0.5)
    assert tp.reshard_seconds(small, 1, hw) > 5 * tp.reshard_seconds(small, 8, hw)


def test_dp_gradient_traffic_per_step(preset):
    cfg, layout, _ = preset
    # stages 1 and 2: 21 layers of (877,684,736 - 2 x 8192) / 8 + 2 x 8192 parameters
    params = 21 * ((877_684_736 - 2 * 8192) // 8 + 2 * 8192)
    updates = 1024 * 16 // 1024  # ppo_epochs 1 x (train_batch_size x n / mini_batch_size)
    by_hand = updates * 31 / 32 * params * (4 + 2) / 50e9  # reduce-scatter fp32 + all-gather bf16, ring
    seconds = tp.dp_gradient_seconds(cfg, cfg.model, layout, 8, tp.Hardware())
    assert seconds == pytest.approx(by_hand, rel=1e-9)
    assert 4.2 < seconds < 4.5  # the review: ~221 GB per rank per step, ~4.4 s at 50 GB/s
    # the dp groups (ranks 0, 8, 16, ...) span nodes; all inside one node would go at NVLink speed
    assert tp.dp_gradient_seconds(cfg, cfg.model, layout, 1024, tp.Hardware()) == pytest.approx(by_hand * 50 / 450)


def test_update_bubble_is_per_mini_batch(preset):
    cfg, layout, _ = preset
    head = job_head_layers(cfg, cfg.model)
    scoring, update = tp.pipeline_factors(cfg, cfg.model, layout)
    assert scoring == pytest.approx(bubble_step_factor(list(SPLIT), head, 512))  # 16384 rows / 32 / 1
    assert update == pytest.approx(bubble_step_factor(list(SPLIT), head, 32))  # 1024 samples / 32 / 1
    # balanced stages: (m + p - 1) / m; the update's 32 micro-batches per flush cost ~8.7% more
    assert update / scoring == pytest.approx((35 / 32) / (515 / 512), rel=0.01)
    flat = tp.training_seconds(cfg, cfg.model, 1024, tp.Hardware())
    assert flat < tp.training_seconds(cfg, cfg.model, 1024, tp.Hardware(), layout) < flat * update


def test_the_plan_reports_them():
    from hyflow.plan.core import PlanOptions, build_plan

    result = build_plan(PRESET, [], PlanOptions(world_size=1024, megatron_ranks=()))
    sync = result.throughput["sync"]
    assert sync["reshard_s"] >= 0.55 and 4.2 < sync["dp_gradient_s"] < 4.5
    assert sync["step_s"] == pytest.approx(sync["generation_s"] + sync["reshard_s"] + sync["training_s"]
                                           + sync["dp_gradient_s"])
    off = result.throughput["one_step_off"]
    assert off["dp_gradient_s"] > 0 and off["step_s"] >= off["training_s"] + off["dp_gradient_s"]
