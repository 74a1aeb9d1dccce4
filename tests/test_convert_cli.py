"""``hyflow convert`` end to end in fresh processes: HF -> TP=2 checkpoint -> HF, with memory reports.

A 41.6M-parameter (159 MiB fp32) Llama in two safetensors shards, written directly with
safetensors, goes through both CLI commands; the round trip must be bit-identical, the
tokenizer files must travel along, and the peak host memory each command reports (per process,
above its import-time baseline) must stay within what the layout needs: each TP rank about its half
of the model, the launching process nothing, under 1.75x the model in all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16000,
          "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"x": 1}'}


def _write_source(path: str) -> dict:
    from safetensors.torch import save_file

    from hyflow.models.hf_mapping import description_from_hf_config, hf_parameter_shapes

    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    for name, text in TOKENIZER_FILES.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) * 0.02
               for n, s in hf_parameter_shapes(description_from_hf_config(CONFIG)).items()}
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tensors


def _hyflow(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hyflow.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_cli_round_trip_with_memory_report(tmp_path) -> None:
    from safetensors.torch import load_file

    src, ckpt, back = str(tmp_path / "src"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    tensors = _write_source(src)

    run = _hyflow("convert", "hf2mcore", "--hf", src, "--out", ckpt, "--tp", "2", "--report",
                  "--report-json", str(tmp_path / "to_mcore.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "peak memory for the conversion" in run.stdout
    with open(os.path.join(ckpt, "hyflow_checkpoint.json")) as f:
        info = json.load(f)
    assert (info["tp"], info["pp"], info["dtype"]) == (2, 1, "fp32")
    assert sorted(os.listdir(os.path.join(ckpt, "tokenizer"))) == sorted(TOKENIZER_FILES)

    again = _hyflow("convert", "hf2mcore", "--hf", src, "--out", ckpt)
    assert again.returncode == 2 and "exists and is not empty; pass --force" in again.stderr

    run = _hyflow("convert", "mcore2hf", "--ckpt", ckpt, "--out", back, "--report-json",
                  str(tmp_path / "to_hf.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    out = load_file(os.path.join(back, "model.safetensors"))
    assert sorted(out) == sorted(tensors)
    assert all(torch.equal(out[n], tensors[n]) for n in tensors)
    for name, text in TOKENIZER_FILES.items():
        with open(os.path.join(back, name)) as f:
            assert f.read() == text
    with open(os.path.join(back, "config.json")) as f:
        config = json.load(f)
    assert {k: config[k] for k in CONFIG} == CONFIG

    model = 41_558_528 * 4
    reports = {}
    for report in ("to_mcore.json", "to_hf.json"):
        with open(tmp_path / report) as f:
            data = reports[report] = json.load(f)
        print(f"\n{report}: model {data['model_bytes'] / 2**20:.1f} MiB, conversion peak "
              f"{data['above_baseline'] / 2**20:.1f} MiB = {data['ratio']:.2f}x, {data['seconds']:.1f}s, "
              + ", ".join(f"{n} {(p['peak'] - p['baseline']) / 2**20:.1f} MiB"
                          for n, p in zip(data["names"], data["processes"])))
        assert data["model_bytes"] == model
    # Peak RSS above each process's baseline (27.11.2026, this 159 MiB model). hf2mcore --tp 2: the
    # launcher 0.1 MiB, each rank 115-120 MiB (its half of the model, one 16 MiB read block, Megatron's
    # save), 1.45-1.51x in all. Between the MoE merge and its fix the pre-flight loaded Megatron in the
    # launcher (+232 MiB there: 2.9x in all), which the launcher's bound catches.
    to_mcore = reports["to_mcore.json"]
    assert to_mcore["names"] == ["launcher", "rank 0", "rank 1"]
    launcher, *ranks = (p["peak"] - p["baseline"] for p in to_mcore["processes"])
    assert launcher < 0.1 * model, to_mcore
    assert all(model / 4 < rank < model / 2 + 64 * 2**20 for rank in ranks), to_mcore
    assert to_mcore["ratio"] < 1.75, to_mcore
    # mcore2hf: one process holds the model at TP=1 (the HF files are whole tensors), plus Megatron's
    # load (its gate / up merge copies linear_fc1) and the Q/K/V copies: 1.31-1.36x.
    assert 0.9 < reports["to_hf.json"]["ratio"] < 1.6, reports["to_hf.json"]
