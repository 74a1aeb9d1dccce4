"""``hyflow export``: a trained RL checkpoint's actor -> HF directory that transformers loads and
that decodes greedily exactly as hyflow's own generation engine does on the checkpoint."""

import os

import pytest

from hyflow.cli import main
from hyflow.testing import run_on_ranks
from hyflow.testing.fixtures import engine_greedy_tokens

pytestmark = pytest.mark.multirank

CONFIG = """\
job: rl
model: {family: llama, vocab_size: 128, hidden_size: 32, num_layers: 2, num_attention_heads: 4,
        num_query_groups: 2, ffn_hidden_size: 64, max_position_embeddings: 32}
actor: {layout: {tp: 2, pp: 1}, micro_batch_size: 4, mini_batch_size: 8, sft_warmup_steps: 4, sft_lr: 3.0e-3}
rollout: {layout: {tp: 1, pp: 1}, n: 2, max_prompt_length: 16, max_new_tokens: 4}
reward: {kind: rule, rule: exact_match}
data: {task: digit_add, task_size: 64, train_batch_size: 4}
trainer: {total_steps: 1, nproc: 2, log_every: 1, loggers: [console]}
"""
PROMPTS = [[5, 17, 33, 9], [60, 2], [101, 44, 44, 7, 80]]
NEW_TOKENS = 6


def _train(config: str, out: str) -> None:
    """Rank function: one RL step after an SFT warm-up, checkpointed at the end."""
    import torch

    from hyflow.jobs.registry import load_job_config
    from hyflow.jobs.rl import run

    torch.set_num_threads(1)
    run(load_job_config(config, [f"trainer.output_dir={out}"]))


def test_export_loads_in_transformers_with_same_greedy_tokens(tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    config = tmp_path / "export.yaml"
    config.write_text(CONFIG)
    run = str(tmp_path / "run")
    run_on_ranks(_train, 2, str(config), run, timeout=600)
    hf = str(tmp_path / "hf")
    assert main(["export", "--ckpt", run, "--out", hf]) == 0
    assert os.path.exists(os.path.join(hf, "config.json"))
    model_dir = os.path.join(run, "checkpoints", "step_000001", "actor")
    assert model_dir in capsys.readouterr().err

    expected = run_on_ranks(engine_greedy_tokens, 2, model_dir, PROMPTS, NEW_TOKENS, timeout=300)[0]
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    for prompt, want in zip(PROMPTS, expected):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == want, prompt


def test_export_finds_the_actor_checkpoint(tmp_path):
    from hyflow.tools.convert.export import find_model_checkpoint

    step = tmp_path / "run" / "checkpoints" / "step_000003"
    (step / "actor").mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    (step / "COMPLETE").write_text('{"step": 3}')
    (step / "actor" / "hyflow_checkpoint.json").write_text("{}")
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints", step, step / "actor"):
        assert find_model_checkpoint(str(given)) == str(step / "actor")


def test_export_errors_name_the_problem(tmp_path, capsys):
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    assert main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"skipping incomplete checkpoint {step}" in err
    assert "no complete checkpoint" in err
    assert main(["export", "--ckpt", str(tmp_path / "nowhere"), "--out", str(tmp_path / "hf")]) == 2
    assert "does not exist" in capsys.readouterr().err
