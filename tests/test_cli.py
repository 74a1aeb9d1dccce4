"""The ``hyflow`` command line: help, config errors before any process starts, a real run."""

import json
import os
import subprocess
import sys
import tempfile
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


def test_help_a_config_error_and_the_preflight_load_no_megatron():
    """`hyflow --help`, a config error and the RL preflight stay light: Megatron-Core (seconds, GiB),
    transformers and vLLM load only where a rank needs them (the imports that keep them out say why)."""
    code = ("import os, sys\n"
            "from hyflow.cli import main\n"
            "from hyflow.jobs.registry import load_job_config\n"
            "from hyflow.launch.local import Target, check_before_launch\n"
            "for argv in (['--help'], ['train', 'configs/quickstart.yaml', 'trainer.bogus=1']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "cfg = load_job_config('configs/quickstart.yaml', [f'trainer.output_dir={sys.argv[1]}'])\n"
            "check_before_launch(Target(command='train', config=os.path.abspath('configs/quickstart.yaml'), args=[],\n"
            "                           job=cfg.job, output_dir=sys.argv[1], cfg=cfg))\n"
            "print('loaded:', sorted(m for m in ('megatron', 'transformers', 'vllm') if m in sys.modules))\n")
    with tempfile.TemporaryDirectory() as out_dir:
        out = subprocess.run([sys.executable, "-c", code, os.path.join(out_dir, "run")], capture_output=True,
                             text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "loaded: []", out.stdout[-2000:]


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
    assert "launching 2 ranks" in out.stdout and "step 12/12" in out.stderr  # the progress line: stderr


QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def test_version():
    out = hyflow("--version")
    assert out.returncode == 0 and out.stdout.startswith("hyflow 0.") and "megatron-core" in out.stdout


def test_every_option_has_help_with_its_default_and_no_markup():
    import argparse

    from hyflow.cli import _subparsers, build_parser

    parser = build_parser()
    seen = 0
    for p in _subparsers(parser):
        text = p.format_help()
        for marker in ("``", ":mod:", ":func:", ":class:"):
            assert marker not in text, (p.prog, marker)
        for action in p._actions:
            if not action.option_strings or action.help is argparse.SUPPRESS:
                continue
            assert action.help, f"{p.prog} {action.option_strings[0]} has no help"
            if action.default is not None and action.default is not argparse.SUPPRESS \
                    and not isinstance(action.default, bool):
                shown = p._get_formatter()._expand_help(action)
                assert "default" in shown.lower(), (p.prog, action.option_strings, shown)
            seen += 1
    assert seen > 100
    generate = " ".join(hyflow("generate", "--help").stdout.split())
    assert "--top-k" in generate and "(default: 0)" in generate and "(default: 128)" in generate


def test_config_describe_shows_effective_defaults_and_the_configs_values():
    out = hyflow("config", QUICKSTART, "--describe")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # the RL job's effective model default (tiny_llama), not the ModelDescription field's 32000
    assert "model.vocab_size: int = 256   [config: 128]" in lines
    assert "model.hidden_size: int = 64" in lines  # the quickstart keeps the default: no mark
    assert "actor.optim.lr: float = 1.0e-06   [config: 0.0003]" in lines
    entries = [i for i, line in enumerate(lines[1:], 1) if not line.startswith("    ")]
    for i in entries:  # one help line under every key
        assert lines[i + 1].startswith("    ") and lines[i + 1].strip() not in ("", "(no help)"), lines[i]
    assert "(no help)" not in out.stdout and "``" not in out.stdout


@pytest.mark.parametrize("config, extra", [("dpo_quickstart.yaml", []), ("dpo_quickstart.yaml", ["job=kto"]),
                                           ("lm_tiny.yaml", [])])
def test_every_key_of_every_job_has_help(config, extra):
    out = hyflow("config", os.path.join(REPO, "configs", config), *extra, "--describe")
    assert out.returncode == 0, out.stderr
    assert "(no help)" not in out.stdout, [line for line in out.stdout.splitlines() if line.strip()][:3]


def test_config_without_arguments_is_the_rl_job_and_head_does_not_break_the_pipe():
    out = hyflow("config")
    assert out.returncode == 0 and "adv_estimator: grpo" in out.stdout and "no config file given" in out.stderr
    out = hyflow("config", "--describe")
    assert "algorithm.adv_estimator:" in out.stdout
    assert "data.seq_length" in hyflow("config", "--describe", "job=lm").stdout
    pipe = subprocess.run(f"{sys.executable} -m hyflow.cli config --describe | head -3", shell=True,
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert len(pipe.stdout.splitlines()) == 3 and "Traceback" not in pipe.stderr and "BrokenPipe" not in pipe.stderr
