"""The trainer scores the distribution the rollout sampled from.

The generation engine samples from ``softmax(logits / T)`` and reports those log-probs; the
trainer's old / reference log-probs and its policy loss must use the same temperature (they
used the T = 1 distribution whatever ``rollout.temperature`` was, so the policy gradient was
taken for another policy than the one that produced the samples). Checked end to end on the
layout of configs/smollm2_arith.yaml with the tiny quickstart model: actor trained at PP=2,
generating at PP_g=1 as 2 micro-DP replicas; before any update, the trainer's old log-probs of
the response tokens equal the log-probs the sampler reported.
"""

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = [
    "trainer.nproc=2", "actor.layout.tp=1", "actor.layout.pp=2", "rollout.layout.tp=1",
    "rollout.layout.pp=1", "actor.sft_warmup_steps=0", "data.task_size=64", "data.train_batch_size=8",
    "rollout.n=4", "actor.micro_batch_size=8", "actor.mini_batch_size=32", "rollout.max_new_tokens=4",
]


def _old_vs_rollout_logprobs(temperature: float, old_logprobs: str = "recompute"):
    import torch

    import hyflow.jobs.rl as rl
    from hyflow.testing.rl import rl_setup, rl_step

    torch.set_num_threads(1)
    cfg, state, job = rl_setup(OVERRIDES + ["data.seed=3", f"rollout.temperature={temperature}",
                                            f"actor.old_logprobs={old_logprobs}"])
    assert state.models.weights.plan.micro_dp_size == 2
    batches = []
    original = rl.build_rollout_batch

    def capture(*args, **kwargs):
        batches.append(original(*args, **kwargs))
        return batches[-1]

    rl.build_rollout_batch = capture
    try:
        metrics, data = rl_step(cfg, state, job)
    finally:
        rl.build_rollout_batch = original
    mask = data["response_mask"].bool()
    return data["old_logp"][mask], batches[0].rollout_logprobs[mask], data["ref_logp"][mask], metrics


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_old_logprobs_are_the_sampling_distributions(temperature):
    old, sampled, ref, metrics = run_on_ranks(_old_vs_rollout_logprobs, 2, temperature, timeout=600)[0]
    assert old.numel() > 0 and bool((sampled < 0).all())
    diff = float((old - sampled).abs().max())
    assert diff < 1e-4, f"trainer log-probs differ from the sampler's by {diff} at T={temperature}"
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(diff, abs=1e-7)
    # the reference is the initial actor: it scores with the same temperature
    assert float((ref - sampled).abs().max()) < 1e-4


def test_old_logprobs_from_the_rollout_skip_the_recomputation():
    """``actor.old_logprobs=rollout``: every rank's PPO denominators are the sampler's own
    log-probs, bit for bit, and the recomputation's diagnostic is absent."""
    for old, sampled, ref, metrics in run_on_ranks(_old_vs_rollout_logprobs, 2, 0.7, "rollout", timeout=600):
        assert old.numel() > 0 and torch.equal(old, sampled)
        assert float((ref - sampled).abs().max()) < 1e-4   # the reference is still a real forward
        assert "rollout/logprob_diff_max" not in metrics
