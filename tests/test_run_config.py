"""A finished run is never reused silently (the README's "Using it" example): a command whose config
differs from the run directory's in anything but trainer.total_steps refuses before any rank starts,
naming the differences and the ways out; a run that trains nothing leaves config.resolved.yaml as it
was; the log shows only what the config changes from the defaults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from hyflow.config import ConfigError, format_changes
from hyflow.jobs.registry import load_job_config
from hyflow.jobs.run_config import check_run_reuse, config_differences

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
SMALL = ["trainer.nproc=1", "actor.layout.tp=1", "actor.sft_warmup_steps=0", "data.train_batch_size=8",
         "actor.mini_batch_size=64"]


def _train(out, *extra):
    return subprocess.run([sys.executable, "-m", "hyflow.cli", "train", QUICKSTART, *SMALL, f"trainer.output_dir={out}",
                           *extra], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_config_differences_skip_total_steps_and_unknown_keys():
    saved = {"trainer": {"total_steps": 300, "seed": 1}, "algorithm": {"adv_estimator": "grpo"}, "old_key": 1}
    current = {"trainer": {"total_steps": 40, "seed": 1, "new_key": 2}, "algorithm": {"adv_estimator": "rloo"}}
    assert config_differences(saved, current) == ["algorithm.adv_estimator: 'grpo' -> 'rloo'"]


@pytest.mark.multirank
def test_the_readme_example_refuses_to_continue_a_finished_run_with_another_config(tmp_path):
    out = str(tmp_path / "quickstart")
    first = _train(out, "trainer.total_steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    config_path = os.path.join(out, "config.resolved.yaml")
    saved = open(config_path).read()
    # the log shows the changes from the defaults, not the whole 120-line config
    assert "[hyflow] config (what differs from the defaults" in first.stdout
    assert "adv_estimator" not in first.stdout  # grpo is the default
    # README: `hyflow train configs/quickstart.yaml trainer.total_steps=40 algorithm.adv_estimator=rloo`
    second = _train(out, "trainer.total_steps=40", "algorithm.adv_estimator=rloo")
    assert second.returncode == 2
    assert "algorithm.adv_estimator: 'grpo' -> 'rloo'" in second.stderr
    assert "trainer.resume=never" in second.stderr and "trainer.output_dir" in second.stderr
    assert "launching" not in second.stdout + second.stderr
    assert open(config_path).read() == saved
    # only the step budget differs: allowed; the run has nothing left to train and leaves the config as it was
    third = _train(out, "trainer.total_steps=1")
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "nothing to train" in third.stdout + third.stderr
    assert yaml.safe_load(open(config_path))["trainer"]["total_steps"] == 2
    # trainer.resume=never starts over in the directory: no refusal
    cfg = load_job_config(QUICKSTART, SMALL + [f"trainer.output_dir={out}", "algorithm.adv_estimator=rloo",
                                                "trainer.resume=never"])
    check_run_reuse(cfg)
    cfg = load_job_config(QUICKSTART, SMALL + [f"trainer.output_dir={out}", "algorithm.adv_estimator=rloo"])
    with pytest.raises(ConfigError, match="checkpoint at step 2"):
        check_run_reuse(cfg)


def test_the_config_dump_lists_only_changes():
    cfg = load_job_config(QUICKSTART, ["algorithm.adv_estimator=rloo"])
    text = format_changes(cfg)
    changed = yaml.safe_load(text)
    assert changed["algorithm"] == {"adv_estimator": "rloo"}
    assert "critic" not in changed and "placement" not in changed
    assert len(text.splitlines()) < 40
