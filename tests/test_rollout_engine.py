"""Rollout engine on tiny random Llama / Qwen2 / Mistral models against Hugging Face.

* greedy tokens equal ``transformers`` ``generate`` (one prompt at a time, no padding) for
  prompts of mixed lengths generated together, at generation TP 1 and 2;
* sampled log-probs equal a fresh full forward of prompt + response (HF, fp32);
* stop handling (EOS, stop ids, max_new_tokens, context limit), prompts over the limit,
  chunked prefill, continuous vs static batching, prefix sharing, seeds, DP split, a PP = 2
  replica (more PP checks in test_rollout_pipeline.py).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hyflow.testing import run_on_ranks
from hyflow.testing.references import hf_response_logprobs

pytestmark = pytest.mark.multirank

FAMILIES = ("llama", "qwen2", "mistral")
PROMPTS = [[5], [17, 3, 250, 9], [100 + i for i in range(9)], [(7 * i) % 300 for i in range(17)],
           [(13 * i + 1) % 300 for i in range(30)]]
NEW = 12
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.9, n=2, max_new_tokens=NEW, ignore_eos=True, seed=5)


def _tiny_hf(family: str, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.1, pad_token_id=0)
    cls, cfg = {
        "llama": (LlamaForCausalLM, lambda: LlamaConfig(**common, tie_word_embeddings=False)),
        "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**common, tie_word_embeddings=True)),
        "mistral": (MistralForCausalLM, lambda: MistralConfig(**common, sliding_window=None,
                                                               tie_word_embeddings=False)),
    }[family]
    torch.manual_seed(seed)
    model = cls(cfg()).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():  # non-zero Q/K/V biases (Qwen2) so they are exercised
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.2)
    model.generation_config.eos_token_id = None
    return model


def _model(family: str, tp: int, pp: int = 1, dp: int = 1):
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout.loading import megatron_from_hf

    groups = init_training_groups(Layout(tp=tp, pp=pp, dp=dp))
    hf = _tiny_hf(family)
    model, desc = megatron_from_hf(hf, groups)
    return model, desc, hf, groups


def _make(built, **config: Any):
    """An engine over an already built (model, desc, hf, groups) with ``config`` overrides."""
    from hyflow.rollout import GenerationEngine, GenerationConfig, SamplingConfig

    model, desc, _, groups = built
    sampling = SamplingConfig(**config.pop("sampling", dict(temperature=0, max_new_tokens=NEW, ignore_eos=True)))
    return GenerationEngine.from_description(model, desc, GenerationConfig(sampling=sampling, **config),
                                             tp_group=groups.pgs.tp)


def _engine(family: str, tp: int, pp: int = 1, dp: int = 1, **config: Any):
    built = _model(family, tp, pp, dp)
    return _make(built, **config), built[2], built[3]


def _hf_greedy(hf: Any, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _parity(tp: int) -> dict:
    """Rank fn: per family and layer implementation, greedy tokens, the sampled log-prob error
    against HF and the sampled tokens; plus HF's greedy tokens."""
    from hyflow.rollout import SamplingConfig

    out: dict = {}
    for family in FAMILIES:
        out[family] = {}
        built = _model(family, tp)
        hf = built[2]
        for impl in ("lean", "megatron"):
            engine = _make(built, max_concurrent=3, prefill_chunk_size=8, layer_impl=impl)
            assert (engine.runner.lean is not None) == (impl == "lean")
            greedy = [s.token_ids for s in engine.generate(PROMPTS).samples]
            res = engine.generate(PROMPTS, SamplingConfig(**SAMPLED))
            err = 0.0
            for s in res.samples:
                want = hf_response_logprobs(hf, s.prompt_ids, s.token_ids, SAMPLED["temperature"])
                err = max(err, max(abs(a - b) for a, b in zip(s.logprobs, want)))
            out[family][impl] = {"greedy": greedy, "logprob_err": err,
                                 "sampled": [s.token_ids for s in res.samples]}
        out[family]["hf"] = [_hf_greedy(hf, p, NEW) for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def tp1() -> dict:
    return run_on_ranks(_parity, 1, 1, timeout=300)[0]


@pytest.mark.parametrize("impl", ["lean", "megatron"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate_tp1(tp1, family, impl):
    assert tp1[family][impl]["greedy"] == tp1[family]["hf"]


@pytest.mark.parametrize("impl", ["lean", "megatron"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_logprobs_equal_full_forward_tp1(tp1, family, impl):
    assert tp1[family][impl]["logprob_err"] <= 1e-4
    assert tp1[family][impl]["sampled"] == tp1[family]["lean"]["sampled"]


def test_tp2_greedy_parity_logprobs_and_tp_invariant_samples(tp1):
    results = run_on_ranks(_parity, 2, 2, timeout=300)
    for family in FAMILIES:
        for rank in range(2):
            for impl in ("lean", "megatron"):
                got = results[rank][family][impl]
                assert got["greedy"] == results[rank][family]["hf"], (family, impl, rank)
                assert got["logprob_err"] <= 1e-4, (family, impl, rank)
                # Same seeds -> same samples at TP 1 and TP 2 (the draw is in global vocabulary order).
                assert got["sampled"] == tp1[family]["lean"]["sampled"], (family, impl, rank)


# ----------------------------------------------------------------------------- behaviours


def _behaviour() -> dict:
    """Rank fn (TP 1): stop rules, limits, batching variants; returns what the test checks."""
    from hyflow.rollout import GenerationRequest, SamplingConfig
    from hyflow.rollout.engine import PromptTooLongError

    built = _model("llama", 1)
    engine = _make(built, max_concurrent=2)
    prompt = PROMPTS[3]
    ref = engine.generate([prompt], SamplingConfig(temperature=0, max_new_tokens=10, ignore_eos=True)).samples[0]
    i = next(j for j in range(2, 10) if ref.token_ids[j] not in ref.token_ids[:j])
    stop = ref.token_ids[i]
    r: dict = {"ref": ref.token_ids, "i": i}

    def one(**kw):
        params = SamplingConfig(**{"temperature": 0, "max_new_tokens": 10, **kw})
        return engine.generate([prompt], params).samples[0]

    r["eos"] = one(eos_token_ids=[stop])
    r["eos_excluded"] = one(eos_token_ids=[stop], include_stop_token=False)
    r["stop_id"] = one(eos_token_ids=[299], stop_token_ids=[stop])
    r["ignore_eos"] = one(eos_token_ids=[stop], ignore_eos=True)
    r["max_new"] = one(max_new_tokens=4, ignore_eos=True)
    # Per-request sampling overrides in one batch.
    short = SamplingConfig(temperature=0, max_new_tokens=3, ignore_eos=True)
    stopping = SamplingConfig(temperature=0, max_new_tokens=6, eos_token_ids=[stop])
    mixed = engine.generate([GenerationRequest(prompt, short), GenerationRequest(prompt, stopping)])
    r["mixed"] = [(s.token_ids, s.finish_reason) for s in mixed.samples]

    # Context limit and prompts over it.
    small = _make(built, max_seq_len=len(prompt) + 4)
    r["context"] = small.generate([prompt]).samples[0]
    tight = _make(built, max_seq_len=20)
    try:
        tight.generate([PROMPTS[4]])
        r["too_long"] = None
    except PromptTooLongError as e:
        r["too_long"] = str(e)
    trunc = _make(built, max_seq_len=20, truncate_long_prompts=True)
    res = trunc.generate([PROMPTS[4], PROMPTS[1]])
    r["truncated"] = (res.samples[0], res.stats.truncated_prompts,
                      trunc.generate([PROMPTS[4][-19:]]).samples[0].token_ids)
    errors = []
    for bad in ([], [300]):
        try:
            engine.generate([bad])
        except ValueError as e:
            errors.append(str(e))
    r["bad_prompt_errors"] = errors

    # Same samples whatever the batching: chunked prefill, static, one slot, no prefix sharing.
    sampled = SamplingConfig(**{**SAMPLED, "n": 3})
    variants = {}
    for name, kw in {"base": {}, "chunked": {"prefill_chunk_size": 4}, "static": {"batching": "static"},
                     "one_slot": {"max_concurrent": 1}, "no_share": {"share_prompt_prefill": False},
                     "many_slots": {"max_concurrent": 16}}.items():
        eng = _make(built, **{"max_concurrent": 4, **kw})
        res = eng.generate(PROMPTS, sampled)
        variants[name] = ([s.token_ids for s in res.samples], [s.logprobs for s in res.samples], res.stats)
    r["variants"] = variants
    r["reseeded"] = [s.token_ids for s in engine.generate(PROMPTS, sampled.replace(seed=6)).samples]
    r["tensors"] = res.to_tensors(pad_token_id=0)
    r["samples"] = res.samples
    return r


@pytest.fixture(scope="module")
def behaviour() -> dict:
    return run_on_ranks(_behaviour, 1, timeout=300)[0]


def test_eos_and_stop_ids_end_the_response(behaviour):
    ref, i = behaviour["ref"], behaviour["i"]
    for key in ("eos", "stop_id"):
        s = behaviour[key]
        assert s.token_ids == ref[:i + 1] and s.finish_reason == "stop" and s.stop_token == ref[i]
        assert len(s.logprobs) == len(s.token_ids)
    s = behaviour["eos_excluded"]
    assert s.token_ids == ref[:i] and s.finish_reason == "stop" and len(s.logprobs) == i
    s = behaviour["ignore_eos"]
    assert s.token_ids == ref and s.finish_reason == "length"


def test_max_new_tokens_context_limit_and_per_request_settings(behaviour):
    ref, i = behaviour["ref"], behaviour["i"]
    s = behaviour["max_new"]
    assert s.token_ids == ref[:4] and s.finish_reason == "length"
    s = behaviour["context"]  # prompt + 4 new tokens fill max_seq_len
    assert s.token_ids == ref[:4] and s.finish_reason == "length"
    assert behaviour["mixed"] == [(ref[:3], "length"), (ref[:min(i + 1, 6)], "stop" if i < 6 else "length")]


def test_prompt_over_the_limit_is_an_error_or_truncated(behaviour):
    message = behaviour["too_long"]
    assert message and "request 0: 30 tokens" in message and "truncate_long_prompts" in message
    sample, count, direct = behaviour["truncated"]
    assert count == 1 and sample.prompt_truncated == 11 and sample.prompt_ids == PROMPTS[4][-19:]
    assert sample.token_ids == direct and len(sample.token_ids) == 1  # 19 + 1 = max_seq_len
    empty, out_of_vocab = behaviour["bad_prompt_errors"]
    assert "empty prompt" in empty and "outside the vocabulary" in out_of_vocab


def test_samples_do_not_depend_on_batching_chunking_or_prefix_sharing(behaviour):
    variants = behaviour["variants"]
    tokens, logprobs, stats = variants["base"]
    assert len(tokens) == 3 * len(PROMPTS)
    for name, (other, other_lp, _) in variants.items():
        assert other == tokens, name
        for a, b in zip(logprobs, other_lp):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, name
    assert len({tuple(t) for t in tokens}) > len(PROMPTS)  # the n samples differ
    assert behaviour["reseeded"] != tokens
    # Prefix sharing runs each prompt once; without it each sample re-runs its prompt.
    assert variants["no_share"][2].prefill_tokens > variants["base"][2].prefill_tokens
    # Continuous batching keeps every slot busy: fewer decode steps than static batches.
    assert variants["base"][2].decode_steps <= variants["static"][2].decode_steps
    assert variants["base"][2].decode_rows == variants["static"][2].decode_rows  # no finished rows computed


def test_result_tensors(behaviour):
    t, samples = behaviour["tensors"], behaviour["samples"]
    n = len(samples)
    assert t["responses"].shape[0] == n and t["prompts"].shape[0] == n
    for i, s in enumerate(samples):
        r = len(s.token_ids)
        assert t["response_lengths"][i] == r and t["response_mask"][i].sum() == r
        assert t["responses"][i, :r].tolist() == s.token_ids
        assert torch.allclose(t["logprobs"][i, :r], torch.tensor(s.logprobs))
        p = len(s.prompt_ids)
        assert t["prompts"][i, -p:].tolist() == s.prompt_ids and t["prompt_mask"][i].sum() == p


# ----------------------------------------------------------------------------- DP / PP


def _data_parallel() -> dict:
    """Rank fn (2 ranks): DP = 2 replicas; and one PP = 2 replica (a stage per rank)."""
    from hyflow.rollout import SamplingConfig
    from hyflow.rollout.dp import generate_data_parallel

    out = {}
    for family in FAMILIES:
        engine, _, groups = _engine(family, 1, dp=2, max_concurrent=3, prefill_chunk_size=8)
        res = generate_data_parallel(engine, PROMPTS, groups.pgs.dp, SamplingConfig(**SAMPLED)).to_result()
        out[family] = ([s.token_ids for s in res.samples],
                       [(s.request_index, s.sample_index) for s in res.samples], res.stats.samples)
    engine, _, _ = _engine("llama", 1, pp=2, max_concurrent=3, prefill_chunk_size=8)
    out["pp2"] = [s.token_ids for s in engine.generate(PROMPTS, SamplingConfig(**SAMPLED)).samples]
    return out


def test_data_parallel_split_gathers_in_request_order(tp1):
    results = run_on_ranks(_data_parallel, 2, timeout=300)
    for family in FAMILIES:
        tokens, order, count = results[0][family]
        assert results[1][family] == results[0][family]
        assert order == [(i, j) for i in range(len(PROMPTS)) for j in range(2)]
        assert tokens == tp1[family]["lean"]["sampled"] and count == 2 * len(PROMPTS)
    for rank in range(2):  # both stages return the PP = 1 engine's samples
        assert results[rank]["pp2"] == tp1["llama"]["lean"]["sampled"]
