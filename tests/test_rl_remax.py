"""ReMax in the RL trainer, on 2 ranks (TP=2 training, TP=1 generation with 2 micro-DP replicas).

Checked against references computed here, not by the trainer's code:

* the greedy baselines equal an argmax decode by full forwards of the actor in its training
  layout (no KV cache, no rollout engine), with the same length limit and stop ids;
* every response token's advantage is ``exact_match(sample) - exact_match(greedy response of
  its prompt)``, both scored here with the rule itself; ``critic/greedy_score/mean`` is their mean;
* learning signal: after the update, responses with positive advantage became more likely and
  responses with negative advantage less likely.
"""

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = [
    "trainer.nproc=2", "actor.layout.tp=2", "rollout.layout.tp=1", "data.task=digit_add",
    "data.task_size=400", "data.train_batch_size=16", "rollout.n=4", "actor.micro_batch_size=16",
    "actor.mini_batch_size=32", "actor.sft_warmup_steps=40", "actor.sft_lr=3e-3", "actor.optim.lr=1e-3",
    "rollout.max_new_tokens=4", "algorithm.adv_estimator=remax",
]


def _argmax_decode(models, prompts, max_new, stops):
    """Greedy responses by repeated full forwards of the training-layout actor (vocab-parallel
    logits all-gathered over TP, argmax over the ids the sampler may draw)."""
    import torch.distributed as dist

    from hyflow.testing.rl import score_rows

    tp = models.groups.pgs.tp

    def argmax(logits, batch):
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp))]
        dist.all_gather(parts, logits.contiguous(), group=tp)
        return torch.cat(parts, dim=-1)[..., :models.sample_vocab].argmax(-1).float()

    responses = [[] for _ in prompts]
    for _ in range(max_new):
        live = [i for i, r in enumerate(responses) if not (r and r[-1] in stops)]
        if not live:
            break
        seqs = [prompts[i] + responses[i] for i in live]
        tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        for j, s in enumerate(seqs):
            tokens[j, :len(s)] = torch.tensor(s)
        best = score_rows(models.actor.chunks, models.groups, tokens, argmax)
        for j, i in enumerate(live):
            responses[i].append(int(best[j, len(seqs[j]) - 1]))
    return responses


def _remax_steps():
    import torch.distributed as dist

    import hyflow.jobs.rl as rl
    from hyflow.monitor.timers import PhaseTimers
    from hyflow.rewards.rules import exact_match
    from hyflow.rl.step_losses import logprob_scorer
    from hyflow.testing.rl import rl_setup, score_rows

    cfg, state, job = rl_setup(OVERRIDES)
    assert cfg.reward.kind == "rule" and cfg.reward.rule == "exact_match"
    models, tok = state.models, job.tokenizer
    rl.sft_warmup(cfg, state, tok)
    calls = []
    generate = models.rollouts.generate
    timers = PhaseTimers()

    def spy(prompts, n, **kwargs):
        result = generate(prompts, n, **kwargs)
        calls.append((n, kwargs.get("greedy", False), result, "gen" in timers._open))  # timed as generation?
        return result

    models.rollouts.generate = spy
    stops = set(models.rollouts.eos) | set(cfg.rollout.stop_token_ids)
    n = cfg.rollout.n
    out = {"greedy_ref": [], "greedy_used": [], "adv_error": [], "greedy_mean": [], "greedy_mean_ref": [],
           "pos": [], "neg": [], "calls": [], "rows": []}
    for _ in range(3):
        records = state.loader.next_batch()
        prompts = [r.prompt_ids for r in records]
        reference = _argmax_decode(models, prompts, cfg.rollout.max_new_tokens, stops)  # weights before the step
        calls.clear()
        m, data = rl.rl_step(cfg, state, records, job, timers)
        state.step += 1
        out["calls"].append([(c[0], c[1], len(c[2].samples), c[3]) for c in calls])
        greedy = [c[2] for c in calls if c[1]][0].samples.to_outputs()
        out["greedy_ref"].append(reference)
        out["greedy_used"].append([s.token_ids for s in greedy])
        out["rows"].append(data["tokens"].shape[0])  # the greedy responses are not in the training batch
        # independent scores: the rule itself on the decoded responses
        mask = data["response_mask"]
        tokens = data["tokens"]
        texts = tok.batch_decode([tokens[i][mask[i] > 0].tolist() for i in range(tokens.shape[0])])
        score = torch.tensor([exact_match(t, records[i // n].ground_truth) for i, t in enumerate(texts)])
        greedy_score = torch.tensor([exact_match(t, r.ground_truth)
                                     for t, r in zip(tok.batch_decode(reference), records)])
        expected = (score - greedy_score.repeat_interleave(n))[:, None] * mask
        out["adv_error"].append(float((data["advantages"] - expected).abs().max()))
        out["greedy_mean"].append(m["critic/greedy_score/mean"])
        out["greedy_mean_ref"].append(float(greedy_score.mean()))
        # learning signal
        new = score_rows(models.actor.chunks, models.groups, tokens, logprob_scorer(models.sample_vocab,
                                                                                    models.groups.pgs.tp))
        change = ((new - data["old_logp"]) * mask).sum(-1)
        adv = (data["advantages"] * mask).sum(-1)
        out["pos"].append(change[adv > 0])
        out["neg"].append(change[adv < 0])
    if dist.get_rank() != 0:
        return None
    out["pos"], out["neg"] = torch.cat(out["pos"]), torch.cat(out["neg"])
    return out


def test_remax_baseline_is_the_greedy_response_score_and_the_policy_learns():
    out = run_on_ranks(_remax_steps, 2, timeout=600)[0]
    for calls in out["calls"]:  # n samples per prompt, then one greedy response per prompt, both timed
        assert calls == [(4, False, 64, True), (1, True, 16, True)], calls
    assert out["rows"] == [64, 64, 64]
    assert out["greedy_used"] == out["greedy_ref"]
    assert max(out["adv_error"]) < 1e-6, out["adv_error"]
    assert out["greedy_mean"] == pytest.approx(out["greedy_mean_ref"], abs=1e-6)
    pos, neg = out["pos"], out["neg"]
    assert len(pos) >= 2 and len(neg) >= 2, (len(pos), len(neg))
    assert pos.mean() > 0, pos
    assert neg.mean() < 0, neg
