"""``hyflow generate`` and ``hyflow bench rollout`` end to end (subprocesses), plus config checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hyflow.config import ConfigError
from hyflow.rollout.config import GenerationConfig, SamplingConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hyflow(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hyflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("changes, key", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_sampling_config_errors_name_the_key(changes, key):
    with pytest.raises(ConfigError) as info:
        SamplingConfig(**changes).validate()
    assert info.value.key == key


def test_rollout_config_errors_and_job_mapping():
    with pytest.raises(ConfigError) as info:
        GenerationConfig(max_seq_len=64, max_prompt_length=64).validate()
    assert info.value.key == "max_prompt_length"
    with pytest.raises(ConfigError):
        GenerationConfig(batching="dynamic").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        GenerationConfig(prefill_chunk_size=-1).validate()

    from hyflow.jobs.rl_config import RolloutConfig  # the RL job's section: the generation settings and more

    job = RolloutConfig(n=4, max_new_tokens=32, temperature=0.7, top_k=20, top_p=0.9, stop_token_ids=[7],
                        truncate_long_prompts=True, prefill_chunk_size=16, max_concurrent=8)
    cfg = GenerationConfig.from_settings(job, pad_token_id=3)
    assert (cfg.sampling.n, cfg.sampling.top_k, cfg.sampling.stop_token_ids) == (4, 20, [7])
    assert (cfg.max_concurrent, cfg.prefill_chunk_size, cfg.truncate_long_prompts, cfg.pad_token_id) == \
        (8, 16, True, 3)


def test_generate_command_on_a_hf_directory(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.1, eos_token_id=299)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": p}) for p in ([5, 6, 7], [9] * 11)) + "\n")
    out = tmp_path / "out.jsonl"
    proc = _hyflow("generate", "--hf", str(tmp_path / "hf"), "--prompts", str(prompts), "--max-new-tokens", "6",
                   "--ignore-eos", "--n", "2", "--temperature", "0.7", "--top-p", "0.9", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(len(r["token_ids"]) == 6 and len(r["logprobs"]) == 6 for r in rows)
    assert all(r["finish_reason"] == "length" for r in rows)
    ids = torch.tensor([[5, 6, 7] + rows[0]["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0] / 0.7, dim=-1)
    want = logp[torch.arange(2, 8), torch.tensor(rows[0]["token_ids"])]
    assert torch.allclose(want, torch.tensor(rows[0]["logprobs"]), atol=1e-4)
    # The same request on 2 tensor-parallel ranks (started through torchrun, whose own parser must
    # not see options such as --n): sampling is keyed by request, so the samples are the same.
    out_tp2 = tmp_path / "out_tp2.jsonl"
    proc = _hyflow("generate", "--hf", str(tmp_path / "hf"), "--prompts", str(prompts), "--max-new-tokens", "6",
                   "--ignore-eos", "--n", "2", "--temperature", "0.7", "--top-p", "0.9", "--output", str(out_tp2),
                   "--tp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows_tp2 = [json.loads(line) for line in out_tp2.read_text().splitlines()]
    assert [r["token_ids"] for r in rows_tp2] == [r["token_ids"] for r in rows]
    assert max(abs(a - b) for r, q in zip(rows, rows_tp2) for a, b in zip(r["logprobs"], q["logprobs"])) < 1e-4
    bad = _hyflow("generate", "--hf", str(tmp_path / "hf"), "--prompts", str(tmp_path / "missing.jsonl"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_bench_rollout_prints_a_table_then_json():
    proc = _hyflow("bench", "rollout", "--model", "tiny", "--batch", "4", "--new-tokens", "8", "--repeats", "1",
                   "--compare-batching")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    row = json.loads(lines[-1])
    for key in ("tokens_per_s", "hf_tokens_per_s", "speedup", "tokens_per_s_median", "speedup_median"):
        assert row[key] > 0
    assert row["greedy_match"] == "4/4"
    assert set(row["batching"]) == {"continuous", "static"}
    assert any("transformers generate" in line for line in lines)


def test_make_task_writes_rl_rows_and_names_bad_options(tmp_path, capsys):
    from hyflow.cli import main
    from hyflow.data.dataset import read_rows
    from hyflow.data.tasks import make_task_rows

    out = str(tmp_path / "eval.jsonl")
    assert main(["make-task", "arithmetic", "--size", "5", "--seed", "7", "--out", out, "ops=+-",
                 "max_operand=20"]) == 0
    assert read_rows(out) == make_task_rows("arithmetic", 5, seed=7, ops="+-", max_operand=20)
    assert main(["make-task", "arithmetic", "--out", out, "op=+"]) == 2
    assert "has no option op; its options: ops, max_operand, max_factor" in capsys.readouterr().err
    assert main(["make-task", "arith", "--out", out]) == 2
    assert "unknown task 'arith'" in capsys.readouterr().err


def test_generate_reads_rl_rows_and_scores_responses_against_ground_truth(tmp_path):
    from types import SimpleNamespace

    from hyflow.data.tokenizer import load_tokenizer
    from hyflow.rollout.cli import read_ground_truths, read_prompts, reward_manager, reward_scores
    from hyflow.testing.fixtures import write_tiny_hf_tokenizer

    tok = load_tokenizer(write_tiny_hf_tokenizer(str(tmp_path / "tok")))
    rows = [{"prompt": [{"role": "user", "content": "what is 2 + 3 ?"}], "reward_model": {"ground_truth": "5"}},
            {"prompt": "what is 2", "ground_truth": 2, "extra_info": {"k": 1}},
            {"prompt_ids": [4, 7], "reward_model": {"ground_truth": "3"}}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_prompts(str(path), tok, chat=False) == [
        tok.encode_chat(rows[0]["prompt"]), tok.encode_prompt_texts(["what is 2"])[0], [4, 7]]
    truths = read_ground_truths(str(path))
    assert truths == [("5", {}), (2, {"k": 1}), ("3", {})]
    samples = [SimpleNamespace(request_index=i) for i in (0, 0, 1, 2)]    # n=2 for the first prompt
    texts = ["The answer is 5.", "6", "2.0", "three"]
    assert reward_scores(samples, texts, truths, reward_manager("numeric_match")) == [1.0, 0.0, 1.0, 0.0]
    # verl's compute_score file, with the rows' data sources
    fn = tmp_path / "score.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return float(data_source == 'src' and str(ground_truth) in solution_str)\n")
    assert reward_scores(samples, texts, truths, reward_manager(str(fn)), ["src", "other", "src"]) == \
        [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        reward_manager("nope")
    path.write_text(json.dumps({"prompt": "what is 2"}) + "\n")
    with pytest.raises(ValueError, match="row 0 has no reward_model.ground_truth"):
        read_ground_truths(str(path))
