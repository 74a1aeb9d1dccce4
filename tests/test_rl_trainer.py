"""End-to-end RL steps on 2 ranks (TP=2 training, TP=1 generation with 2 micro-DP
replicas) asserting learning signal, not just completion:

* every update raised the advantage-weighted log-probs of its batch, sum A_t (log p_new - log p_old);
* GRPO (one advantage per response): responses with positive advantage became more likely and
  responses with negative advantage less likely;
* PPO with a critic and GAE: the critic's value loss on the step's batch fell.
"""

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = [
    "trainer.nproc=2", "actor.layout.tp=2", "rollout.layout.tp=1", "data.task=digit_add",
    "data.task_size=400", "data.train_batch_size=16", "rollout.n=4", "actor.micro_batch_size=16",
    "actor.mini_batch_size=32", "actor.sft_warmup_steps=40", "actor.sft_lr=3e-3", "actor.optim.lr=1e-3",
    "rollout.max_new_tokens=4",
]


def _signal(overrides):
    import torch.distributed as dist

    import hyflow.jobs.rl as rl
    from hyflow.algorithms import value_token_loss
    from hyflow.testing.references import aggregate_loss
    from hyflow.rl.step_losses import logprob_scorer, value_scorer
    from hyflow.roles import Critic, Rollouts, WeightPath
    from hyflow.testing.rl import rl_setup, rl_step, score_rows

    cfg, state, job = rl_setup(BASE + ["data.seed=3"] + overrides)
    models = state.models
    # the colocated roles, built for real, are what their protocols declare (hyflow.roles)
    assert isinstance(models.weights, WeightPath) and isinstance(models.rollouts, Rollouts)
    assert models.critic is None or (isinstance(models.critic, Critic) and models.critic.model is not None)
    rl.sft_warmup(cfg, state, job.tokenizer)
    pos, neg, surrogate, value_before, value_after, metrics = [], [], [], [], [], []
    for _ in range(3):
        m, data = rl_step(cfg, state, job)
        metrics.append(m)
        new = score_rows(models.actor.chunks, models.groups, data["tokens"],
                         logprob_scorer(models.sample_vocab, models.groups.pgs.tp))
        mask = data["response_mask"]
        change = ((new - data["old_logp"]) * mask).sum(-1)
        adv = (data["advantages"] * mask).sum(-1)
        pos.append(change[adv > 0])
        neg.append(change[adv < 0])
        # first-order change of the policy-gradient objective: sum of A_t * (log p_new - log p_old)
        surrogate.append(float((data["advantages"] * (new - data["old_logp"]) * mask).sum()))
        if models.critic is not None:
            values = score_rows(models.critic.model.chunks, models.groups, data["tokens"], value_scorer())
            loss = lambda v, data=data, mask=mask: aggregate_loss(value_token_loss(v, data["values"], data["returns"], mask)[0],  # noqa: E731
                                            mask).item()
            value_before.append(loss(data["values"]))
            value_after.append(loss(values))
    if dist.get_rank() != 0:
        return None
    return torch.cat(pos), torch.cat(neg), surrogate, value_before, value_after, metrics


REQUIRED = ("critic/score/mean", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm",
            "response_length/mean", "rollout/tokens_per_s", "perf/padding_ratio")


@pytest.mark.parametrize("overrides", [
    ["algorithm.adv_estimator=grpo"],
    ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.optim.lr=5e-4", "rollout.n=2",
     "actor.mini_batch_size=16"],
], ids=["grpo", "ppo-gae-critic"])
def test_update_moves_probability_towards_positive_advantages(overrides):
    pos, neg, surrogate, before, after, metrics = run_on_ranks(_signal, 2, overrides, timeout=600)[0]
    assert all(s > 0 for s in surrogate), surrogate  # every update raised the advantage-weighted log-probs
    if "algorithm.adv_estimator=grpo" in overrides:  # one advantage per response: its sign says all
        assert len(pos) >= 2 and len(neg) >= 2
        assert pos.mean() > 0, pos
        assert neg.mean() < 0, neg
    for m in metrics:
        for key in REQUIRED:
            assert key in m and m[key] == m[key], key  # present and not NaN
    if before:
        assert all(a < b for a, b in zip(after, before)), (before, after)


def _step_metrics(overrides):
    from hyflow.testing.rl import rl_setup, rl_step

    cfg, state, job = rl_setup(BASE + ["data.seed=3"] + overrides)
    return rl_step(cfg, state, job)[0]


def test_metrics_cover_all_data_parallel_ranks():
    """With DP=2 each rank generates, scores and trains on its half of the prompts; the step's
    metrics describe the whole batch, hence are identical on the two ranks."""
    a, b = run_on_ranks(_step_metrics, 2, ["actor.layout.tp=1", "actor.sft_warmup_steps=0",
                                           "rollout.temperature=1.5"], timeout=600)
    for key in ("actor/pg_clipfrac", "actor/entropy", "actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
        if key in a:
            assert a[key] == b[key], (key, a[key], b[key])
    assert a["actor/entropy"] > 0
