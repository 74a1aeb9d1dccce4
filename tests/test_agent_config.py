"""``rollout.multi_turn`` config errors: each one names its key and the way out, before any rank starts."""

import pytest

from hyflow.config import ConfigError
from hyflow.testing.agent import TINY_MULTI_TURN


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "mt.yaml"
    path.write_text(TINY_MULTI_TURN)
    return str(path)


def _load(config, *overrides):
    from hyflow.jobs.registry import load_job_config

    return load_job_config(config, list(overrides))


@pytest.mark.parametrize("overrides, key, words", [
    (["rollout.multi_turn.tools=[calculator, search]"], "rollout.multi_turn.tools", "unknown built-in tool"),
    (["rollout.multi_turn.tool_config_path=/nonexistent/tools.yaml"], "rollout.multi_turn.tool_config_path",
     "tool config not found"),
    (["rollout.multi_turn.format=nope:Parser"], "rollout.multi_turn.format", "importing 'nope' failed"),
    (["rollout.multi_turn.environment=hyflow.agent.tools:Tool"], "rollout.multi_turn.environment",
     "not an environment class"),
    (["rollout.multi_turn.environment=null", "rollout.multi_turn.tools=[]"], "rollout.multi_turn.tools",
     "need tools"),
    (["rollout.multi_turn.tool_timeout=0"], "rollout.multi_turn.tool_timeout", "must be > 0"),
    (["rollout.multi_turn.max_response_tokens=4"], None, "below one turn's rollout.max_new_tokens"),
    (["algorithm.adv_estimator=remax"], None, "ReMax"),
    (["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.length=4"], None, "overlong_buffer"),
    (["rollout.truncate_long_prompts=true"], None, "truncate_long_prompts"),
    (["rollout.multi_turn.max_response_tokens=90"], None, "exceeds the model's context length"),
    (["actor.max_tokens_per_micro_batch=32"], None, "rollout.max_prompt_length + multi_turn.max_response_tokens"),
])
def test_config_errors_name_the_key(config, overrides, key, words):
    with pytest.raises(ConfigError) as e:
        _load(config, *overrides)
    assert words in str(e.value)
    if key is not None:
        assert key in str(e.value)


def test_which_placements_and_modes_run_multi_turn(config):
    """Placement pools run multi-turn trajectories in every trainer.mode (hyflow's engine; the old code
    refused them all)."""
    from hyflow.jobs.rl_preflight import check_role_capabilities

    pooled = ["actor.layout.tp=1", "actor.layout.pp=1", "placement.pools={train: [0, 1], gen: [1, 2]}",
              "placement.actor=train", "placement.rollout=gen", "trainer.total_steps=2"]
    check_role_capabilities(_load(config))  # colocated: the dispatcher can
    for mode in ("sync", "one_step_off", "async"):
        cfg = _load(config, *pooled, f"trainer.mode={mode}")
        check_role_capabilities(cfg)  # raises ConfigError where the pool cannot
        cfg.rollout.backend = "vllm"  # no per-turn hook in vLLM's batch call: still refused, by its key
        with pytest.raises(ConfigError, match="rollout.multi_turn.enable"):
            check_role_capabilities(cfg)


def test_the_shipped_demo_config_loads():
    import os

    from hyflow.testing.agent import REPO

    cfg = _load(os.path.join(REPO, "configs", "smollm2_tools.yaml"))
    assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.tools == ["calculator"]
    assert cfg.data.task == "tool_arithmetic"


def test_plan_sizes_rows_and_caches_for_whole_trajectories(config):
    """``hyflow plan`` of a multi-turn run sizes the rows and the generation pool's KV cache for a whole
    trajectory (prompt + rollout.multi_turn.max_response_tokens), not one turn (it used max_new_tokens)."""
    from hyflow.plan.core import PlanOptions, build_plan

    pooled = ["trainer.nproc=4", "placement.pools={train: [0, 2], gen: [2, 4]}", "placement.actor=train",
              "placement.rollout=gen", "trainer.mode=async"]
    result = build_plan(config, pooled, PlanOptions(world_size=4, device="cpu", megatron_ranks=()))
    cfg = _load(config, *pooled)
    assert result.generation["capacity"] == cfg.rollout.max_prompt_length + cfg.rollout.multi_turn.max_response_tokens
