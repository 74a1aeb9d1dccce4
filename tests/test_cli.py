"""The ``hyflow`` command line: help, config errors before any process starts, a real run."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM_TINY = os.path.join(REPO, "configs", "lm_tiny.yaml")


def hyflow(*args, timeout=300, cwd=None):
    return subprocess.run([sys.executable, "-m", "hyflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO)


def test_help_lists_subcommands():
    out = hyflow("--help")
    assert out.returncode == 0
    for command in ("train", "config", "info"):
        assert command in out.stdout


def test_misspelled_override_fails_before_any_process_group():
    start = time.perf_counter()
    out = hyflow("train", LM_TINY, "trainer.totl_steps=3")
    assert out.returncode == 2
    assert "unknown config key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?" in out.stderr
    assert "launching" not in out.stdout  # no ranks were started
    assert time.perf_counter() - start < 60


def test_misspelled_key_in_yaml_file(tmp_path):
    with open(LM_TINY) as f:
        data = yaml.safe_load(f)
    data["actor"]["optim"]["lrr"] = 0.1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    out = hyflow("train", str(path))
    assert out.returncode == 2
    assert "unknown config key 'actor.optim.lrr'" in out.stderr and "'actor.optim.lr'" in out.stderr


def test_layout_that_does_not_divide_is_a_config_error():
    out = hyflow("train", LM_TINY, "actor.layout.tp=4", "trainer.nproc=4")
    assert out.returncode == 2
    assert "tp=4 does not divide the 2 key/value groups" in out.stderr


def test_config_describe_lists_keys():
    out = hyflow("config", LM_TINY, "--describe")
    assert out.returncode == 0
    assert "trainer.total_steps" in out.stdout and "actor.layout.tp" in out.stdout


@pytest.mark.multirank
def test_train_runs_two_ranks_and_writes_metrics(tmp_path):
    run_dir = tmp_path / "run"
    out = hyflow("train", LM_TINY, "trainer.total_steps=12", f"trainer.output_dir={run_dir}",
                 "actor.optim.warmup_steps=0")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert resolved["trainer"]["total_steps"] == 12 and resolved["actor"]["layout"]["tp"] == 2
    assert "launching 2 ranks" in out.stdout and "step   12/12" in out.stdout
