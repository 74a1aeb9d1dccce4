"""``placement:`` resolution and its config-time errors (no process group)."""

import pytest

from hyflow.jobs.registry import load_job_config
from hyflow.config import ConfigError
from hyflow.testing.rl import QUICKSTART

GAE = ["trainer.nproc=4", "algorithm.adv_estimator=gae", "critic.enable=true"]
POOLS = ["placement.pools={train: [0, 2], gen: [2, 3], critic: [3, 4]}", "placement.actor=train",
         "placement.rollout=gen", "placement.critic=critic", "placement.reference=critic",
         "critic.layout={tp: 1, pp: 1}", "reference.layout={tp: 1, pp: 1}"]


def _load(*overrides):
    return load_job_config(QUICKSTART, list(overrides))


def test_default_is_colocated_and_one_step_off_splits_in_half():
    assert _load().resolved_placement().colocated
    p = _load("trainer.nproc=4", "trainer.mode=one_step_off").resolved_placement()
    assert not p.colocated
    assert [(q.name, q.start, q.stop) for q in p.pools] == [("train", 0, 2), ("gen", 2, 4)]
    assert p.roles["actor"].layout.dp == 1 and p.roles["rollout"].layout.dp == 2
    assert p.roles_on(0) == ["actor", "reference"] and p.roles_on(3) == ["rollout"]


def test_roles_in_their_own_layouts():
    cfg = _load(*GAE, *POOLS)
    p = cfg.resolved_placement()
    assert (p.roles["critic"].layout.tp, p.roles["critic"].layout.dp) == (1, 1)
    assert p.roles["critic"].pool.name == "critic" and p.roles["reference"].pool.name == "critic"
    assert cfg.actor_layout().dp == 1  # the actor's dp fills its pool, not the world
    assert p.roles["actor"].layout.rank_of(tp=1) == 1 and p.roles["critic"].layout.rank_of() == 3
    # a pool's layout starts at the pool's first rank: the one layout type reads global ranks
    critic = p.roles["critic"].layout
    assert critic.start == 3 and list(critic.ranks) == [3] and critic.coords(3)["dp"] == 0
    assert p.roles["critic"].layout.groups("dp") == [[3]]


def test_a_configured_layout_start_is_refused():
    with pytest.raises(ConfigError, match="layout.start=1: the placement sets where"):
        _load(*GAE, *POOLS, "critic.layout.start=1").resolved_placement()
    with pytest.raises(ConfigError, match="layout.start=2: a layout over the whole world starts at rank 0"):
        _load("actor.layout.start=2").validate()


@pytest.mark.parametrize("overrides,message", [
    (["placement.pools={train: [0, 2], gen: [1, 4]}"], "'train' \\[0, 2\\) and 'gen' \\[1, 4\\) overlap on rank 1"),
    (["placement.pools={train: [0, 2], gen: [2, 3]}"], "rank 3 belongs to no pool"),
    (["placement.pools={train: [0, 2], gen: [2, 6]}"], "ends beyond the 4 ranks"),
    (["placement.pools={train: [0, 3], gen: [3, 4]}"], "pool 'train' of 3 ranks, which its layout tp=2"),
    (["placement.pools={train: [0, 2], gen: [2, 4]}", "placement.rollout=train"], "is the actor's pool"),
    (["placement.pools={train: [0, 2], gen: [2, 4]}", "placement.rollout=gne"], "pool 'gne' is not defined"),
    (["placement.pools={train: [0, 2], gen: [2, 3], x: [3, 4]}"], "pool 'x' runs no role"),
    (["placement.pools={train: [0, 2], gen: [2, 4]}", "placement.critic=gen"], "is the generation pool"),
    (["placement.pools={train: [0, 2], gen: [2, 4]}", "critic.layout={tp: 1}"],
     "critic shares pool 'train' with the actor but has another layout"),
    (["critic.layout={tp: 1}"], "colocated roles share the actor's training layout"),
    (["placement.actor=train"], "placement.pools is empty"),
])
def test_errors_name_the_problem(overrides, message):
    base = [o for o in ["placement.actor=train", "placement.rollout=gen"]
            if not any(x.split("=")[0] == o.split("=")[0] for x in overrides)]
    if not any(o.startswith("placement.pools") for o in overrides):
        base = []
    with pytest.raises(ConfigError, match=message):
        _load(*GAE, *base, *overrides)


def test_unknown_role_is_named():
    with pytest.raises(ConfigError, match="unknown config key 'placement.critc'"):
        _load(*GAE, "placement.critc=gen")


def test_one_step_off_needs_an_even_world_and_recomputed_old_logprobs():
    with pytest.raises(ConfigError, match="trainer.nproc=3 must be even"):
        _load("trainer.nproc=3", "actor.layout.tp=1", "trainer.mode=one_step_off")
    with pytest.raises(ConfigError, match="actor.old_logprobs=recompute"):
        _load("trainer.nproc=4", "trainer.mode=one_step_off", "actor.old_logprobs=rollout")


def test_batch_must_split_over_each_roles_dp():
    with pytest.raises(ConfigError, match="over the critic's 2 data-parallel ranks"):
        _load(*GAE, "placement.pools={train: [0, 2], gen: [2, 3], critic: [3, 5]}", "trainer.nproc=5",
              "placement.actor=train", "placement.rollout=gen", "placement.critic=critic",
              "critic.layout={tp: 1}", "data.train_batch_size=33", "actor.mini_batch_size=33")


@pytest.mark.parametrize("overrides,message", [
    (["trainer.mode=one_step_off", "placement.pools={gen: [0, 2], train: [2, 4]}", "placement.actor=train",
      "placement.rollout=gen"], "need the actor's pool to start at rank 0"),
    (["placement.pools={train: [0, 2], gen: [2, 3], ref: [3, 4]}", "placement.actor=train", "placement.rollout=gen",
      "placement.reference=ref", "reference.layout={tp: 1}"], "run the reference on the actor's pool for now"),
    (["placement.pools={train: [0, 2], gen: [2, 3], critic: [3, 4]}", "placement.actor=train", "placement.rollout=gen",
      "placement.critic=critic", "critic.enable=true", "algorithm.adv_estimator=gae", "critic.layout={tp: 1}",
      "trainer.save_every=5"], "is not checkpointed yet"),
    (["trainer.mode=one_step_off", "algorithm.adv_estimator=remax"], "ReMax's greedy baselines"),
])
def test_what_one_step_off_does_not_run_yet_is_named_before_launch(overrides, message, tmp_path):
    from hyflow.jobs.rl_preflight import preflight

    with pytest.raises(ConfigError, match=message):  # a run directory of its own: never the tree's runs/
        preflight(_load("trainer.nproc=4", *overrides, f"trainer.output_dir={tmp_path}"))


def test_pools_in_sync_mode_pass_the_preflight(tmp_path):
    from hyflow.jobs.rl_preflight import preflight

    # its own run directory: runs/quickstart may hold `make train`'s finished run (issue #39 point 9)
    cfg = _load("trainer.nproc=4", *GAE, "placement.pools={train: [0, 2], gen: [2, 3], critic: [3, 4]}",
                "placement.actor=train", "placement.rollout=gen", "placement.critic=critic", "critic.layout={tp: 1}",
                f"trainer.output_dir={tmp_path}")
    preflight(cfg)  # sync on pools, the critic on a pool of its own: runs (tests/test_placement_pools.py)
    assert cfg.trainer.mode == "sync" and cfg.actor.rollout_correction.mode == "off"


def test_one_step_off_adopts_token_tis():
    cfg = _load("trainer.nproc=4", "trainer.mode=one_step_off")
    assert cfg.actor.rollout_correction.mode == "token_tis"
    assert any("token_tis" in n for n in cfg.notes)
    assert _load("trainer.nproc=4").actor.rollout_correction.mode == "off"  # sync unchanged
