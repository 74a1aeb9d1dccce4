"""HF <-> Megatron conversion on the multi-rank CPU harness: logit parity, resharding, round trip.

Tiny random models of each family (Llama with llama3 RoPE scaling; tied Llama with linear
scaling stored as pytorch_model.bin; Qwen2 with Q/K/V biases and untied embeddings in sharded
safetensors; Mistral with head_dim != hidden/heads) are converted at every TP x PP in
{1, 2} x {1, 2}; each checkpoint is loaded at its own layout and at another one, and the
Megatron logits are compared with HF transformers' on the same tokens (fp32, relative error
<= 1e-5, relative to the largest reference logit). The HF -> Megatron -> HF round trip must give
bit-identical tensors that transformers loads.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Tuple

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

FAMILIES = {"llama3": "safetensors", "llama_tied": "bin", "qwen2": "sharded", "mistral": "safetensors"}
LAYOUTS: List[Tuple[int, int]] = [(1, 1), (2, 1), (1, 2), (2, 2)]
#: every layout also loads the checkpoints written at another one (dist_checkpointing resharding)
CROSS = {(1, 1): (2, 2), (2, 1): (1, 2), (1, 2): (2, 1), (2, 2): (1, 1)}
TOLERANCE = 1e-5
RESULTS: Dict[str, float] = {}


# ----------------------------------------------------------------------------- rank functions


def _convert_all(jobs) -> list:
    from hyflow.tools.convert.hf2mcore import convert_rank

    return [convert_rank(job) for job in jobs]


def _logits_all(ckpts: List[str], tp: int, pp: int, tokens: List[List[int]]) -> list:
    from hyflow.tools.convert.verify import checkpoint_logits

    return [checkpoint_logits(ckpt, tp, pp, tokens) for ckpt in ckpts]


def _export_all(jobs) -> list:
    from hyflow.tools.convert.mcore2hf import export_rank

    return [export_rank(job) for job in jobs]


def _embedding_as(ckpt: str, dtype: str) -> torch.Tensor:
    """The word embedding (vocabulary rows only) of ``ckpt`` loaded at TP=1 in ``dtype``."""
    from hyflow.checkpoint.model import load_model_from_checkpoint
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    model, desc, _ = load_model_from_checkpoint(ckpt, init_training_groups(Layout()), dtype=dtype)
    weight = model.embedding.word_embeddings.weight
    assert weight.dtype == getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    assert not weight[desc.vocab_size:].any(), "padded rows are zero"
    return weight[: desc.vocab_size].detach().clone()


def _save_over(ckpt: str) -> str:
    """Load ``ckpt`` and save it back into the same directory without ``overwrite``."""
    from hyflow.checkpoint.model import CheckpointError, load_model_from_checkpoint, save_model_checkpoint
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    groups = init_training_groups(Layout())
    model, desc, _ = load_model_from_checkpoint(ckpt, groups)
    try:
        save_model_checkpoint(model, ckpt, groups, desc)
    except CheckpointError as e:
        return str(e)
    return ""


def _tp_attributes(tp: int) -> Tuple[dict, dict]:
    """TP attributes of a randomly initialised model and of one built for loading."""
    from hyflow.models.builder import build_gpt_model
    from hyflow.checkpoint.model import build_model_for_loading
    from hyflow.models.description import tiny_llama
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    desc = tiny_llama(tied_embeddings=False, qkv_bias=True)
    groups = init_training_groups(Layout(tp=tp))

    def attrs(model) -> dict:
        return {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1),
                    getattr(p, "partition_stride", 1)) for n, p in model.named_parameters()}

    return attrs(build_gpt_model(desc, groups, seed=0)), attrs(build_model_for_loading(desc, groups))


def _load_into_other_model(ckpt: str) -> str:
    from hyflow.checkpoint.model import CheckpointError, build_model_for_loading, load_model_checkpoint
    from hyflow.models.description import ModelDescription
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    desc = ModelDescription.load(ckpt)
    desc.num_layers, desc.ffn_hidden_size = 2, 128
    groups = init_training_groups(Layout())
    model = build_model_for_loading(desc, groups)
    try:
        load_model_checkpoint(model, ckpt, groups, desc)
    except CheckpointError as e:
        return str(e)
    return ""


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Dict[str, Any]:
    """Tiny HF models on disk and their reference logits on fixed tokens."""
    pytest.importorskip("transformers")
    from hyflow.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("hf_src")
    tokens = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    out: Dict[str, Any] = {"tokens": tokens.tolist(), "path": {}, "logits": {}}
    for name, fmt in FAMILIES.items():
        model = make_tiny_hf_model(str(root / name), name, weights_format=fmt)
        out["path"][name] = str(root / name)
        with torch.no_grad():
            out["logits"][name] = model(tokens).logits.float()
    return out


def _plan_jobs(src: Dict[str, str], root, tp: int, pp: int, dtype: str = "auto"):
    from hyflow.tools.convert.hf2mcore import prepare_conversion

    jobs, dirs = [], {}
    for name, path in src.items():
        out = str(root / f"{name}_tp{tp}pp{pp}")
        jobs.append(prepare_conversion(path, out, tp=tp, pp=pp, dtype=dtype)[1])
        dirs[name] = out
    return jobs, dirs


@pytest.fixture(scope="module")
def checkpoints(sources, tmp_path_factory) -> Dict[Tuple[str, Tuple[int, int]], str]:
    """Every family converted at every layout: (name, (tp, pp)) -> checkpoint directory."""
    root = tmp_path_factory.mktemp("mcore")
    out = {}
    for tp, pp in LAYOUTS:
        jobs, dirs = _plan_jobs(sources["path"], root, tp, pp)
        memory = run_on_ranks(_convert_all, tp * pp, jobs, timeout=300)
        assert len(memory) == tp * pp and all(m[0].peak >= m[0].baseline for m in memory)
        out.update({(name, (tp, pp)): path for name, path in dirs.items()})
    return out


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_logits_match_hf(layout, sources, checkpoints) -> None:
    tp, pp = layout
    names = list(FAMILIES)
    ckpts = [checkpoints[(n, layout)] for n in names] + [checkpoints[(n, CROSS[layout])] for n in names]
    per_rank = run_on_ranks(_logits_all, tp * pp, ckpts, tp, pp, sources["tokens"], timeout=300)
    last = per_rank[-1]  # the last rank is on the last pipeline stage
    assert all(x is None for x in per_rank[0][: len(ckpts)]) or pp == 1
    for i in range(len(ckpts)):
        name = names[i % len(names)]
        written = layout if i < len(names) else CROSS[layout]
        ref = sources["logits"][name]
        assert last[i].shape == ref.shape
        err = _rel_error(last[i], ref)
        RESULTS[f"{name} written tp{written[0]}pp{written[1]} loaded tp{tp}pp{pp}"] = err
        assert err <= TOLERANCE, (name, written, layout, err)
        assert int(last[i].argmax(-1).ne(ref.argmax(-1)).sum()) == 0
    print("\n".join(f"max rel logit error {k}: {v:.2e}" for k, v in sorted(RESULTS.items())
                    if k.endswith(f"loaded tp{tp}pp{pp}")))


def _read_all(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
        elif f.endswith(".bin"):
            out.update(torch.load(os.path.join(path, f), weights_only=True))
    return out


def test_round_trip_is_bit_identical_and_loads_in_transformers(sources, checkpoints, tmp_path) -> None:
    from hyflow.tools.convert.mcore2hf import prepare_export

    jobs, outs = [], {}
    for name in FAMILIES:
        outs[name] = str(tmp_path / name)
        _, job = prepare_export(checkpoints[(name, (2, 2))], outs[name])
        jobs.append(job)
    run_on_ranks(_export_all, 1, jobs, timeout=300)
    check_round_trip(sources, outs)


def check_round_trip(sources: Dict[str, Any], outs: Dict[str, str]) -> None:
    """Each exported directory of ``outs`` holds its source's tensors bit for bit, and transformers
    loads it with the source's logits."""
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor(sources["tokens"])
    for name, out in outs.items():
        src, back = _read_all(sources["path"][name]), _read_all(out)
        assert sorted(src) == sorted(back), name
        for key in src:
            assert src[key].dtype == back[key].dtype and torch.equal(src[key], back[key]), (name, key)
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            assert torch.equal(model(tokens).logits.float(), sources["logits"][name]), name


def test_bf16_round_trip(tmp_path) -> None:
    """bf16 weights stay bf16 (dtype auto) and come back bit-identical through TP=2."""
    from hyflow.checkpoint.model import read_checkpoint_info
    from hyflow.tools.convert.mcore2hf import prepare_export
    from hyflow.testing.tiny_models import make_tiny_hf_model

    make_tiny_hf_model(str(tmp_path / "src"), "qwen2", dtype=torch.bfloat16)
    jobs, dirs = _plan_jobs({"qwen2": str(tmp_path / "src")}, tmp_path, 2, 1)
    run_on_ranks(_convert_all, 2, jobs, timeout=300)
    info = read_checkpoint_info(dirs["qwen2"])
    assert (info.dtype, info.tp, info.pp, info.padded_vocab_size) == ("bf16", 2, 1, 512)
    _, job = prepare_export(dirs["qwen2"], str(tmp_path / "back"))
    run_on_ranks(_export_all, 1, [job], timeout=300)
    src, back = _read_all(str(tmp_path / "src")), _read_all(str(tmp_path / "back"))
    assert sorted(src) == sorted(back)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(src[k], back[k]) for k in src)
    widened = run_on_ranks(_embedding_as, 1, dirs["qwen2"], "fp32")[0]  # bf16 checkpoint, fp32 model
    assert torch.equal(widened, src["model.embed_tokens.weight"].float())


def test_tensor_parallel_attributes_match_megatron_init() -> None:
    initialised, for_loading = run_on_ranks(_tp_attributes, 2, 2)[0]
    assert initialised == for_loading
    assert initialised["decoder.layers.0.mlp.linear_fc1.weight"] == (True, 0, 2)


def test_checkpoint_errors(checkpoints, tmp_path) -> None:
    from hyflow.models.sources.errors import ConversionError
    from hyflow.tools.convert.preflight import plan_mcore2hf

    ckpt = checkpoints[("llama3", (2, 2))]
    message = run_on_ranks(_load_into_other_model, 1, ckpt)[0]
    assert "does not fit the model" in message and "num_layers: checkpoint 4 vs model 2" in message
    assert "ffn_hidden_size: checkpoint 96 vs model 128" in message
    assert "already holds a checkpoint" in run_on_ranks(_save_over, 1, ckpt)[0]

    def broken(label: str, damage) -> str:
        copy = str(tmp_path / label)
        shutil.copytree(ckpt, copy)
        damage(copy)
        return copy

    no_marker = broken("no_marker", lambda d: os.remove(os.path.join(d, "hyflow_checkpoint.json")))
    with pytest.raises(ConversionError, match="is incomplete: it has Megatron checkpoint files"):
        plan_mcore2hf(no_marker, str(tmp_path / "o1"))
    data = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))[-1]
    missing = broken("missing", lambda d: os.remove(os.path.join(d, data)))
    with pytest.raises(ConversionError, match=f"is incomplete: data file {data} is missing"):
        plan_mcore2hf(missing, str(tmp_path / "o2"))

    def cut(d: str) -> None:
        with open(os.path.join(d, data), "r+b") as f:
            f.truncate(100)

    with pytest.raises(ConversionError, match=f"is damaged: {data} has 100 bytes"):
        plan_mcore2hf(broken("cut", cut), str(tmp_path / "o3"))

    def flip(d: str) -> None:  # same size, one byte changed: only the manifest's checksum sees it
        with open(os.path.join(d, data), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(d, data)) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))

    with pytest.raises(ConversionError, match=f"{data} does not match its checksum in manifest.json"):
        plan_mcore2hf(broken("flip", flip), str(tmp_path / "o4"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConversionError, match="exists and is not empty"):
        plan_mcore2hf(ckpt, str(tmp_path / "full"))
