"""A verl user's first-day papercuts (issue 36, point 6): KL metrics only with a KL term, prompt
lengths checked before launch, sample lines, Megatron's noise filtered, progress on a 0-column
terminal, and the help / README facts that were wrong."""

from __future__ import annotations

import ast
import io
import os
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from hyflow.config import ConfigError
from hyflow.jobs.registry import load_job_config
from hyflow.testing import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
SMALL = ["trainer.nproc=1", "actor.layout.tp=1", "actor.sft_warmup_steps=0", "data.train_batch_size=4",
         "actor.mini_batch_size=32", "rollout.n=8"]


def _kl_metrics(kl_in_reward: bool):
    from hyflow.testing.rl import rl_setup, rl_step

    cfg, state, job = rl_setup(SMALL + [f"algorithm.use_kl_in_reward={str(kl_in_reward).lower()}"])
    return sorted(k for k in rl_step(cfg, state, job)[0] if "kl" in k)


@pytest.mark.multirank
def test_kl_metrics_only_when_a_kl_term_is_in_use():
    without = run_on_ranks(_kl_metrics, 1, False, timeout=600)[0]
    with_penalty = run_on_ranks(_kl_metrics, 1, True, timeout=600)[0]
    assert "actor/reward_kl_penalty" not in without and "actor/reward_kl_penalty_coeff" not in without
    assert {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"} <= set(with_penalty)
    from hyflow.monitor.plot import rl_plot_keys

    cfg = load_job_config(QUICKSTART, [])
    assert rl_plot_keys(cfg, []) == ["critic/score/mean"]  # no KL panel without a KL term
    cfg = load_job_config(QUICKSTART, ["actor.use_kl_loss=true"])
    assert rl_plot_keys(cfg, [{"val-core/x/reward/mean@1": 0.5}]) == ["critic/score/mean", "actor/kl_loss",
                                                                      "val-core/x/reward/mean@1"]


def test_preflight_refuses_data_whose_prompts_are_all_too_long(tmp_path):
    from hyflow.data.dataset import write_rows
    from hyflow.data.tasks import make_task_rows
    from hyflow.jobs.preflight import preflight

    path = str(tmp_path / "train.jsonl")
    write_rows(make_task_rows("digit_add", 40, seed=1), path)  # more than one batch of 32
    base = ["data.task=null", f"data.train_files=[{path}]", "data.tokenizer=char",
            f"trainer.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"all 40 prompts read here are longer than rollout.max_prompt_length=3 "
                                          r"tokens.*raise rollout.max_prompt_length \(verl: data.max_prompt_length\)"):
        preflight(load_job_config(QUICKSTART, base + ["rollout.max_prompt_length=3"]))
    preflight(load_job_config(QUICKSTART, base + ["rollout.max_prompt_length=3", "rollout.truncate_long_prompts=true"]))
    preflight(load_job_config(QUICKSTART, base))  # 16 tokens fit them


def test_sample_lines_show_prompt_response_ground_truth_and_score():
    from hyflow.data.tokenizer import CharTokenizer
    from hyflow.monitor.samples import print_samples

    tok = CharTokenizer()
    records = [SimpleNamespace(prompt_text="1+2=", ground_truth="3"), SimpleNamespace(prompt_text="4+4=", ground_truth="8")]
    ids = [tok.encode(t) for t in ("1+2=3", "1+2=4", "4+4=8", "4+4=9")]
    tokens = torch.tensor(ids)
    mask = torch.zeros_like(tokens)
    mask[:, 4] = 1
    data = {"tokens": tokens, "response_mask": mask, "scores": torch.tensor([1.0, 0.0, 1.0, 0.0]),
            "rows": torch.arange(4)}
    out = io.StringIO()
    progress = SimpleNamespace(write=lambda text: out.write(text + "\n"))
    trainer = SimpleNamespace(log_samples=3, log_every=5, total_steps=20)
    print_samples(progress, trainer, 7, 0, records, data, tok, 2)  # not a log step
    assert out.getvalue() == ""
    print_samples(progress, trainer, 10, 0, records, data, tok, 2)
    lines = out.getvalue().splitlines()
    assert lines == ["[hyflow] sample 1/3 of step 10: prompt '1+2=' | response '3' | ground truth '3' | score 1",
                     "[hyflow] sample 2/3 of step 10: prompt '1+2=' | response '4' | ground truth '3' | score 0",
                     "[hyflow] sample 3/3 of step 10: prompt '4+4=' | response '8' | ground truth '8' | score 1"]


def test_megatrons_known_warnings_are_filtered_and_others_are_not():
    import megatron.core.tensor_parallel.layers as layers

    from hyflow.compat.warnings import KNOWN, quiet_known_warnings

    messages = [node.value for node in ast.walk(ast.parse(open(layers.__file__).read()))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    assert sum(bool(re.match(KNOWN[0][1], m)) for m in messages) == 2  # it still matches Megatron's two messages
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        warnings.warn("When using async grad allreduce it is recommended to set the environment variable "
                      "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning, stacklevel=1)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]


def test_progress_prints_lines_on_a_terminal_of_zero_columns(monkeypatch):
    pytest.importorskip("tqdm")
    from hyflow.monitor import progress as progress_module

    class Terminal(io.StringIO):
        def isatty(self):
            return True

        def fileno(self):
            return 2

    monkeypatch.setattr(progress_module.os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    stream = Terminal()
    bar = progress_module.Progress(total=3, stream=stream)
    assert not bar.tty
    bar.update(1, {"critic/score/mean": 0.5})
    assert "step 1/3" in stream.getvalue() and "reward 0.5" in stream.getvalue()
    monkeypatch.setattr(progress_module.os, "get_terminal_size", lambda fd: os.terminal_size((120, 40)))
    assert progress_module.Progress(total=3, stream=Terminal()).tty


def test_help_and_readme_facts():
    from hyflow.config import describe
    from hyflow.jobs.rl_config import RLJobConfig

    text = describe(RLJobConfig)
    assert "reward.function_file" not in text and "name of the scoring function in reward.function_path" in text
    for path in ("engine/rewards/user_function.py", "engine/rewards/manager.py", "README.md"):
        source = open(os.path.join(REPO, path)).read()
        assert "logged as ``reward/extra/" not in source, path
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "MLFLOW_ALLOW_FILE_STORE=true" in readme
