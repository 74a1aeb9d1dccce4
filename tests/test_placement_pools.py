"""Placement pools in ``trainer.mode: sync``, with the critic on a pool of its own and layout.

4 gloo ranks: the actor trains at TP=2 on ranks 0-1, generation (TP_g=1) on rank 2, the critic
(TP=1) on rank 3. PPO+GAE in sync mode samples every batch with the weights of the last update
(staleness 0), so each step's metrics equal the colocated run's (the actor and the critic at TP=2
on 2 ranks, same seeds) up to the rounding of the critic's other TP: every numeric metric but
timings, communication, memory and CPU seconds, for 3 steps, to 1e-5 relative (the sampler / trainer
log-prob differences, rounding noise themselves, to 1e-5 of the log-probs: see ``ROUNDING``).
"""

import math

import pytest

from hyflow.testing import run_on_ranks

SMALL = ["data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
         "actor.sft_warmup_steps=2", "trainer.total_steps=3", "trainer.loggers=[]",
         "algorithm.adv_estimator=gae", "critic.enable=true"]
POOLS = ["trainer.nproc=4", "placement.pools={train: [0, 2], gen: [2, 3], critic: [3, 4]}", "placement.actor=train",
         "placement.rollout=gen", "placement.critic=critic", "critic.layout={tp: 1, pp: 1}"]
#: the critic over 2 DP ranks, the actor on 1: the training rank's rows split between two critic
#: ranks and their values come back from both (colocated reference: 1 rank)
WIDER_CRITIC = ["trainer.nproc=4", "actor.layout.tp=1", "placement.pools={train: [0, 1], gen: [1, 2], critic: [2, 4]}",
                "placement.actor=train", "placement.rollout=gen", "placement.critic=critic"]
#: metrics of the machine and the transport, not of the learning (and the pooled run's own keys);
#: padding depends on how each DP rank groups its own rows into micro-batches
NOT_COMPARED = ("timing_s/", "comm/", "memory/", "cpu_s", "reshard/", "weight_sync/", "data_plane/",
                "perf/time_per_step", "perf/throughput", "perf/max_rss_gb", "perf/max_memory_", "perf/overlap_ratio",
                "perf/padding_ratio", "rollout/tokens_per_s")

#: differences of the sampler's and the trainer's log-probs of one token: float32 rounding (~1e-7 of
#: log-probs of magnitude ~1), measured by the colocated run's 2 generation replicas and the generation
#: pool's 1 (other batch shapes, other rounding); compared to 1e-5 of the log-probs they differ by
ROUNDING = ("rollout/logprob_diff", "rollout_corr/seq_log_ratio", "rollout_corr/kl", "rollout_corr/k3_kl")
#: a token mean of (ratio x whitened advantage) terms of magnitude ~1 that cancel to ~1e-2: its
#: rounding is absolute, ~1e-7 of the terms (the critic's two layouts sum in another order), so
#: it is compared to 1e-6 absolute as well as 1e-5 relative
CANCELLING = ("actor/pg_loss",)


def _run(overrides, out):
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner, load_job_config
    from hyflow.testing.rl import QUICKSTART

    from hyflow.testing.nccl_rules import FirstOps

    cfg = load_job_config(QUICKSTART, [*SMALL, f"trainer.output_dir={out}", *overrides])
    with FirstOps() as ops:
        history = job_runner("rl")(cfg)  # as `hyflow train` runs it: pools go to the pooled loops
    return history if dist.get_rank() == 0 else None, ops.first


def test_pooled_sync_resolves_with_the_critic_apart():
    from hyflow.jobs.registry import load_job_config
    from hyflow.placement.remote_critic import _replies, _routes
    from hyflow.testing.rl import QUICKSTART

    cfg = load_job_config(QUICKSTART, [*SMALL, *POOLS])
    p = cfg.resolved_placement()
    assert cfg.actor.rollout_correction.mode == "off"  # sync: nothing to correct
    assert (p.roles["critic"].layout.tp, p.roles["critic"].layout.dp) == (1, 1)
    assert p.roles["actor"].layout.tp == 2 and p.roles["reference"].pool.name == "train"
    # the training DP lead sends the rows to the critic rank; the critic answers both TP ranks
    assert [(r.src, r.dst, r.first, r.stop) for r in _routes(cfg, p)] == [(0, 3, 0, 8)]
    assert [(r.src, r.dst, r.first, r.stop) for r in _replies(cfg, p)] == [(3, 0, 0, 8), (3, 1, 0, 8)]
    # one training rank, two critic DP ranks: each gets the half of the rows it owns, and answers
    cfg = load_job_config(QUICKSTART, [*SMALL, *WIDER_CRITIC])
    p = cfg.resolved_placement()
    assert [(r.src, r.dst, r.first, r.stop) for r in _routes(cfg, p)] == [(0, 2, 0, 4), (0, 3, 4, 8)]
    assert [(r.src, r.dst, r.first, r.stop) for r in _replies(cfg, p)] == [(2, 0, 0, 4), (3, 0, 4, 8)]


@pytest.mark.parametrize("extra, key", [
    (["trainer.save_every=5"], "trainer.save_every"),
    (["trainer.resume=/some/checkpoint"], "trainer.resume"),
    (["algorithm.adv_estimator=remax", "critic.enable=false", "placement.critic=null",
      "placement.pools={train: [0, 2], gen: [2, 4]}"], "algorithm.adv_estimator"),
])
def test_pooled_runs_refuse_what_they_cannot_do(extra, key):
    from hyflow.config import ConfigError
    from hyflow.jobs.rl_preflight import check_pooled_supported as check_supported
    from hyflow.jobs.registry import load_job_config
    from hyflow.jobs.rl_preflight import check_role_capabilities
    from hyflow.testing.rl import QUICKSTART

    cfg = load_job_config(QUICKSTART, [*SMALL, *POOLS, *extra])
    with pytest.raises(ConfigError) as e:  # what pools cannot do yet, or what their roles do not declare
        check_supported(cfg)
        check_role_capabilities(cfg)
    assert e.value.key == key


@pytest.mark.multirank
@pytest.mark.parametrize("ranks, colocated_overrides, pooled_overrides", [
    (2, ["trainer.nproc=2"], POOLS),
    (1, ["trainer.nproc=1", "actor.layout.tp=1"], WIDER_CRITIC),
], ids=["critic-tp1", "critic-dp2"])
def test_critic_on_its_own_pool_equals_colocated_sync(tmp_path, ranks, colocated_overrides, pooled_overrides):
    from hyflow.testing.nccl_rules import first_op_problems

    colocated = run_on_ranks(_run, ranks, colocated_overrides, str(tmp_path / "colocated"))[0][0]
    results = run_on_ranks(_run, 4, pooled_overrides, str(tmp_path / "pooled"))
    # NCCL's first-operation rule on every group (critic-tp1: a training pool of 2 ranks)
    assert first_op_problems([first for _, first in results]) == []
    pooled = results[0][0]
    assert len(pooled) == len(colocated) == 3
    compared, wrong = 0, []
    for step, (a, b) in enumerate(zip(colocated, pooled), start=1):
        assert b["staleness"] == 0.0
        for key, want in a.items():
            if key.startswith(NOT_COMPARED) or not isinstance(want, (int, float)) or isinstance(want, bool):
                continue
            got = b.get(key)
            floor = 1e-5 if key.startswith(ROUNDING) else 1e-6 if key.startswith(CANCELLING) else 1e-7
            same = got is not None and (math.isnan(got) if math.isnan(want) else
                                        math.isclose(want, got, rel_tol=1e-5, abs_tol=floor))
            if not same:
                wrong.append((step, key, want, got))
            compared += 1
    assert not wrong, wrong
    assert compared > 3 * 40  # the critic's values / returns / losses and the actor's among them
    for key in ("critic/vf_loss", "critic/values/mean", "critic/returns/mean", "critic/grad_norm"):
        assert all(key in m for m in pooled), key
    assert pooled[2]["critic/vf_loss"] != pooled[0]["critic/vf_loss"]  # the critic trained


def test_a_mixture_of_experts_actor_on_pools_is_refused_before_launch():
    from hyflow.config import ConfigError
    from hyflow.jobs.registry import load_job_config
    from hyflow.jobs.rl_preflight import check_pooled_supported
    from hyflow.testing.rl import QUICKSTART

    moe = QUICKSTART.replace("quickstart.yaml", "moe_quickstart.yaml")
    colocated = load_job_config(moe, ["trainer.nproc=4"])
    check_pooled_supported(colocated)  # colocated sync: runs
    cfg = load_job_config(moe, ["trainer.nproc=4", "trainer.mode=one_step_off", "actor.layout.tp=1"])
    with pytest.raises(ConfigError, match="mixture-of-experts actor runs colocated") as e:
        check_pooled_supported(cfg)
    assert e.value.key == "trainer.mode"
