"""Two defects found by a differential check against verl's core algorithms, held by one RL step
of the tiny quickstart model on one rank (both fail on 705a661):

* the adaptive KL controller's horizon counts responses: after a step over ``P`` prompts with
  ``n`` responses each, :math:`\\beta \\leftarrow \\beta(1 + e\\,P n / H)` (it was updated with
  ``P``, so it moved ``n`` times slower than the horizon says);
* ``seq-mean-token-sum-norm`` divides by a constant (``rollout.max_new_tokens`` or
  ``actor.loss_scale_factor``), not by the padded width of the step: every response token's
  loss weight, as the RL job's update computes it for its mini-batch, is exactly
  ``1 / (max_new_tokens x sequences)`` (it was ``1 / (padded prompt + response width x
  sequences)``), and the actor's loss (policy and entropy terms) does not change when a
  micro-batch is padded wider.
"""

import os

import pytest

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = [
    "trainer.nproc=1", "actor.layout.tp=1", "rollout.layout.tp=1", "actor.sft_warmup_steps=0",
    "data.task_size=64", "data.train_batch_size=8", "rollout.n=4", "actor.micro_batch_size=32",
    "actor.mini_batch_size=32", "actor.ppo_epochs=1", "rollout.max_new_tokens=4",
    "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.1",
    "algorithm.kl_ctrl.target_kl=1.0", "algorithm.kl_ctrl.horizon=100",
    "actor.loss_agg_mode=seq-mean-token-sum-norm",
    "actor.fused_output_layer=false",  # the check widens the logits with padding columns
]
PAD = 5  # extra padding columns of the widened batch


def _one_step():
    import torch

    import hyflow.jobs.rl as rl
    from hyflow.testing.rl import rl_setup, rl_step

    torch.set_num_threads(1)
    cfg, state, job = rl_setup(OVERRIDES)
    before = state.kl_ctrl.value
    losses = []  # (loss term, the same term on the micro-batch padded PAD columns wider)
    weights = []  # the loss weights of response tokens
    original = rl.PolicyLoss

    def widened(logits, batch):
        """The batch and logits with PAD more columns of padding (mask 0) on the right."""
        b, s = batch["tokens"].shape
        out = {}
        for key, value in batch.items():
            if not torch.is_tensor(value) or value.dim() != 2:
                out[key] = value
                continue
            fill = torch.zeros(b, PAD, dtype=value.dtype)
            if key == "position_ids":
                fill = torch.arange(s, s + PAD).expand(b, PAD)
            out[key] = torch.cat([value, fill], dim=1)
        extra = torch.randn(b, PAD, logits.shape[-1], generator=torch.Generator().manual_seed(0))
        return torch.cat([logits.detach(), extra.to(logits.dtype)], dim=1), out

    class Capturing(original):  # the loss exactly as the RL job builds it
        def __call__(self, logits, batch):
            total, out = super().__call__(logits, batch)
            weights.append(batch["loss_weight"][batch["response_mask"] > 0].detach().clone())
            with torch.no_grad():
                _, wide = super().__call__(*widened(logits, batch))
            losses.extend((float(out[k]), float(wide[k])) for k in ("actor/pg_loss", "actor/entropy"))
            return total, out

    rl.PolicyLoss = Capturing
    try:
        metrics, data = rl_step(cfg, state, job)
    finally:
        rl.PolicyLoss = original
    return (before, metrics["actor/reward_kl_penalty"], state.kl_ctrl.value, data["tokens"].shape[0], losses,
            torch.cat(weights), data["tokens"].shape[1])


def test_adaptive_kl_horizon_counts_responses_and_norm_mode_ignores_padding():
    before, kl, after, responses, losses, weights, width = run_on_ranks(_one_step, 1, timeout=900)[0]
    assert responses == 8 * 4
    error = min(max(kl / 1.0 - 1.0, -0.2), 0.2)
    assert error != 0
    assert after == pytest.approx(before * (1 + error * responses / 100), rel=1e-12), \
        f"kl_coef {before} -> {after}; with the number of prompts it would be {before * (1 + error * 8 / 100)}"
    assert losses and any(v != 0.0 for v, _ in losses)  # the entropy term at least (rewards may all be 0)
    for value, wide in losses:
        assert wide == pytest.approx(value, rel=1e-6), "the loss normaliser depends on the padded width"
    # one mini-batch of 32 non-empty responses, rollout.max_new_tokens=4; the step's width is more
    assert width > 4 and weights.numel() > 0
    assert weights.double().sub(1 / (4 * responses)).abs().max() < 1e-9, \
        f"weights {weights.unique().tolist()}; a width-{width} normaliser would give {1 / (width * responses)}"
