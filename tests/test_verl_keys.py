"""verl's keys on hyflow's command line: the table the loader reads is the one docs/verl.md shows,
every key it maps to exists, each conversion gives verl's meaning in hyflow's unit, unsupported keys
are refused by name, and one command with several bad keys reports them all in one run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hyflow.config import ConfigError
from hyflow.config.core import has_key
from hyflow.jobs.registry import load_job_config
from hyflow.jobs.rl_config import RLJobConfig
from hyflow.jobs.verl_keys import TABLE, lookup, markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
A = "actor_rollout_ref.actor"


def test_the_documented_table_is_the_one_the_code_reads():
    text = open(os.path.join(REPO, "docs", "verl.md"), encoding="utf-8").read()
    block = re.search(r"<!-- verl-keys:begin -->\n(.*)\n<!-- verl-keys:end -->", text, re.S)
    assert block is not None
    assert block.group(1) == markdown_table(), "regenerate docs/verl.md's table from hyflow.jobs.verl_keys.TABLE"


def test_every_mapped_key_exists_in_hyflow():
    for row in TABLE:
        if row.ours == "-" or row.ours.endswith(".*"):
            continue
        assert has_key(RLJobConfig, row.ours), row
        assert row.kind != "same" or row.verl == row.ours, row
    assert len({row.verl for row in TABLE}) == len(TABLE)


def test_conversions_keep_verls_meaning():
    cfg = load_job_config(QUICKSTART, [
        f"{A}.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4", f"{A}.ppo_micro_batch_size_per_gpu=16",
        "data.max_prompt_length=16", "data.max_response_length=6", "actor_rollout_ref.rollout.top_k=-1",
        "trainer.test_freq=-1", "trainer.save_freq=5", "trainer.logger=console", "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1", "trainer.resume_mode=disable", f"{A}.clip_ratio=0.3", f"{A}.clip_ratio_high=0.28",
        f"{A}.use_dynamic_bsz=True", f"{A}.ppo_max_token_len_per_gpu=64", "data.truncation=left",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "trainer.total_epochs=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"])
    assert cfg.actor.mini_batch_size == 32  # prompts x n: responses
    assert cfg.actor.micro_batch_size == 16  # per GPU = per DP rank
    assert (cfg.rollout.max_prompt_length, cfg.rollout.max_new_tokens, cfg.rollout.top_k) == (16, 6, 0)
    assert (cfg.trainer.val_every, cfg.trainer.save_every, cfg.trainer.loggers) == (0, 5, ["console"])
    assert cfg.trainer.nproc == 2 and cfg.cluster.gpus_per_node == 8  # not the plan-only key
    assert cfg.trainer.resume == "never"
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.3, 0.28)  # the explicit one wins
    assert cfg.actor.max_tokens_per_micro_batch == 64 and cfg.rollout.truncate_long_prompts
    assert cfg.reference.micro_batch_size == 8  # the smaller of the rollout's and the ref's
    assert cfg.trainer.total_steps == 2 * (5000 // 32)  # quickstart's task: 5000 prompts, 32 a step
    assert any("gpu_memory_utilization=0.6: ignored" in n for n in cfg.notes)
    assert any("ppo_mini_batch_size=8 prompts -> actor.mini_batch_size=32 responses (x rollout.n=4)" in n
               for n in cfg.notes)


def test_reward_and_critic_keys(tmp_path):
    fn = tmp_path / "r.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg = load_job_config(QUICKSTART, [f"custom_reward_function.path={fn}", "custom_reward_function.name=compute_score",
                                       "reward_model.reward_manager=naive"])
    assert (cfg.reward.kind, cfg.reward.function_path) == ("function", str(fn))
    with pytest.raises(ConfigError, match="critic.model.path=/other.*the critic starts from the actor's weights"):
        load_job_config(QUICKSTART, ["algorithm.adv_estimator=gae", "actor_rollout_ref.model.path=/m",
                                     "critic.model.path=/other"])


@pytest.mark.parametrize("item, message", [
    ("trainer.nnodes=2", "hyflow launch slurm"),
    (f"{A}.ppo_micro_batch_size=64", "give ppo_micro_batch_size_per_gpu"),
    (f"{A}.ppo_mini_batchsize=4", f"did you mean '{A}.ppo_mini_batch_size'"),
    ("trainer.logger=[console,swanlab]", "not ['swanlab']"),
    ("data.truncation=right", "data.truncation=right"),
    (f"{A}.use_dynamic_bsz=True", "needs actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
])
def test_unsupported_verl_keys_are_refused_by_name(item, message):
    with pytest.raises(ConfigError) as info:
        load_job_config(QUICKSTART, [item])
    assert message in str(info.value)


def test_verl_keys_hyflow_also_has_pass_through():
    assert lookup("algorithm.kl_ctrl.kl_coef").kind == "same"
    cfg = load_job_config(QUICKSTART, ["algorithm.kl_ctrl.kl_coef=0.01", "critic.optim.lr=2e-5",
                                       "trainer.val_before_train=False"])
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.01 and cfg.critic.optim.lr == 2e-5 and not cfg.trainer.val_before_train


def test_three_bad_keys_are_reported_in_one_run_before_any_rank():
    out = subprocess.run([sys.executable, "-m", "hyflow.cli", "train", QUICKSTART, "trainer.totl_steps=3",
                          f"{A}.ppo_micro_batch_size=8", "rollout.n=many"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2
    assert "3 config errors:" in out.stderr
    assert "unknown config key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?" in out.stderr
    assert f"verl key '{A}.ppo_micro_batch_size=8' is not supported" in out.stderr
    assert "config key 'rollout.n': expected int, got 'many'" in out.stderr
    assert "launching" not in out.stdout + out.stderr


def test_lora_keys_become_actor_lora():
    lora = "actor_rollout_ref.model"
    cfg = load_job_config(QUICKSTART, ["actor.sft_warmup_steps=0", f"{lora}.lora_rank=8",
                                       f"{lora}.target_modules=[q_proj,v_proj,down_proj]"])
    # verl's alpha default (16, not hyflow's 32); q/v live in the fused linear_qkv
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lora.targets) == (8, 16, ["linear_qkv", "linear_fc2"])
    cfg = load_job_config(QUICKSTART, ["actor.sft_warmup_steps=0", f"{lora}.lora_rank=4", f"{lora}.lora_alpha=8",
                                       f"{lora}.target_modules=all-linear"])
    assert (cfg.actor.lora.alpha, cfg.actor.lora.targets) == (8, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    cfg = load_job_config(QUICKSTART, [f"{lora}.lora_rank=0", f"{lora}.lora_alpha=16"])  # verl's off
    assert cfg.actor.lora is None and any("ignored (lora_rank is 0" in n for n in cfg.notes)
    with pytest.raises(ConfigError, match=r"unknown module\(s\) \['qproj'\]"):
        load_job_config(QUICKSTART, ["actor.sft_warmup_steps=0", f"{lora}.lora_rank=4", f"{lora}.target_modules=[qproj]"])
