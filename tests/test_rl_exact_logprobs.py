"""Exact mode and a forced stale policy, end to end on the tiny quickstart model.

* ``rollout.exact_logprobs``: the log-probs the generator reports equal the training-layout
  forward's bit for bit (``rollout/logprob_diff_max == 0.0``) at PP=2 -> PP_g=1 (fp32 and bf16:
  generation-layout re-score) and TP=2 -> TP_g=1 (training-layout re-score), where the same runs
  without exact mode differ;
* ``rollout.force_staleness=1``: the generator samples with the weights of the step before, and
  token-level TIS weights are ``min(pi_old / mu, C)`` against *those* behaviour log-probs (mu
  recomputed here from a copy of the older weights).
"""

import os

import pytest

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = os.path.join(REPO, "tests", "data", "digit_share_reward.py")
BASE = ["actor.sft_warmup_steps=0", "data.task_size=64", "data.train_batch_size=8", "rollout.n=4",
        "actor.micro_batch_size=8", "actor.mini_batch_size=32", "rollout.max_new_tokens=4",
        "actor.old_logprobs=recompute", "data.seed=3", "rollout.layout.tp=1", "rollout.layout.pp=1"]
PP2 = ["trainer.nproc=2", "actor.layout.tp=1", "actor.layout.pp=2"]
TP2 = ["trainer.nproc=2", "actor.layout.tp=2", "actor.layout.pp=1"]


def _diffs(runs, steps=2):
    """``rollout/logprob_diff_max`` of each step of each run (a list of overrides)."""
    import torch

    from hyflow.testing.rl import rl_setup, rl_step

    torch.set_num_threads(1)
    out = []
    for overrides in runs:
        cfg, state, job = rl_setup(BASE + overrides)
        out.append([rl_step(cfg, state, job)[0]["rollout/logprob_diff_max"] for _ in range(steps)])
    return out


def test_exact_mode_reports_the_training_forwards_logprobs():
    exact = ["rollout.exact_logprobs=true"]
    runs = {"pp2 fp32": PP2 + exact, "pp2 bf16": PP2 + exact + ["actor.dtype=bf16"], "tp2 fp32": TP2 + exact,
            "pp2 fp32 off": PP2, "tp2 fp32 off": TP2}
    got = dict(zip(runs, run_on_ranks(_diffs, 2, list(runs.values()), timeout=1200)[0]))
    for name in ("pp2 fp32", "pp2 bf16", "tp2 fp32"):
        assert got[name] == [0.0, 0.0], (name, got[name])
    for name in ("pp2 fp32 off", "tp2 fp32 off"):  # the gap exact mode closes
        assert all(0 < d < 1e-4 for d in got[name]), (name, got[name])


def _stale_tis(cap):
    import torch

    from hyflow.rl.batch import make_micro_batches, plan_fixed
    from hyflow.rl.step_losses import forward_score, logprob_scorer
    from hyflow.testing.rl import rl_setup, rl_step

    torch.set_num_threads(1)
    cfg, state, job = rl_setup(BASE + [
        "trainer.nproc=1", "actor.layout.tp=1", "actor.layout.pp=1", "rollout.force_staleness=1",
        "rollout.exact_logprobs=true", "actor.rollout_correction.mode=token_tis",
        f"actor.rollout_correction.cap={cap}", "actor.optim.lr=2e-2", "rollout.temperature=1.2",
        "reward.kind=function", f"reward.function_path={REWARD}"])
    module = state.models.actor.chunks[0].module
    older = {k: v.detach().clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}
    rl_step(cfg, state, job)  # samples with the initial weights, then updates them
    _, data = rl_step(cfg, state, job)  # samples with the initial weights again (one step stale)
    mask = data["response_mask"] > 0
    newer = {k: v.detach().clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}
    module.load_state_dict(older, strict=False)  # the behaviour policy of step 2
    tokens = data["tokens"]
    B, S = tokens.shape
    lengths = [S] * B
    micro = make_micro_batches({"tokens": tokens, "response_mask": data["response_mask"]}, lengths, plan_fixed(B, B))
    groups = state.models.groups
    mu = forward_score(state.models.actor.chunks, micro, logprob_scorer(state.models.sample_vocab, groups.pgs.tp,
                                                                        cfg.rollout.temperature), groups, (B, S))
    moved = max(float((newer[k] - older[k]).abs().max()) for k in older if k in newer)
    return data["old_logp"][mask], mu[mask], data["is_weights"][mask], moved


def test_tis_weights_are_taken_against_the_stale_behaviour_policy():
    cap = 1.02
    old, mu, weights, moved = run_on_ranks(_stale_tis, 1, cap, timeout=900)[0]
    assert moved > 0  # step 1 changed the weights, so step 2 sampled off-policy
    assert float((old - mu).abs().max()) > 1e-3  # the current policy differs from the behaviour one
    expected = (old - mu).exp().clamp(max=cap)
    assert float((weights - expected).abs().max()) < 1e-5
    assert bool((weights < cap).any()) and bool((weights == cap).any())  # both sides of the truncation
