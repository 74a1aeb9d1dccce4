"""``configs/long_context_32k.yaml``: GRPO on a Qwen2-7B-class model with 32K-token responses on
64 GPUs (YaRN x4, CP=2 x TP=2, full recompute) is a valid config that ``hyflow plan`` fits in
80 GB, and the plan shows why each long-context setting is there."""

from __future__ import annotations

import os

from hyflow.jobs.registry import load_job_config
from hyflow.plan.core import PlanOptions, build_plan

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "long_context_32k.yaml")
GIB = 2 ** 30


def _plan(*overrides: str):
    return build_plan(CONFIG, list(overrides), PlanOptions(world_size=64, gpu_memory_gib=80, megatron_ranks=()))


def test_long_context_preset_fits_h100_80gb():
    cfg = load_job_config(CONFIG, [])
    assert cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens == 33792
    assert cfg.model.max_position_embeddings < 33792 <= cfg.model.context_length == 131072  # YaRN x4
    result = _plan()
    assert not result.errors, result.errors
    assert result.fits and result.required_bytes < 80 * GIB
    actor = next(r for r in result.roles if r.name == "actor")
    assert (actor.layout.tp, actor.layout.cp, actor.layout.dp) == (2, 2, 16)
    update = next(p for p in result.phases if p.phase == "actor update")
    assert "16896 tokens" in next(i.note for i in update.items if i.name == "logits")  # 33792 / cp
    assert (result.reshard.train.tp, result.reshard.train.dp) == (2, 32)  # the reshard counts CP ranks as DP


def test_context_parallelism_and_recompute_are_what_make_it_fit():
    base = _plan().required_bytes
    without_cp = _plan("actor.layout.cp=1")
    assert without_cp.required_bytes > base + 15 * GIB  # the vocabulary log-softmax and activations double
    no_recompute = _plan("actor.recompute=none")
    assert not no_recompute.fits
    assert any("activations" in e and "actor.recompute" in e for e in no_recompute.errors)
