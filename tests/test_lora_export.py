"""Exporting a LoRA checkpoint (saved at TP=2 on a tiny random GQA Llama converted from HF):

* ``hyflow export --adapter`` writes a PEFT directory that ``peft`` loads onto the HF base, and the
  PEFT model's greedy tokens equal hyflow's generation engine on the LoRA checkpoint (which loads
  the base it references, the adapters, and merges them);
* ``hyflow export`` (``--merge``) writes the merged HF model, with the same greedy tokens;
* adapters trained on the HF model read directly (``actor.checkpoint`` an HF directory) load, decode
  and export the same way, their base identified by the HF files;
* adapters whose recorded base checksum does not match the base fail with one error.
"""

import json
import os

import pytest
import torch

from hyflow.cli import main
from hyflow.testing import run_on_ranks
from hyflow.testing.fixtures import engine_greedy_tokens

pytestmark = pytest.mark.multirank

PROMPTS = [[5, 17, 33, 9], [60, 2], [101, 44, 44, 7, 80]]
NEW_TOKENS = 6


def _adapt_and_save(bases: list) -> None:
    """Rank function (TP=2): for each (base, out) the base (a hyflow checkpoint or an HF directory, as
    ``actor.checkpoint`` takes it), the same LoRA adapters set to large random values, saved to out."""
    for base_dir, lora_dir in bases:
        _adapt_and_save_one(base_dir, lora_dir)


def _adapt_and_save_one(base_dir: str, lora_dir: str) -> None:
    from hyflow.checkpoint.model import adapter_base, build_model_for_loading, save_model_checkpoint
    from hyflow.checkpoint.starting_weights import load_starting_weights, starting_description
    from hyflow.models.lora import apply_lora
    from hyflow.models.lora_config import LoRAConfig
    from hyflow.models.weights import gather_full_state_dict, load_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    groups = init_training_groups(Layout(tp=2))
    desc = starting_description(base_dir)
    model = build_model_for_loading(desc, groups, spec="local")
    load_starting_weights(model, base_dir, groups, desc)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0), seed=3, base=adapter_base(base_dir, 0))
    full = gather_full_state_dict(model, desc, groups)
    gen = torch.Generator().manual_seed(1)
    full = {k: (torch.randn(v.shape, generator=gen) * (0.3 if k.endswith("lora_B") else 1.0) if ".lora_" in k else v)
            for k, v in full.items()}
    load_full_state_dict(model, full, desc, groups)
    save_model_checkpoint(model, lora_dir, groups, desc)


def _greedy(model) -> list:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
        out.append(tokens[0, len(prompt):].tolist())
    return out


def _engine_greedy_each(model_dirs: list) -> list:
    """Rank function: :func:`engine_greedy_tokens` of each checkpoint, in one set of processes."""
    return [engine_greedy_tokens(d, PROMPTS, NEW_TOKENS) for d in model_dirs]


def test_peft_adapter_and_merged_export_decode_like_hyflow(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_base = str(tmp_path / "hf_base")
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 initializer_range=0.1, tie_word_embeddings=False)).save_pretrained(hf_base)
    base_dir, lora_dir = str(tmp_path / "base"), str(tmp_path / "lora")
    assert main(["convert", "hf2mcore", "--hf", hf_base, "--out", base_dir]) == 0
    lora_hf = str(tmp_path / "lora_hf")  # the same adapters on the HF model read directly
    run_on_ranks(_adapt_and_save, 2, [(base_dir, lora_dir), (hf_base, lora_hf)], timeout=600)
    with open(os.path.join(lora_dir, "hyflow_checkpoint.json")) as f:
        saved = json.load(f)["extra"]["lora"]
    assert saved["base"]["checkpoint"] == os.path.abspath(base_dir) and len(saved["base"]["sha256"]) == 64
    with open(os.path.join(lora_hf, "hyflow_checkpoint.json")) as f:
        saved_hf = json.load(f)["extra"]["lora"]["base"]  # an HF base is identified by its files
    assert saved_hf["checkpoint"] == os.path.abspath(hf_base) and len(saved_hf["hf_files"]) == 64

    peft_dir = str(tmp_path / "peft")
    assert main(["export", "--ckpt", lora_dir, "--out", peft_dir, "--adapter"]) == 0
    assert sorted(os.listdir(peft_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    expected, on_hf_base = run_on_ranks(_engine_greedy_each, 2, [lora_dir, lora_hf], timeout=300)[0]
    assert on_hf_base == expected  # generate / export load an HF base too
    base = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32).eval()
    base_tokens = _greedy(base)
    assert base_tokens != expected  # the adapters change what the model says
    peft = PeftModel.from_pretrained(base, peft_dir).eval()
    assert _greedy(peft) == expected

    merged_dir = str(tmp_path / "merged")
    assert main(["export", "--ckpt", lora_dir, "--out", merged_dir, "--merge"]) == 0
    assert "LoRA checkpoint: writing the base with the adapters merged" in capsys.readouterr().err
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert _greedy(merged) == expected

    # adapters recorded on other base files: one error naming both, nothing exported
    info = os.path.join(lora_dir, "hyflow_checkpoint.json")
    data = json.load(open(info))
    data["extra"]["lora"]["base"]["sha256"] = "0" * 64
    json.dump(data, open(info, "w"))
    assert main(["export", "--ckpt", lora_dir, "--out", str(tmp_path / "bad"), "--merge"]) == 2
    assert "holds LoRA adapters trained on the base" in capsys.readouterr().err
    assert main(["export", "--ckpt", base_dir, "--out", str(tmp_path / "bad2"), "--adapter"]) == 2
    assert "holds a whole model, not LoRA adapters" in capsys.readouterr().err
