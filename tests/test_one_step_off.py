"""``trainer.mode: one_step_off``: rows to their owners, and the run itself on 4 gloo ranks.

* the row routes (pure): every training rank receives exactly the prompts its DP rank owns, from
  the replicas that generated them, nothing else;
* the run (training TP=2 on ranks 0-1, generation TP_g=1 x 2 on ranks 2-3): step 1 is sampled with
  the initial weights (staleness 0), so its metrics equal a ``sync`` run's step 1 on 2 ranks
  (seeds are keyed by step and prompt); step 2 was sampled one update behind (staleness 1) and
  the token-level TIS weights are no longer all 1. Both runs use the distributed optimizer, whose
  gradient norm (and clipping) must cover the training pool's TP ranks as the colocated run's does;
* NCCL's first-operation rule on every group of the pooled run (:mod:`hyflow.testing.nccl_rules`):
  a training pool of 2 ranks, whose lead alone sends the control messages.
"""

import math

import pytest

from hyflow.testing import run_on_ranks

SMALL = ["data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
         "actor.sft_warmup_steps=2", "trainer.total_steps=2", "trainer.loggers=[]"]


def _placement(*overrides):
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import QUICKSTART

    return load_job_config(QUICKSTART, ["trainer.mode=one_step_off", *overrides]).resolved_placement()


@pytest.mark.parametrize("overrides", [
    ["trainer.nproc=4"],  # TP=2 DP=1 <- 2 replicas
    ["trainer.nproc=4", "actor.layout.tp=1"],  # DP=2 <- 2 replicas
    ["trainer.nproc=8", "actor.layout.tp=1", "rollout.layout.tp=2"],  # DP=4 <- 2 replicas of TP_g=2
    ["trainer.nproc=6", "placement.pools={train: [0, 4], gen: [4, 6]}", "placement.actor=train",
     "placement.rollout=gen"],  # TP=2 DP=2 <- 2 replicas
])
def test_rows_go_to_the_ranks_that_own_them(overrides):
    from hyflow.placement.rows import row_routes
    from hyflow.rl.dispatch import shard_range

    p = _placement(*overrides)
    actor, gen = p.roles["actor"], p.roles["rollout"]
    prompts = 32
    routes = row_routes(prompts, gen, actor)
    for rank in actor.pool.ranks:
        dp = actor.layout.coords(rank)["dp"]
        got = sorted(i for r in routes if r.dst == rank for i in range(r.first, r.stop))
        assert got == list(range(*shard_range(prompts, actor.layout.dp, dp))), rank  # its shard, once
    senders = {r.src for r in routes}
    assert senders == {gen.layout.rank_of(dp=j) for j in range(gen.layout.dp)}  # one rank per replica sends
    for r in routes:  # a replica sends only prompts it generated
        j = gen.layout.coords(r.src)["dp"]
        a, b = shard_range(prompts, gen.layout.dp, j)
        assert a <= r.first < r.stop <= b
    assert all(r.dst in actor.pool for r in routes)


def _run(overrides, out):
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner, load_job_config
    from hyflow.testing.nccl_rules import FirstOps
    from hyflow.testing.rl import QUICKSTART

    cfg = load_job_config(QUICKSTART, [*SMALL, f"trainer.output_dir={out}", *overrides])
    with FirstOps() as ops:
        history = job_runner("rl")(cfg)  # the RL job in its trainer.mode, as `hyflow train` runs it
    return history if dist.get_rank() == 0 else None, ops.first


COMPARED = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac",
            "response_length/mean", "critic/score/mean", "critic/advantages/mean", "critic/advantages/max")


#: the distributed optimizer, and an entropy bonus so that step 1's gradient is not zero (every
#: reward of the warmed-up tiny model is equal: GRPO's advantages are 0)
DIST_OPT = ["actor.optim.distributed_optimizer=true", "actor.entropy_coeff=0.01"]


@pytest.mark.multirank
def test_one_step_off_step_one_equals_sync_then_corrects(tmp_path):
    from hyflow.testing.nccl_rules import first_op_problems

    sync = run_on_ranks(_run, 2, ["trainer.nproc=2", *DIST_OPT], str(tmp_path / "sync"))[0][0]
    ranks = run_on_ranks(_run, 4, ["trainer.nproc=4", "trainer.mode=one_step_off", *DIST_OPT], str(tmp_path / "off"))
    # every group's communicator could be created on NCCL (a hang there, before the fix)
    assert first_op_problems([first for _, first in ranks]) == []
    off = ranks[0][0]
    assert len(off) == 2
    # the distributed optimizer's gradient norm covers both TP ranks (not only this rank's shard)
    assert sync[0]["actor/grad_norm"] > 0
    assert off[0]["actor/grad_norm"] == pytest.approx(sync[0]["actor/grad_norm"], rel=1e-5)
    first, second = off
    for key in COMPARED:
        a, b = sync[0][key], first[key]
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), (key, a, b)
    assert first["staleness"] == 0.0 and second["staleness"] == 1.0
    # step 1: the sampler held the trainer's weights (every IS weight 1); step 2: one update behind
    assert first["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-5)
    assert second["rollout_corr/kl"] != 0.0 and second["rollout_corr/rollout_is_max"] != pytest.approx(1.0, abs=1e-4)
    assert 0.0 <= second["rollout_corr/rollout_is_ratio_fraction_high"] <= 1.0
    # the weight sync sent the actor's shards once per update, the rows arrived at their owner
    assert first["weight_sync/bytes_sent"] > 0 and first["data_plane/bytes_received"] > 0
