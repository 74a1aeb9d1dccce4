"""Multi-turn trajectories on placement pools (2 training + 2 generation ranks, the tiny multi-turn
config: a simulated user answering every turn, the calculator tool): each generation replica runs
the agent's loop (tools and environments on its leader) and sends the trajectories' rows, loss
masks and counters to the training ranks that own them.

* ``trainer.mode: sync`` on pools equals the colocated run at every step (1e-5): the same
  trajectories (seeds keyed by step and global prompt index), scored and trained on alike; it would
  fail if the mask over observations were lost on the way (observation tokens would carry loss)
  or the counters (the multi-turn metrics would be missing);
* ``one_step_off``: step 1 equals it too (sampled with the initial weights), step 2 is one update
  behind (staleness 1) and still multi-turn;
* ``async`` (:mod:`hyflow.jobs.async_trajectories`: turns fed to each replica's long-lived scheduler, the
  next one when the environment answered): with ``max_staleness: 0`` it equals the pooled sync run at
  every step; with ``max_staleness: 1`` step 2 trains on trajectories one version old (every token's
  version recorded, observations included: the staleness metrics would raise on a wrong one).
"""

import math

import pytest

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

POOLS = ["trainer.nproc=4", "placement.pools={train: [0, 2], gen: [2, 4]}", "placement.actor=train",
         "placement.rollout=gen"]
COMPARED = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "critic/score/mean",
            "critic/advantages/mean", "critic/advantages/max", "response_length/mean", "num_turns/mean",
            "multi_turn/observation_tokens/mean", "multi_turn/tool_calls/mean", "rollout/generated_tokens")


def _run(config, overrides, out):
    import torch
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner, load_job_config

    torch.set_num_threads(1)
    cfg = load_job_config(config, ["trainer.total_steps=2", "trainer.loggers=[]", f"trainer.output_dir={out}",
                                   *overrides])
    history = job_runner("rl")(cfg)
    return history if dist.get_rank() == 0 else None


def test_multi_turn_on_pools_equals_colocated(tmp_path):
    from hyflow.testing.agent import TINY_MULTI_TURN

    config = tmp_path / "mt.yaml"
    config.write_text(TINY_MULTI_TURN)
    colocated = run_on_ranks(_run, 2, str(config), [], str(tmp_path / "colo"), timeout=1200)[0]
    pooled = run_on_ranks(_run, 4, str(config), [*POOLS, "trainer.mode=sync"], str(tmp_path / "sync"),
                          timeout=1200)[0]
    off = run_on_ranks(_run, 4, str(config), [*POOLS, "trainer.mode=one_step_off"], str(tmp_path / "off"),
                       timeout=1200)[0]
    run = [*POOLS, "trainer.mode=async", "trainer.resume=never"]
    k0 = run_on_ranks(_run, 4, str(config), [*run, "trainer.max_staleness=0"], str(tmp_path / "k0"), timeout=1200)[0]
    k1 = run_on_ranks(_run, 4, str(config), [*run, "trainer.max_staleness=1", "trainer.update_after_tokens=2"],
                      str(tmp_path / "k1"), timeout=1200)[0]
    assert len(colocated) == len(pooled) == len(off) == len(k0) == len(k1) == 2
    for step, (a, b) in enumerate(zip(pooled, k0), 1):
        for key in COMPARED:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), ("k=0", step, key, a[key], b[key])
        assert b["fully_async/staleness/max"] == 0.0
    assert [m["fully_async/staleness/mean"] for m in k1] == [0.0, 1.0]
    assert k1[1]["num_turns/mean"] > 1.5 and k1[1]["multi_turn/observation_tokens/mean"] > 5
    assert k1[1]["actor/grad_norm"] > 0
    for step, (a, b) in enumerate(zip(colocated, pooled), 1):
        assert a["num_turns/mean"] > 1.5 and a["multi_turn/observation_tokens/mean"] > 5
        assert a["actor/grad_norm"] > 0
        for key in COMPARED:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (step, key, a[key], b[key])
        assert b["staleness"] == 0.0 and b["data_plane/bytes_received"] > 0
    for key in COMPARED:
        assert math.isclose(colocated[0][key], off[0][key], rel_tol=1e-5, abs_tol=1e-7), (key, off[0][key])
    assert off[1]["staleness"] == 1.0 and off[1]["num_turns/mean"] > 1.5
