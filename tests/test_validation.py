"""Validation metrics (verl's names, exact best@k / worst@k) and the preference jobs' held-out
validation."""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from hyflow.config import ConfigError
from hyflow.monitor.metrics import read_metrics
from hyflow.validation.config import ValKwargs
from hyflow.validation.metrics import ValidationStats, extreme_of_draws, metric_names, prompt_metrics, subset_sizes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _enumerated(values, k, largest):
    """Mean and std of the max (min) over every one of the N^k equally likely draws, in float64."""
    pick = max if largest else min
    outcomes = [pick(draw) for draw in itertools.product(values, repeat=k)]
    mean = math.fsum(outcomes) / len(outcomes)
    return mean, math.sqrt(math.fsum((o - mean) ** 2 for o in outcomes) / len(outcomes))


@pytest.mark.parametrize("values", [[0.0, 1.0, 1.0, 0.0], [0.3, -1.2, 2.5, 0.3, 0.7], [1.0, 1.0, 1.0]])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_best_and_worst_of_k_equal_the_enumeration_of_every_draw(values, k):
    for largest in (True, False):
        got = extreme_of_draws(values, k, largest)
        want = _enumerated(values, k, largest)
        assert got == pytest.approx(want, abs=1e-12)


def test_best_of_k_is_what_verls_bootstrap_estimates():
    values = [0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.25]
    rng = random.Random(0)
    draws = [max(rng.choice(values) for _ in range(4)) for _ in range(20000)]
    mean = sum(draws) / len(draws)
    assert extreme_of_draws(values, 4, largest=True)[0] == pytest.approx(mean, abs=0.01)


def test_metric_names_and_verls_core_split():
    assert subset_sizes(1) == [] and subset_sizes(5) == [2, 4, 5] and subset_sizes(8) == [2, 4, 8]
    assert metric_names(1) == ["mean@1"]
    assert metric_names(4) == ["mean@4", "std@4", "best@2/mean", "best@2/std", "worst@2/mean", "worst@2/std",
                               "best@4/mean", "best@4/std", "worst@4/mean", "worst@4/std"]
    values = [1.0, 0.0, 0.0, 1.0]
    assert prompt_metrics(values)[:2] == [0.5, 0.5]
    stats = ValidationStats(["gsm8k", "math"], ["reward", "acc"], 4, torch.device("cpu"))
    stats.add_prompt("gsm8k", "reward", values)
    stats.add_prompt("gsm8k", "reward", [1.0, 1.0, 1.0, 1.0])
    stats.add_prompt("gsm8k", "acc", [1.0, math.nan, 0.0, 0.0])  # a missing value: the prompt is left out
    stats.add_prompt("gsm8k", "acc", [0.0, 0.0, 0.0, 1.0])
    out = stats.reduce()
    assert out["val-aux/gsm8k/reward/mean@4"] == 0.75  # the mean over prompts of each prompt's mean
    assert out["val-core/gsm8k/acc/mean@4"] == 0.25  # acc is the core variable when the reward returns it
    assert out["val-core/gsm8k/acc/best@4/mean"] == pytest.approx(1 - 0.75 ** 4)
    assert "val-aux/gsm8k/acc/best@2/mean" in out and "val-aux/gsm8k/acc/std@4" in out
    assert not any(k.startswith("val-core/math") or k.startswith("val-aux/math") for k in out)  # no prompts
    with pytest.raises(ValueError, match="3 responses of a prompt, expected 4"):
        stats.add_prompt("gsm8k", "reward", [1.0, 0.0, 1.0])


def test_val_kwargs_take_verls_values():
    assert ValKwargs(top_k=-1).top_k == -1  # before validation
    v = ValKwargs(n=4, do_sample=True, temperature=0.7, top_k=-1)
    v.validate()
    assert v.top_k == 0 and not v.greedy
    with pytest.raises(ConfigError, match="greedy responses would all be the same"):
        ValKwargs(n=4).validate()


@pytest.mark.multirank
@pytest.mark.parametrize("job, key", [("dpo", "eval_rewards/accuracies"), ("kto", "eval_rewards/margins")])
def test_preference_jobs_validate_on_their_val_files(tmp_path, job, key):
    from hyflow.data.dataset import write_rows
    from hyflow.data.tasks import make_preference_rows

    # rows the run also trains on (data.seed=1): the margins must follow the training margins' rise
    val = str(tmp_path / "val.jsonl")
    write_rows(make_preference_rows("pref_digit_add", 64, job, seed=1), val)
    out_dir = str(tmp_path / "run")
    run = subprocess.run([sys.executable, "-m", "hyflow.cli", "train", os.path.join(REPO, "configs", "dpo_quickstart.yaml"),
                          f"job={job}", "trainer.nproc=1", "actor.layout.tp=1", "trainer.total_steps=4",
                          "trainer.val_every=2", f"data.val_files=[{val}]", f"trainer.output_dir={out_dir}",
                          "algorithm.precompute_ref_logprobs=false", "data.task_size=64"],
                         capture_output=True, text=True, timeout=900, cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = read_metrics(out_dir)
    validated = {r["step"]: r for r in rows if key in r}
    assert sorted(validated) == [0, 2, 4]
    assert all(math.isfinite(r[key]) and math.isfinite(r["eval_loss"]) for r in validated.values())
    assert validated[0]["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference
    margins = [validated[s]["eval_rewards/margins"] for s in (0, 2, 4)]
    assert margins[0] < margins[1] < margins[2], margins
    assert validated[4]["eval_loss"] < validated[0]["eval_loss"]
