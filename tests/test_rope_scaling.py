"""RoPE scaling families (yarn, dynamic NTK, longrope, llama3, linear) against transformers.

* frequencies and attention factors are bit-identical to the ones HF's rotary module uses for
  a forward of the same length (dynamic NTK and longrope depend on it);
* tiny random HF models (yarn written with the legacy ``type`` spelling, dynamic NTK,
  longrope; original context 64) converted with ``hf2mcore`` at TP=2 give HF's logits at
  positions far past the original context (160 tokens), fp32, <= 1e-5 relative, loaded at
  TP=2 and at TP=1; ``mcore2hf`` writes a config transformers loads with the same scaling
  (and bit-identical weights, so identical logits);
* generation (KV cache, lean and Megatron layer paths) uses the training frequencies: greedy
  tokens equal HF ``generate`` across the original context boundary, and for the
  length-independent families the sampled log-probs equal a full forward.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

import pytest
import torch

from hyflow.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

LONG = ("qwen2_yarn", "llama_dynamic", "llama_longrope")
SHORT_LEN, LONG_LEN = 40, 160  # original context of the tiny long-context models: 64
TOLERANCE = 1e-5


def _hf_rotary(params: dict, max_pos: int = 256, head_dim: int = 64):
    cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=params,
                                   max_position_embeddings=max_pos)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return cfg, LlamaRotaryEmbedding(cfg)


VARIANTS = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 100, "attention_factor": 1.3,
     "truncate": False},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 3.7},
    {"rope_type": "longrope", "original_max_position_embeddings": 64, "factor": 4.0,
     "short_factor": [1.0 + i / 40 for i in range(32)], "long_factor": [1.0 + i / 8 for i in range(32)]},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "default"},
]


@pytest.mark.parametrize("params", VARIANTS, ids=lambda p: "-".join(f"{v}" for v in list(p.values())[:2]))
@pytest.mark.parametrize("length", [30, 256, 257, 1000])
def test_frequencies_bit_identical_to_transformers(params, length):
    from hyflow.models import rope
    from hyflow.models.hf_mapping import description_from_hf_config

    cfg, hf = _hf_rotary({**params, "rope_theta": 50000.0})
    positions = torch.arange(length).unsqueeze(0)
    hf(torch.zeros(1, length, 8), positions)  # dynamic / longrope update their frequencies here
    desc = description_from_hf_config({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert torch.equal(desc.inv_freq(length), hf.inv_freq)
    assert rope.attention_factor(desc) == hf.attention_scaling
    assert desc.rope_length_dependent == (params["rope_type"] in ("dynamic", "longrope"))


@pytest.mark.parametrize("name", ["qwen2_yarn", "llama_dynamic", "llama_longrope"])
@pytest.mark.parametrize("spelling", ["type", "rope_type"])
def test_hf_config_round_trip_keeps_the_scaling(name, spelling):
    from hyflow.models.hf_mapping import description_from_hf_config, hf_config_from_description
    from hyflow.testing.tiny_models import TINY_MODELS, tiny_hf_config

    scaling = dict(TINY_MODELS[name][1]["rope_scaling"])
    kind = scaling.pop("type", None) or scaling.pop("rope_type")
    cfg = tiny_hf_config(name, rope_scaling={spelling: kind, **scaling}).to_dict()
    desc = description_from_hf_config(cfg)
    assert desc.rope_scaling.type == kind and desc.rope_scaling.factor == 4.0
    written = hf_config_from_description(desc)
    assert written["rope_scaling"]["type"] == written["rope_scaling"]["rope_type"] == kind
    loaded = transformers.AutoConfig.for_model(written["model_type"], **{
        k: v for k, v in written.items() if k not in ("model_type", "dtype")})
    assert description_from_hf_config(loaded.to_dict()) == desc
    want = {k: v for k, v in cfg["rope_parameters"].items() if k != "type"}
    got = {k: v for k, v in loaded.rope_parameters.items() if k != "type"}
    for key, value in want.items():  # every key of the source survives (values as floats)
        assert got.get(key) == value, (key, got.get(key), value)


def test_unsupported_or_incomplete_scaling_is_named():
    from hyflow.models.description import ModelDescriptionError, tiny_llama
    from hyflow.models.hf_mapping import description_from_hf_config
    from hyflow.testing.tiny_models import tiny_hf_config

    cfg = tiny_hf_config("llama_dynamic").to_dict()
    cfg["rope_parameters"] = None
    with pytest.raises(ModelDescriptionError, match="rope_scaling type 'proportional' is not supported"):
        description_from_hf_config({**cfg, "rope_scaling": {"rope_type": "proportional", "factor": 2.0}})
    with pytest.raises(ModelDescriptionError, match="needs a 'factor'"):
        description_from_hf_config({**cfg, "rope_scaling": {"type": "dynamic"}})
    with pytest.raises(ModelDescriptionError, match=r"short_factor of longrope must be 8 numbers"):
        tiny_llama(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 8})
    with pytest.raises(ModelDescriptionError, match="beta_fast >= beta_slow"):
        tiny_llama(rope_scaling={"type": "yarn", "factor": 2.0, "beta_fast": 1.0, "beta_slow": 4.0})


# ----------------------------------------------------------------------------- conversion


def _convert_all(jobs) -> list:
    from hyflow.tools.convert.hf2mcore import convert_rank

    return [convert_rank(job) for job in jobs]


def _logits_all(ckpts, tp: int, tokens) -> list:
    from hyflow.tools.convert.verify import checkpoint_logits

    return [[checkpoint_logits(c, tp, 1, t) for t in tokens] for c in ckpts]


def _export_all(jobs) -> list:
    from hyflow.tools.convert.mcore2hf import export_rank

    return [export_rank(job) for job in jobs]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Dict[str, Any]:
    """Tiny long-context HF models, their logits on a short and a long batch, converted at TP=2."""
    from hyflow.tools.convert.hf2mcore import prepare_conversion
    from hyflow.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("rope")
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 300, (2, n), generator=gen).tolist() for n in (SHORT_LEN, LONG_LEN)]
    out: Dict[str, Any] = {"tokens": tokens, "src": {}, "logits": {}, "ckpt": {}}
    jobs = []
    for name in LONG:
        src = str(root / name)
        model = make_tiny_hf_model(src, name)
        out["src"][name] = src
        with torch.no_grad():  # a fresh HF model per batch: its dynamic rotary caches lengths
            out["logits"][name] = [copy.deepcopy(model)(torch.tensor(t)).logits for t in tokens]
        out["ckpt"][name] = str(root / f"{name}_mcore")
        jobs.append(prepare_conversion(src, out["ckpt"][name], tp=2, pp=1)[1])
    run_on_ranks(_convert_all, 2, jobs, timeout=600)
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 1])
def test_converted_logits_match_hf_past_the_original_context(converted, tp):
    ckpts = [converted["ckpt"][n] for n in LONG]
    got = run_on_ranks(_logits_all, tp, ckpts, tp, converted["tokens"], timeout=600)[0]
    for i, name in enumerate(LONG):
        for j, length in enumerate((SHORT_LEN, LONG_LEN)):
            ref = converted["logits"][name][j]
            assert got[i][j].shape == ref.shape
            assert _rel(got[i][j], ref) <= TOLERANCE, (name, length, tp, _rel(got[i][j], ref))


@pytest.mark.multirank
def test_mcore2hf_writes_a_config_transformers_loads_with_the_same_scaling(converted, tmp_path):
    from hyflow.tools.convert.mcore2hf import prepare_export

    jobs, outs = [], {}
    for name in LONG:
        outs[name] = str(tmp_path / name)
        jobs.append(prepare_export(converted["ckpt"][name], outs[name])[1])
    run_on_ranks(_export_all, 1, jobs, timeout=600)
    for name in LONG:
        src = transformers.AutoConfig.from_pretrained(converted["src"][name])
        model = transformers.AutoModelForCausalLM.from_pretrained(outs[name]).eval()
        want = {k: v for k, v in src.rope_parameters.items() if k != "type"}
        got = {k: v for k, v in model.config.rope_parameters.items() if k != "type"}
        assert {k: got.get(k) for k in want} == want, name
        for j, tokens in enumerate(converted["tokens"]):
            with torch.no_grad():
                logits = copy.deepcopy(model)(torch.tensor(tokens)).logits
            assert torch.equal(logits, converted["logits"][name][j]), name


# ----------------------------------------------------------------------------- generation

PROMPT_LENGTHS = (50, 60, 70)  # the 64-token original context is crossed while decoding or prefilling
NEW = 24


def _generation(names) -> dict:
    """Rank fn: per model and layer path, greedy tokens and sampled log-probs vs HF."""
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationEngine, GenerationConfig, SamplingConfig
    from hyflow.rollout.loading import megatron_from_hf
    from hyflow.testing.references import hf_response_logprobs
    from hyflow.testing.tiny_models import tiny_hf_config

    groups = init_training_groups(Layout())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    out: dict = {}
    for name in names:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(name, num_hidden_layers=2)).eval()
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.1)
        hf.generation_config.eos_token_id = None
        model, desc = megatron_from_hf(hf, groups)
        want = []
        for p in prompts:
            ids = torch.tensor([p])
            res = copy.deepcopy(hf).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                             do_sample=False, pad_token_id=0)
            want.append(res[0, len(p):].tolist())
        out[name] = {"hf": want}
        for impl in ("lean", "megatron"):
            engine = GenerationEngine.from_description(
                model, desc, GenerationConfig(sampling=SamplingConfig(temperature=0, max_new_tokens=NEW,
                                                                   ignore_eos=True),
                                           max_concurrent=3, layer_impl=impl), tp_group=groups.pgs.tp)
            greedy = [s.token_ids for s in engine.generate(prompts).samples]
            sampled = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=NEW,
                                                              ignore_eos=True, seed=2)).samples
            err = max(max(abs(a - b) for a, b in zip(
                s.logprobs, hf_response_logprobs(copy.deepcopy(hf), s.prompt_ids, s.token_ids, 1.0)))
                for s in sampled)
            out[name][impl] = {"greedy": greedy, "logprob_err": err}
    return out


@pytest.mark.multirank
def test_generation_uses_the_training_frequencies():
    result = run_on_ranks(_generation, 1, LONG, timeout=600)[0]
    for name in LONG:
        for impl in ("lean", "megatron"):
            assert result[name][impl]["greedy"] == result[name]["hf"], (name, impl)
            if name == "qwen2_yarn":
                # Length-independent: a full forward sees the angles generation used. (Dynamic NTK
                # and longrope rotate each cached key with the frequencies of its own step, as HF's
                # generate does, so a full forward of the final sequence differs by design.)
                assert result[name][impl]["logprob_err"] <= 1e-4, (name, impl, result[name][impl])
