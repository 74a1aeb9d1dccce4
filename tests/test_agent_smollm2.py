"""64 multi-turn trajectories on SmolLM2-135M-Instruct (8 arithmetic prompts x 8 samples, up to 3
assistant turns with a simulated user's message in between), sampled by the RL job on 2 CPU ranks (actor
trained at PP=2, generating at PP_g=1 as 2 replicas): the trainer's recomputed log-prob of every
assistant token matches the sampler's (``logprob_diff_max`` reported), exactly in exact mode; the
observation tokens are in the rows and out of the mask."""

import os

import pytest

from hyflow.testing import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO, "checkpoints", "smollm2-135m")

pytestmark = [pytest.mark.multirank, pytest.mark.slow,
              pytest.mark.skipif(not os.path.isfile(os.path.join(CKPT, "model.json")),
                                 reason="checkpoints/smollm2-135m not converted here (make smollm2)")]

OVERRIDES = [
    "actor.layout.pp=2", "reference.enable=false", "data.train_batch_size=8", "rollout.n=8",
    "rollout.max_new_tokens=24", "rollout.temperature=0.7", "trainer.total_steps=1",
    "data.task=arithmetic", "data.task_options={ops: +-, max_operand: 20}",  # short answers: turns that end
    "rollout.stop_token_ids=[198]",  # a line break ends a turn too (then the template's end-of-turn is context)
    "rollout.multi_turn.environment=hyflow.testing.agent:EchoUser",
    "rollout.multi_turn.environment_kwargs={turns: 3, reply: 'Again, just the number.'}",
    "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_response_tokens=96",
    "rollout.multi_turn.reward=environment", "actor.sft_warmup_steps=0",
]


def _sample_and_rescore() -> dict:
    """Phases 1-3 of a step in exact mode: the trajectories (their log-probs as sampled are kept
    before exact mode replaces them), then the trainer's old-log-prob forward over them."""
    import torch

    import hyflow.jobs.rl as rl
    from hyflow.algorithms.mismatch import mismatch_metrics, mismatch_row_stats
    from hyflow.monitor.timers import PhaseTimers
    from hyflow.rl.batch import batching_for
    from hyflow.rl.dispatch import sampling_seed
    from hyflow.rl.step_losses import forward_score, logprob_scorer
    from hyflow.testing.rl import rl_setup

    torch.set_num_threads(1)
    cfg, state, job = rl_setup(OVERRIDES + ["rollout.exact_logprobs=true"],
                               os.path.join(REPO, "configs", "smollm2_tools.yaml"))
    models = state.models
    records = state.loader.next_batch()
    first, stop = models.rollouts.shard(len(records))
    sampled = []
    original = rl._with_logprobs

    def keep(samples, pad_id, rescore):  # the sampler's own log-probs, before exact mode's re-score
        sampled.append(samples.logprobs.clone())
        return original(samples, pad_id, rescore)

    rl._with_logprobs = keep
    try:
        rnd = rl.generate_round(cfg, state, job, records[first:stop], first, sampling_seed(cfg.trainer.seed, 1),
                                PhaseTimers())
    finally:
        rl._with_logprobs = original
    exact = rl._rollout_batch(rnd.samples, job.pad_id)
    columns = {"tokens": exact.tokens, "response_mask": exact.response_mask}
    scoring = batching_for(cfg, "reference", models.groups, job.pad_id).cut(columns, exact.row_lengths())
    scorer = logprob_scorer(models.sample_vocab, models.groups.pgs.tp, cfg.rollout.temperature,
                            cfg.actor.fused_output_layer)
    old = forward_score(models.actor.chunks, scoring, scorer, models.groups, tuple(exact.tokens.shape))
    out = {}
    for mode, samples in (("sampled", rnd.samples.replace_logprobs(sampled[0])), ("exact", rnd.samples)):
        batch = rl._rollout_batch(samples, job.pad_id)
        mask = batch.response_mask > 0
        diff = (old - batch.rollout_logprobs).abs()[mask]
        rows = mismatch_row_stats(old, batch.rollout_logprobs, batch.response_mask)
        metrics = mismatch_metrics({k: float(v.max() if k.endswith("_max") else v.sum()) for k, v in rows.items()})
        observations = batch.response_positions() & ~mask
        out[mode] = {"trajectories": batch.size, "assistant_tokens": int(mask.sum()),
                     "observation_tokens": int(observations.sum()), "diff_max": float(diff.max()),
                     "diff_mean": float(diff.mean()), "metric": metrics["rollout/logprob_diff_max"],
                     "turns": rnd.samples.stats[:, 0].tolist()}
    return out


def test_recomputed_logprobs_of_every_assistant_token_match_the_samplers():
    got = run_on_ranks(_sample_and_rescore, 2, timeout=1800)[0]
    for mode in ("sampled", "exact"):
        r = got[mode]
        print(f"[smollm2 multi-turn] {mode}: {r['trajectories']} trajectories, {r['assistant_tokens']} assistant "
              f"tokens, {r['observation_tokens']} observation tokens, logprob_diff_max {r['diff_max']:.3g}, "
              f"mean {r['diff_mean']:.3g}")
        assert r["trajectories"] == 64 and sum(t >= 2 for t in r["turns"]) >= 40  # most multi-turn (51 of 64 here)
        assert r["observation_tokens"] > 64 and r["assistant_tokens"] > 64 * 3
        assert r["metric"] == r["diff_max"]  # what the step reports as rollout/logprob_diff_max
    assert got["sampled"]["diff_max"] < 5e-3  # fp32 KV-cache decoding vs the training forward
    assert got["exact"]["diff_max"] == 0.0
