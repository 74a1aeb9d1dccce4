"""configs/smollm2_arith.yaml (GRPO on SmolLM2-135M-Instruct, arithmetic, 2 CPU ranks): it
validates, trains at PP=2 and generates at PP_g=1 as 2 micro-DP replicas, its checkpoint path is
the one `make smollm2` writes, and a missing checkpoint fails naming the command that creates it."""

from __future__ import annotations

import json
import os
import re

import pytest

from hyflow.jobs.registry import load_job_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "smollm2_arith.yaml")


def test_config_validates_with_dp2_training_and_generation():
    cfg = load_job_config(CONFIG, [])
    assert cfg.job == "rl" and cfg.trainer.nproc == 2
    train = cfg.actor_layout()
    assert (train.tp, train.pp, train.dp) == (1, 1, 2)  # faster than PP=2 (BENCHMARKS.md)
    assert (cfg.rollout.layout.tp, cfg.rollout.layout.pp) == (1, 1)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n >= 2
    assert (cfg.reward.kind, cfg.reward.rule) == ("rule", "numeric_match")
    assert cfg.data.task == "arithmetic" and cfg.data.tokenizer
    # no hand-copied architecture: the checkpoint's model.json is the model, once converted
    with open(CONFIG) as f:
        assert "\nmodel:" not in f.read()
    if os.path.exists(os.path.join(REPO, cfg.actor.checkpoint, "model.json")):
        m = cfg.model
        assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.vocab_size) == (
            30, 576, 9, 3, 49152)


def test_plan_generates_on_both_ranks_and_at_pp2_through_micro_dp():
    from hyflow.plan.core import PlanOptions, build_plan

    result = build_plan(CONFIG, [], PlanOptions(world_size=2, gpu_memory_gib=80, megatron_ranks=()))
    assert not result.errors, result.errors
    gen = result.generation
    assert (gen["tp"], gen["pp"], gen["dp"], gen["micro_dp_size"]) == (1, 1, 2, 1)
    result = build_plan(CONFIG, ["actor.layout.pp=2"], PlanOptions(world_size=2, gpu_memory_gib=80,
                                                                     megatron_ranks=()))
    gen = result.generation  # one model copy over 2 stages: 2 replicas of it generate
    assert (gen["tp"], gen["pp"], gen["micro_dp_size"]) == (1, 1, 2)


def test_checkpoint_is_the_one_make_smollm2_writes():
    cfg = load_job_config(CONFIG, [])
    with open(os.path.join(REPO, "Makefile")) as f:
        makefile = f.read()
    target = re.search(r"^SMOLLM2_CKPT \?= (\S+)$", makefile, re.M)
    assert target and cfg.actor.checkpoint == target.group(1)
    assert cfg.data.tokenizer == os.path.join(cfg.actor.checkpoint, "tokenizer")
    assert re.search(r"hyflow convert hf2mcore .*--out \$\(SMOLLM2_CKPT\) --tp 1 --pp 2", makefile)


def test_missing_checkpoint_names_the_command_that_creates_it(tmp_path):
    from hyflow.checkpoint.model import CheckpointError
    from hyflow.rl.models import check_actor_checkpoint

    missing = str(tmp_path / "smollm2-135m")
    with pytest.raises(CheckpointError) as e:
        check_actor_checkpoint(missing)
    message = str(e.value)
    assert "does not exist" in message
    assert f"hyflow convert hf2mcore --hf <HF model dir or .gguf file> --out {missing}" in message
    assert "make smollm2" in message
    os.makedirs(missing)  # a directory without the checkpoint files: same hint
    with pytest.raises(CheckpointError, match="make smollm2"):
        check_actor_checkpoint(missing)


def test_model_section_matches_the_converted_checkpoint():
    """When `make smollm2` has run here, the config runs its model.json (no hand-copied section)."""
    cfg = load_job_config(CONFIG, [])
    path = os.path.join(REPO, cfg.actor.checkpoint, "model.json")
    if not os.path.exists(path):
        pytest.skip(f"{cfg.actor.checkpoint} not converted here (make smollm2)")
    with open(path) as f:
        saved = json.load(f)
    for key in ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "ffn_hidden_size", "max_position_embeddings", "rope_theta",
                "tied_embeddings", "eos_token_ids"):
        assert getattr(cfg.model, key) == saved[key], key
