"""RewardManager: batch scoring, GRPO group layout, metrics, up-front ground-truth checks,
partial format credit and the reward-model interface."""
from __future__ import annotations

import math

import pytest

from hyflow.data import CharTokenizer, PromptDataset
from hyflow.jobs.rl_config import RewardConfig
from hyflow.rewards import RewardBatch, RewardError, RewardManager


def records(gts, sources=None):
    sources = sources or ["toy"] * len(gts)
    rows = [{"prompt": f"q{i}", "data_source": s, "reward_model": {"ground_truth": g}}
            for i, (g, s) in enumerate(zip(gts, sources))]
    return PromptDataset.from_rows(rows, CharTokenizer(), max_prompt_length=64, source="mem.jsonl").records


def test_rule_manager_from_config_scores_batch():
    rm = RewardManager.from_config(RewardConfig(kind="rule", rule="numeric_match"))
    assert rm.name == "rule:numeric_match"
    batch = rm.score(["#### 5", "6", "the answer is 5"], ["a", "a", "a"], ["5", "5", 5])
    assert batch.scores == [1.0, 0.0, 1.0]
    assert RewardManager.from_config(RewardConfig(rule="exact_match")).score(["5 "], ["a"], ["5"]).scores == [1.0]


def test_score_records_groups_n_responses_per_prompt():
    recs = records(["1", "2"])
    rm = RewardManager.from_rule("exact_match")
    batch = rm.score_records(recs, ["1", "x", "1", "2", "2", "1"])   # n = 3, prompt-major
    assert batch.scores == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="not a multiple of 2 prompts"):
        rm.score_records(recs, ["1", "2", "3"])


def test_metrics():
    batch = RewardBatch([1.0, 0.0, 1.0, 0.5], ["a", "a", "b", "b"], {"acc": [1.0, math.nan, 0.0, 1.0]})
    m = batch.metrics()
    assert m["reward/mean"] == pytest.approx(0.625)
    assert m["reward/std"] == pytest.approx(math.sqrt(((0.375 ** 2) * 2 + 0.625 ** 2 + 0.125 ** 2) / 4))
    assert (m["reward/min"], m["reward/max"]) == (0.0, 1.0)
    assert m["reward/a/mean"] == 0.5 and m["reward/b/mean"] == 0.75
    assert m["reward/extra/acc"] == pytest.approx(2 / 3)
    single = RewardBatch([1.0, 0.0], ["a", "a"]).metrics()
    assert "reward/a/mean" not in single and single["reward/std"] == 0.5
    assert RewardBatch([], []).metrics() == {}


def test_extras_aligned_when_some_samples_lack_keys(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': 1.0, 'len': len(solution_str)} if solution_str else 0.0\n")
    batch = RewardManager.from_function(str(path)).score(["", "ab", "", "abc"], ["s"] * 4, [None] * 4)
    assert batch.scores == [0.0, 1.0, 0.0, 1.0]
    assert len(batch.extras["len"]) == 4 and math.isnan(batch.extras["len"][0])
    assert batch.extras["len"][1] == 2.0 and math.isnan(batch.extras["len"][2]) and batch.extras["len"][3] == 3.0


def test_rule_error_names_row_and_source():
    recs = records(["5", "five"], ["ok", "gsm8k"])
    rm = RewardManager.from_rule("numeric_match")
    with pytest.raises(RewardError) as info:
        rm.score_records(recs, ["5", "5"])
    msg = str(info.value)
    assert "reward rule numeric_match cannot score mem.jsonl row 1 (data_source='gsm8k')" in msg
    assert "no number in ground truth 'five'" in msg
    assert info.value.row == "mem.jsonl row 1" and info.value.data_source == "gsm8k"


def test_check_records_fails_before_training():
    rm = RewardManager.from_rule("numeric_match")
    rm.check_records(records(["1", "2.5", "#### 3"]))                  # fine
    bad = records(["1", "x", "2", "y", "z", "w", "v", "u", "3"])
    with pytest.raises(RewardError) as info:
        rm.check_records(bad)
    msg = str(info.value)
    assert msg.startswith("6 row(s) have ground truths rule:numeric_match cannot use")
    assert "mem.jsonl row 1" in msg and "... and 1 more" in msg
    RewardManager.from_rule("format").check_records(bad)              # format ignores ground truth


def test_format_rule_and_partial_credit():
    fmt = RewardManager.from_rule("format", format_pattern=r"\d+")
    assert fmt.score(["12", "12 apples"], ["s", "s"], [None, None]).scores == [1.0, 0.0]
    per_row = fmt.score(["abc"], ["s"], [None], [{"format_pattern": "[a-z]+"}])
    assert per_row.scores == [1.0]
    rm = RewardManager.from_rule("numeric_match", format_score=0.1)
    assert rm.score(["5", "6", "six"], ["s"] * 3, ["5"] * 3).scores == [1.0, 0.1, 0.0]


def test_config_optional_keys_are_read_when_present():
    cfg = RewardConfig(kind="rule", rule="exact_match")
    cfg.format_score = 0.2            # keys the lead may add to RewardConfig
    cfg.format_pattern = r"\d{3}"
    rm = RewardManager.from_config(cfg)
    assert rm.score(["123", "124", "12"], ["s"] * 3, ["123"] * 3).scores == [1.0, 0.2, 0.0]


def test_unknown_rule_and_length_mismatch():
    with pytest.raises(RewardError, match="unknown reward rule 'fuzzy'; available: exact_match, format, length_match, numeric_match"):
        RewardManager.from_rule("fuzzy")
    with pytest.raises(ValueError, match="2 solutions but inputs of lengths"):
        RewardManager.from_rule("exact_match").score(["a", "b"], ["s"], ["a", "b"])


def test_reward_model_interface():
    cfg = RewardConfig(kind="model", model_checkpoint="/ckpt/rm")
    with pytest.raises(RewardError, match="must pass the reward model's scoring function"):
        RewardManager.from_config(cfg)
    seen = {}

    def model_fn(prompts, responses):
        seen["args"] = (list(prompts), list(responses))
        return [len(r) / 10 for r in responses]

    rm = RewardManager.from_config(cfg, model_fn=model_fn)
    recs = records(["-", "-"])
    batch = rm.score_records(recs, ["a", "bb", "ccc", "dddd"])
    assert batch.scores == [0.1, 0.2, 0.3, 0.4]
    assert seen["args"][0] == [recs[0].prompt_text] * 2 + [recs[1].prompt_text] * 2
    with pytest.raises(ValueError, match="needs the prompts"):
        rm.score(["a"], ["s"], [None])
    short = RewardManager("model", "model:x", model_fn=lambda p, r: [0.0])
    with pytest.raises(RewardError, match="returned 1 scores for 2 responses"):
        short.score_records(recs[:1], ["a", "b"])
    nan = RewardManager("model", "model:x", model_fn=lambda p, r: [float("nan")] * len(r))
    with pytest.raises(RewardError, match=r"non-finite score .* on mem.jsonl row 0"):
        nan.score_records(recs[:1], ["a"])


def test_reward_model_combined_with_a_rule_and_token_ids_passed():
    seen = {}

    def model_fn(prompts, responses, sequences):
        seen["sequences"] = sequences
        return [float(len(s)) for s in sequences]

    recs = records(["1", "2"])
    sequences = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    combined = RewardConfig(kind="rule", rule="exact_match", model_checkpoint="/ckpt/rm", model_coef=0.5)
    with pytest.raises(RewardError, match="model_checkpoint is set with reward.kind=rule: the trainer must pass"):
        RewardManager.from_config(combined)
    rm = RewardManager.from_config(combined, model_fn=model_fn)
    batch = rm.score_records(recs, ["1", "x", "2", "y"], sequences=sequences)
    assert seen["sequences"] == sequences
    assert batch.scores == [1.0 + 1.5, 0.0 + 0.5, 1.0 + 1.0, 0.0 + 2.0]  # rule + 0.5 * model
    assert batch.extras["reward_model"] == [3.0, 1.0, 2.0, 4.0]
    assert batch.metrics()["reward/extra/reward_model"] == 2.5
    only = RewardManager.from_config(RewardConfig(kind="model", model_checkpoint="/ckpt/rm", model_coef=2.0),
                                     model_fn=model_fn)
    assert only.score_records(recs, ["1", "x", "2", "y"], sequences=sequences).scores == [6.0, 2.0, 4.0, 8.0]
    # without a checkpoint a rule manager has no model part, as before
    assert RewardManager.from_config(RewardConfig(kind="rule", rule="exact_match")).model_fn is None
    with pytest.raises(ValueError, match="4 solutions but inputs of lengths"):
        rm.score_records(recs, ["1", "x", "2", "y"], sequences=sequences[:3])
