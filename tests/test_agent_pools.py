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
import subprocess
import sys

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


def test_one_step_offs_in_flight_batch_keeps_trajectory_masks_and_counters(tmp_path):
    """one_step_off's checkpoint holds the batch sampled for the next step; with multi-turn rows that
    batch keeps the loss mask over observations and the per-sample counters through the file (the
    rest of its kill -9 resume is the single-turn one's: test_one_step_off)."""
    from types import SimpleNamespace

    import torch

    from hyflow.placement.inflight import InFlight, read_inflight, write_inflight
    from hyflow.rollout.dp import META, SampleTensors

    prompts, lens = [2, 4], [3, 5]
    meta = torch.zeros(2, len(META), dtype=torch.long)
    meta[:, META.index("prompt_len")] = torch.tensor(prompts)
    meta[:, META.index("response_len")] = torch.tensor(lens)
    samples = SampleTensors(meta=meta, tokens=torch.arange(sum(prompts) + sum(lens), dtype=torch.long),
                            logprobs=-torch.rand(sum(lens)), mask=torch.tensor([1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.float32),
                            stats=torch.rand(2, 4, dtype=torch.float64))
    pool, layout = SimpleNamespace(start=2, stop=4), SimpleNamespace(tp=1, pp=1, dp=2)
    write_inflight(str(tmp_path), 2, InFlight(step=3, samples=samples, version=1, gen_seconds=0.5, loader={"epoch": 0}),
                   pool, layout)
    got = read_inflight(str(tmp_path), 2, pool, layout, torch.device("cpu")).samples
    for name in ("meta", "tokens", "logprobs", "mask", "stats"):
        assert torch.equal(getattr(got, name), getattr(samples, name)), name


@pytest.mark.slow
def test_async_multi_turn_kill_9_resume_equals_the_straight_run(tmp_path):
    """``trainer.mode: async`` (k=2, new weights 1 decode step after due) with multi-turn trajectories:
    the checkpoint after step 2 holds trajectories half way (turns answered, a turn half generated or
    finished and not answered yet); ``hyflow train`` SIGKILLed once it is complete and resumed (the
    environments re-created, the saved assistant turns replayed into them and checked, the turns
    continued) reproduces the straight run's metrics of every step and its final weights."""
    import os

    import torch

    from hyflow.checkpoint.discovery import checkpoint_status, step_dir_name
    from hyflow.monitor.metrics import read_metrics
    from hyflow.placement.inflight import inflight_file
    from hyflow.testing.agent import TINY_MULTI_TURN
    from hyflow.testing.resume import checkpoint_tensors, kill_9_when

    config = tmp_path / "mt.yaml"
    config.write_text(TINY_MULTI_TURN)
    timeout = float(os.environ.get("HYFLOW_TEST_TIMEOUT", 600))
    skip = ("timing_s/", "cpu_s", "comm/", "perf/", "rollout/tokens_per_s", "reshard/seconds", "memory/",
            "fully_async/rollouter/")
    overrides = [*POOLS, "trainer.mode=async", "trainer.max_staleness=2", "trainer.update_after_tokens=1",
                 "trainer.total_steps=4", "trainer.save_every=2"]

    def args(out):
        return [sys.executable, "-m", "hyflow.cli", "train", str(config), *overrides, f"trainer.output_dir={out}"]

    def rows(out):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(skip)} for r in read_metrics(out)}

    straight, out = str(tmp_path / "straight"), str(tmp_path / "run")
    done = subprocess.run(args(straight), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:]
    statuses = []
    for rank in (2, 3):
        saved = torch.load(inflight_file(os.path.join(straight, "checkpoints", step_dir_name(2)), rank),
                           weights_only=True)
        statuses += [(d["status"], d["traj"]["counters"][0], len(d["turn"].get("token_ids", [])))
                     for d in saved["trajectories"]]
    # half way: turns answered, then a turn half generated, or finished and not answered yet
    assert any(status == "running" and turns >= 1 and tokens > 0 for status, turns, tokens in statuses), statuses
    assert any(status == "waiting" and turns >= 1 for status, turns, _ in statuses), statuses
    step2 = os.path.join(out, "checkpoints", step_dir_name(2))
    kill_9_when(args(out), lambda: checkpoint_status(step2)[0], str(tmp_path / "launch.log"), timeout)
    resumed = subprocess.run(args(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resuming from" in resumed.stdout
    a, b = rows(straight), rows(out)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and a[4]["num_turns/mean"] > 1.5
    assert max(a[s]["fully_async/staleness/max"] for s in a) >= 1.0
    for step in (1, 2, 3, 4):
        assert b[step] == a[step], f"step {step} differs from the straight run"
    final = os.path.join("checkpoints", step_dir_name(4), "actor")
    wa = checkpoint_tensors(os.path.join(straight, final), str(tmp_path))
    wb = checkpoint_tensors(os.path.join(out, final), str(tmp_path))
    assert wa.keys() == wb.keys() and wa and all(bool((wa[k] == wb[k]).all()) for k in wa)
