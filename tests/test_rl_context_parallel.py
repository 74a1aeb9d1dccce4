"""The RL job at context parallelism: each CP rank holds 1/CP of every sequence in scoring and update.

Two GRPO steps (KL loss to the reference, entropy bonus, old log-probs recomputed by the training
layout, sequence packing with a token budget) on the quickstart's tiny Llama give the same
per-step metrics, old / reference log-probs and weight updates at CP=2 (with full
recompute, on 2 ranks) and at CP=2 x TP=2 (4 ranks) as at CP=1 on one rank (<= 1e-5 relative;
a few differences of nearly equal log-probs at 1e-4); so does PPO with a critic (values scored and
trained under CP; slow). The hybrid engine reshards the CP layout to
the generation layout (no CP) around the step, so generation sees the same weights and samples.
Adam runs with a large epsilon: its step is then nearly linear in the gradient, so the weight
updates compare at gradient precision (at eps=1e-8 the sign of a near-zero gradient decides a
whole learning-rate step).
"""

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = os.path.join(REPO, "tests", "data", "digit_share_reward.py")
BASE = [
    "data.task=digit_add", "data.task_size=200", "data.train_batch_size=8", "rollout.n=4",
    "rollout.max_new_tokens=5", "rollout.temperature=1.2", "actor.micro_batch_size=4", "actor.mini_batch_size=16",
    "actor.ppo_epochs=2", "actor.optim.lr=2e-2", "actor.optim.adam_eps=0.1", "actor.sft_warmup_steps=0", "reward.kind=function",
    f"reward.function_path={REWARD}", "trainer.seed=5", "algorithm.adv_estimator=grpo",
    "actor.old_logprobs=recompute", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.entropy_coeff=0.01",
    "actor.pack_sequences=true", "actor.max_tokens_per_micro_batch=48",
]
GAE = ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.optim.lr=1e-3", "critic.micro_batch_size=3"]
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/kl_loss",
        "critic/advantages/max")  # perf/padding_ratio differs: CP pads rows to 2 cp tokens
#: differences of nearly equal log-probs: rounding is amplified by the cancellation
LOOSE = ("actor/ppo_kl", "actor/pg_clipfrac")
STEPS = 2


def _steps(overrides):
    """Per-step metrics, old / reference log-probs and the updates of the actor's full weights."""
    import torch.distributed as dist

    from hyflow.models.weights import gather_full_state_dict
    from hyflow.testing.rl import rl_setup, rl_step

    cfg, state, job = rl_setup(BASE + [f"trainer.nproc={dist.get_world_size()}", "data.seed=3"] + overrides)
    models = state.models
    initial = gather_full_state_dict(models.actor.chunks[0], models.desc, models.groups)
    metrics, logps = [], []
    for _ in range(STEPS):
        m, data = rl_step(cfg, state, job)
        metrics.append(m)
        logps.append({k: data[k].clone() for k in ("old_logp", "ref_logp", "response_mask", "tokens")})
    final = gather_full_state_dict(models.actor.chunks[0], models.desc, models.groups)
    return metrics, logps, {name: final[name] - initial[name] for name in final}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _compare(want, got, name, keys=KEYS, weight_tol=1e-5):
    (m1, lp1, w1), (m2, lp2, w2) = want, got
    for step, (a, b) in enumerate(zip(m1, m2)):
        for key in keys + LOOSE:
            assert key in a and key in b, key
            rel = 1e-4 if key in LOOSE else 1e-5
            assert abs(a[key] - b[key]) <= rel * max(abs(a[key]), abs(b[key]), 1e-6), (name, step + 1, key, a[key], b[key])
        # the sampler's and the training layout's log-probs of the same weights: rounding apart in both
        assert a["rollout/logprob_diff_max"] < 1e-4 and b["rollout/logprob_diff_max"] < 1e-4
    for step, (a, b) in enumerate(zip(lp1, lp2)):
        assert torch.equal(a["tokens"], b["tokens"]), (name, step)  # same weights generated the same samples
        mask = a["response_mask"] > 0
        for key in ("old_logp", "ref_logp"):
            assert _rel(b[key][mask], a[key][mask]) <= 1e-5, (name, step + 1, key)
    assert set(w1) == set(w2) and all(w1[n].abs().max() > 0 for n in w1)  # every weight was updated
    errors = {n: _rel(w2[n], w1[n]) for n in w1}  # the updates, relative to their own size
    assert max(errors.values()) <= weight_tol, (name, max(errors.items(), key=lambda kv: kv[1]))


@pytest.fixture(scope="module")
def cp1():
    return run_on_ranks(_steps, 1, ["actor.layout.tp=1"], timeout=900)[0]


def test_rl_step_at_cp2_with_recompute_and_packing_equals_cp1(cp1):
    got = run_on_ranks(_steps, 2, ["actor.layout.tp=1", "actor.layout.cp=2", "actor.recompute=full"], timeout=900)
    _compare(cp1, got[0], "cp2")
    _compare(cp1, got[1], "cp2 rank 1")
    metrics = cp1[0]
    assert metrics[0]["critic/score/std"] > 0 and metrics[-1]["actor/kl_loss"] > 0  # not constants


@pytest.mark.slow
def test_rl_step_at_cp2_tp2_equals_cp1(cp1):
    got = run_on_ranks(_steps, 4, ["actor.layout.tp=2", "actor.layout.cp=2"], timeout=1200)
    _compare(cp1, got[0], "cp2 x tp2")


@pytest.mark.slow
def test_ppo_with_a_critic_at_cp2_equals_cp1():
    """Values (scored label-aligned, gathered and shifted back) and the critic's update under CP."""
    keys = KEYS + ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "critic/values/mean")
    want = run_on_ranks(_steps, 1, ["actor.layout.tp=1"] + GAE, timeout=900)[0]
    got = run_on_ranks(_steps, 2, ["actor.layout.tp=1", "actor.layout.cp=2"] + GAE, timeout=900)
    # metrics and log-probs within 1e-5; the final norm's update within 1.2e-5 (its gradient sums
    # every token's, in another order at CP=2, and the critic's advantages feed the actor's loss)
    _compare(want, got[0], "gae cp2", keys, weight_tol=3e-5)
