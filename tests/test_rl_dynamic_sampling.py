"""DAPO dynamic sampling in the RL step (``algorithm.dynamic_sampling``).

* :func:`collect_groups` alone: groups with equal rewards are dropped, rounds continue until the
  share is full, kept groups keep their round order and are renumbered; when the rounds run out
  the share is completed with groups without signal and ``gave_up`` is 1.
* End to end at DP=2 (tiny model, a dense reward): every trained group has reward variance > 0,
  ``train/num_gen_batches`` is logged, and every generation call of a rank covers only its own
  shard (4 of the 8 prompts); with a reward that is always 0 the step gives up after
  ``max_rounds`` with a full-size batch.
"""

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = os.path.join(REPO, "tests", "data", "digit_share_reward.py")


def _round(requests, scores, n=2, first_token=0):
    from hyflow.rewards.manager import RewardBatch
    from hyflow.rl.dynamic_sampling import Round
    from hyflow.rollout.dp import SampleTensors

    rows = len(scores)
    meta = torch.tensor([[requests[i // n], i % n, 1, 1, 1, 0] for i in range(rows)], dtype=torch.long)
    tokens = torch.arange(first_token, first_token + 2 * rows, dtype=torch.long)  # prompt, response per row
    samples = SampleTensors(meta=meta, tokens=tokens, logprobs=-torch.arange(rows, dtype=torch.float32))
    return Round(samples, RewardBatch(list(scores), ["s"] * rows, {"x": [float(i) for i in range(rows)]}),
                 torch.tensor(scores, dtype=torch.float32), n)


def test_collect_groups_keeps_signal_in_round_order_and_gives_up_clearly(capsys):
    from hyflow.rl.dynamic_sampling import collect_groups

    first = _round([10, 11, 12], [1, 1, 0, 1, 0, 0])  # only group 11 has signal
    later = {2: _round([10, 11, 12], [0, 0, 0.5, 0.2, 1, 0], first_token=100),  # 11 and 12
             3: _round([10, 11, 12], [1, 0, 1, 0, 1, 0], first_token=200)}
    asked = []

    def next_round(r, needed):
        asked.append((r, needed))
        return later[r]

    got, metrics = collect_groups(first, next_round, share=3, first=10, max_rounds=5, dp_group=None,
                                  device=torch.device("cpu"))
    assert asked == [(2, True)]
    assert metrics == {"train/num_gen_batches": 2.0, "dynamic_sampling/gave_up": 0.0,
                       "dynamic_sampling/kept_groups": 3.0, "dynamic_sampling/generated_groups": 6.0}
    assert got.scores.tolist() == pytest.approx([0, 1, 0.5, 0.2, 1, 0])  # group 11, then 11 and 12 of round 2
    assert got.samples.column("request").tolist() == [10, 10, 11, 11, 12, 12]
    assert got.samples.tokens.tolist() == [4, 5, 6, 7, 104, 105, 106, 107, 108, 109, 110, 111]
    assert got.samples.logprobs.tolist() == [-2, -3, -2, -3, -4, -5]
    assert got.scored.extras["x"] == [2, 3, 2, 3, 4, 5] and got.scored.scores == [0, 1, 0.5, 0.2, 1, 0]

    none = _round([0, 1], [1, 1, 0, 0])
    got, metrics = collect_groups(none, lambda r, needed: _round([0, 1], [0, 0, 0, 0]), share=2, first=0,
                                  max_rounds=2, dp_group=None, device=torch.device("cpu"))
    assert metrics["dynamic_sampling/gave_up"] == 1.0 and metrics["train/num_gen_batches"] == 2.0
    assert len(got.samples) == 4 and got.samples.column("request").tolist() == [0, 0, 1, 1]
    assert "gave up after 2 rounds" in capsys.readouterr().err


BASE = ["trainer.nproc=2", "actor.layout.tp=1", "actor.layout.pp=1", "rollout.layout.tp=1", "actor.sft_warmup_steps=0",
        "data.task_size=200", "data.train_batch_size=8", "rollout.n=2", "rollout.max_new_tokens=3",
        "rollout.temperature=1.2", "actor.micro_batch_size=8", "actor.mini_batch_size=16", "data.seed=1",
        "algorithm.dynamic_sampling.enable=true"]


def _dynamic(overrides, steps):
    from hyflow.testing.rl import rl_setup, rl_step

    torch.set_num_threads(1)
    cfg, state, job = rl_setup(BASE + overrides)
    dispatcher = state.models.rollouts
    original, calls = dispatcher.generate, []

    def counting(prompts, n, **kwargs):
        calls.append(len(prompts))
        return original(prompts, n, **kwargs)

    dispatcher.generate = counting
    out = []
    for _ in range(steps):
        calls.clear()
        metrics, data = rl_step(cfg, state, job)
        scores = data["scores"].view(-1, cfg.rollout.n)
        out.append({"metrics": {k: v for k, v in metrics.items() if k.startswith(("train/", "dynamic_sampling/"))},
                    "spread": (scores.max(1).values - scores.min(1).values).tolist(), "calls": list(calls),
                    "rows": data["rows"].tolist()})
    return out


@pytest.mark.multirank
def test_dynamic_sampling_trains_only_groups_with_signal_at_dp2():
    runs = run_on_ranks(_dynamic, 2, ["reward.kind=function", f"reward.function_path={REWARD}",
                                      "algorithm.dynamic_sampling.max_rounds=8"], 3, timeout=1200)
    for rank, steps in enumerate(runs):
        for step in steps:
            m = step["metrics"]
            assert m["dynamic_sampling/gave_up"] == 0 and m["dynamic_sampling/kept_groups"] == 8
            assert len(step["spread"]) == 4 and all(s > 0 for s in step["spread"]), step["spread"]
            assert step["calls"] and all(c == 4 for c in step["calls"])  # its own shard, never the batch
            assert step["rows"] == list(range(rank * 8, rank * 8 + 8))
    rounds = [s["metrics"]["train/num_gen_batches"] for s in runs[0]]
    assert rounds == [s["metrics"]["train/num_gen_batches"] for s in runs[1]]  # one decision for all ranks
    assert max(rounds) > 1  # some groups had equal rewards and were refilled
    # a rank skips the generation of a round it does not need
    assert any(len(a["calls"]) != len(b["calls"]) for a, b in zip(*runs)) or all(
        len(s["calls"]) == s["metrics"]["train/num_gen_batches"] for s in runs[0])

    gave_up = run_on_ranks(_dynamic, 2, ["reward.kind=rule", "reward.rule=exact_match",
                                         "algorithm.dynamic_sampling.max_rounds=2"], 1, timeout=600)
    for rank, (step,) in enumerate(gave_up):
        assert step["metrics"] == {"train/num_gen_batches": 2.0, "dynamic_sampling/gave_up": 1.0,
                                   "dynamic_sampling/kept_groups": 0.0, "dynamic_sampling/generated_groups": 16.0}
        assert step["rows"] == list(range(rank * 8, rank * 8 + 8)) and step["calls"] == [4, 4]
