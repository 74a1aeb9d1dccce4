"""GGUF reading: tiny Llama (permuted Q/K, tied) and Qwen2 (biases, untied) GGUF files.

The files are written with the ``gguf`` package following llama.cpp's converter conventions
(tensor names, innermost-first shapes, the per-head Q/K row permutation for ``llama``). The
converter's GGUF source must return the original HF tensors exactly, agree with transformers'
own GGUF loader, and describe the same model as the HF config.
"""
from __future__ import annotations

import os

import pytest
import torch

from hyflow.models.hf_mapping import description_from_hf_config
from hyflow.models.sources.gguf_source import _LAYER_TENSORS, GGUFSource
from hyflow.tools.convert.preflight import plan_hf2mcore

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {hf: g for g, hf in _LAYER_TENSORS.items()}


def _write_gguf(model, path: str, arch: str) -> None:
    """Save an HF model as llama.cpp's converter would (float32, no quantization)."""
    cfg = model.config
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.rope_parameters.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = tensor.detach().float()
        if name in _GLOBAL:
            gname = _GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_LAYER[rest]}"
            if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).transpose(1, 2)
                t = t.reshape(tensor.shape)
        w.add_tensor(gname, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name,arch", [("llama_tied", "llama"), ("qwen2", "qwen2")])
def test_gguf_source_returns_the_hf_tensors(name: str, arch: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from hyflow.testing.tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model(str(tmp_path / "hf"), name)
    path = str(tmp_path / f"{name}.gguf")
    _write_gguf(model, path, arch)
    source = GGUFSource(path)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert sorted(source.names()) == sorted(state)
    for key, tensor in state.items():
        assert source.shape(key) == tuple(tensor.shape)
        assert torch.equal(source.read(key), tensor), key
    q = "model.layers.1.self_attn.q_proj.weight"
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert torch.equal(source.read_rows(q, head_dim, 3 * head_dim), state[q][head_dim:3 * head_dim])
    assert torch.equal(source.read_rows(q, 3, 9), state[q][3:9])  # not head-aligned: full read

    plan = plan_hf2mcore(path, str(tmp_path / "out"), tp=2)
    expected = description_from_hf_config(model.config.to_dict())
    expected.eos_token_ids = [2]
    assert plan.desc.norm_eps == pytest.approx(expected.norm_eps)  # stored as float32
    expected.norm_eps = plan.desc.norm_eps
    assert plan.desc == expected

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).state_dict()
    assert all(torch.equal(reference[k], v) for k, v in state.items())
