"""``trainer.mode: async`` on 4 gloo ranks (training TP=2 on ranks 0-1, generation TP_g=1 x 2 on 2-3).

* ``max_staleness=0`` is the synchronous run: every step's metrics equal the colocated ``sync`` run's
  on 2 ranks (1e-5), which needs every update's weights equal too;
* ``max_staleness=1`` taking new weights only when nothing can run is ``one_step_off`` here (every metric,
  1e-5): loader batches 1-2 stream together, and their groups all complete at the last decode step (the
  longest of 4 samples reaches the 6-token budget), so the tie order (loader step, prompt) makes training
  batch 1 loader batch 1; with uneven group lengths streaming forms it from the groups that complete first;
* ``max_staleness=2`` with new weights 2 decode steps after they are due: the groups of loader batches
  1-3 start together with ``w_0`` (the admission bound, 3 batches) and complete (6 tokens at most) before
  anything else can run, so ``w_1`` is taken then and batches 1-3 are all ``w_0``; loader batch 4 starts
  with ``w_1``, ``w_2`` is due as soon as batch 2 is sent and is taken 2 decode steps into it. So the
  samples' staleness is exactly 0, 1, 2, 2 and only step 4's samples span two versions (the per-token
  versions arrived with the rows); the run passes NCCL's first-operation rule on every group;
* the config refuses what async does not run (one line naming the key), e.g. dynamic sampling with a
  reward model (the generation pool scores the groups; :mod:`hyflow.jobs.async_filter`).
"""

import math
import os

import pytest

from hyflow.testing import run_on_ranks
from hyflow.testing.rl import ASYNC_COMPARED, REPO, assert_async_k0_equals_sync

SMALL = ["data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
         "actor.sft_warmup_steps=2", "trainer.loggers=[]", "actor.optim.distributed_optimizer=true",
         "actor.entropy_coeff=0.01"]


def _run(overrides, out, config=None):
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner, load_job_config
    from hyflow.testing.nccl_rules import FirstOps
    from hyflow.testing.rl import QUICKSTART

    cfg = load_job_config(config or QUICKSTART, [*SMALL, f"trainer.output_dir={out}", *overrides])
    with FirstOps() as ops:
        history = job_runner("rl")(cfg)
    return history if dist.get_rank() == 0 else None, ops.first


@pytest.mark.multirank
@pytest.mark.slow
def test_async_k0_equals_sync(tmp_path):
    steps = ["trainer.total_steps=3"]
    sync = run_on_ranks(_run, 2, ["trainer.nproc=2", *steps], str(tmp_path / "sync"))[0][0]
    k0 = run_on_ranks(_run, 4, ["trainer.nproc=4", "trainer.mode=async", "trainer.max_staleness=0", *steps],
                      str(tmp_path / "k0"))[0][0]
    assert_async_k0_equals_sync(sync, k0, 3)


@pytest.mark.multirank
@pytest.mark.slow
def test_async_k2_partial_rollouts_staleness_and_versions(tmp_path):
    from hyflow.testing.nccl_rules import first_op_problems

    ranks = run_on_ranks(_run, 4, ["trainer.nproc=4", "trainer.mode=async", "trainer.max_staleness=2",
                                   "trainer.update_after_tokens=2", "trainer.total_steps=4"], str(tmp_path / "k2"))
    assert first_op_problems([first for _, first in ranks]) == []
    hist = ranks[0][0]
    assert [m["fully_async/staleness/max"] for m in hist] == [0.0, 1.0, 2.0, 2.0]
    assert [m["staleness"] for m in hist] == [0.0, 1.0, 2.0, 2.0]
    # steps 1-3: sampled with w_0 throughout; 4: w_1, then w_2 two decode steps after it was due
    assert [m["fully_async/partial/max_partial_span"] for m in hist] == [0.0, 0.0, 0.0, 1.0]
    assert hist[2]["fully_async/partial/total_partial_num"] == 0.0
    assert hist[3]["fully_async/partial/total_partial_num"] > 0
    assert all(m["fully_async/count/dropped_stale_samples"] == 0 for m in hist)  # nothing over the bound
    assert hist[2]["fully_async/staleness_hist/2"] > 0
    assert hist[0]["fully_async/count/stale_samples_processed"] == 0 and hist[1]["fully_async/count/stale_samples_processed"] == 32
    for m in hist:
        assert sum(m[f"fully_async/staleness_hist/{j}"] for j in range(3)) == pytest.approx(1.0)
        assert 0.0 < m["perf/gen_pool_utilization"] <= 1.0 and 0.0 < m["perf/train_pool_utilization"] <= 1.0
    assert hist[2]["rollout_corr/rollout_is_max"] != pytest.approx(1.0, abs=1e-4)  # the correction is at work


@pytest.mark.multirank
@pytest.mark.slow
def test_async_k1_between_batches_is_one_step_off(tmp_path):
    steps = ["trainer.nproc=4", "trainer.total_steps=3"]
    off = run_on_ranks(_run, 4, [*steps, "trainer.mode=one_step_off"], str(tmp_path / "off"))[0][0]
    k1 = run_on_ranks(_run, 4, [*steps, "trainer.mode=async", "trainer.max_staleness=1",
                                "trainer.update_after_tokens=0"], str(tmp_path / "k1"))[0][0]
    assert [m["staleness"] for m in k1] == [m["staleness"] for m in off] == [0.0, 1.0, 1.0]
    for a, b in zip(off, k1):
        for key in (*ASYNC_COMPARED, "rollout_corr/rollout_is_max", "rollout_corr/kl"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("override, key", [
    (["algorithm.dynamic_sampling.enable=true", "reward.model_checkpoint=rm"],
     "'reward.model_checkpoint': trainer.mode=async with algorithm.dynamic_sampling scores each group on the "
     "generation pool, where no reward model runs"),
    (["algorithm.dynamic_sampling.enable=true", "reward.kind=model", "reward.model_checkpoint=rm"],
     "'reward.model_checkpoint'"),
    (["algorithm.dynamic_sampling.enable=true", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"],
     "'rollout.multi_turn.enable': trainer.mode=async with algorithm.dynamic_sampling"),
    (["trainer.max_staleness=-1"], "max_staleness"),
    (["trainer.update_after_tokens=-1"], "update_after_tokens"),
])
def test_async_refuses_what_it_does_not_run(override, key):
    from hyflow.config import ConfigError
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import QUICKSTART

    with pytest.raises(ConfigError) as e:
        load_job_config(QUICKSTART, ["trainer.mode=async", "trainer.nproc=4", *override])
    assert key in str(e.value) and "\n" not in str(e.value)


def test_async_runs_dynamic_sampling_with_a_rule_reward():
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import QUICKSTART

    cfg = load_job_config(QUICKSTART, ["trainer.mode=async", "trainer.nproc=4", "algorithm.dynamic_sampling.enable=true"])
    assert cfg.algorithm.dynamic_sampling.enable and cfg.reward.kind == "rule"


def test_async_forces_a_rollout_correction_when_stale():
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import QUICKSTART

    stale = load_job_config(QUICKSTART, ["trainer.mode=async", "trainer.nproc=4", "trainer.max_staleness=2"])
    assert stale.actor.rollout_correction.mode == "token_tis"
    fresh = load_job_config(QUICKSTART, ["trainer.mode=async", "trainer.nproc=4", "trainer.max_staleness=0"])
    assert fresh.actor.rollout_correction.mode == "off"


def _run_dropping(overrides, out, config):
    """:func:`_run` with batches formed in deadline order but never waiting for a running group (the
    deadline rule places every group under the admission bound: this makes the late ones miss it)."""
    from hyflow.jobs.fully_async import AsyncGeneration

    waits, AsyncGeneration._must_wait = AsyncGeneration._must_wait, lambda self, t: False
    try:
        return _run(overrides, out, config)
    finally:  # the worker processes are pooled: later tests get the rule back
        AsyncGeneration._must_wait = waits


@pytest.mark.multirank
@pytest.mark.slow
def test_async_dropped_samples_reach_the_metrics_exactly(tmp_path):
    """Long-tail lengths (configs/async_length_tail.yaml: "write N", N long-tailed, after its 30 SFT
    warm-up steps) with k=1 and batches that do not wait for late groups: some groups finish
    too stale and are dropped. Each step's ``fully_async/count/dropped_stale_samples`` (the training side,
    from the rows' headers) sums to exactly what the generation replicas counted (their in-flight files
    at the last save: dropped groups x n), and every step still trains on a full batch."""
    import torch

    from hyflow.checkpoint.discovery import step_dir_name
    from hyflow.placement.inflight import inflight_file

    out = str(tmp_path / "drop")
    hist = run_on_ranks(_run_dropping, 4, ["trainer.nproc=4", "trainer.mode=async", "trainer.max_staleness=1",
                                  "trainer.update_after_tokens=2", "trainer.total_steps=6", "trainer.save_every=6",
                                  "actor.sft_warmup_steps=30"], out,
                       os.path.join(REPO, "configs", "async_length_tail.yaml"))[0][0]
    dropped = [m["fully_async/count/dropped_stale_samples"] for m in hist]
    counted = sum(torch.load(inflight_file(f"{out}/checkpoints/{step_dir_name(6)}", rank),
                             weights_only=True)["counters"]["dropped"] for rank in (2, 3))
    assert sum(dropped) == counted * 4 > 0  # rollout.n = 4 samples per dropped group
    assert all(m["fully_async/staleness/max"] <= 1 for m in hist)
    assert all(m["response_length/mean"] > 0 for m in hist) and len(hist) == 6
