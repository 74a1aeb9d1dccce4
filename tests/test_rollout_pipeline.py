"""Rollout engine with generation pipeline parallelism (PP_g > 1) on tiny random Llama models
(untied and tied embeddings, 4 layers), against Hugging Face and the PP = 1 engine.

Each rank holds one stage; the stages run one after another and the last stage samples and
broadcasts. Checked at (TP 1, PP 2) on 2 ranks and (TP 2, PP 2) on 4 ranks, lean and Megatron
layer paths:

* greedy tokens equal ``transformers`` ``generate`` for prompts of mixed lengths batched together;
* sampled tokens (fixed seed, top-k / top-p, n = 2) equal the PP = 1 engine's;
* sampled log-probs equal a fresh full HF forward of prompt + response (fp32, 1e-4);
* a batch mixing EOS, stop ids (kept and dropped), max_new_tokens and sampled requests gives the
  PP = 1 engine's results (tokens, finish reasons, log-probs);
* every rank (all stages, all TP ranks) returns identical results.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hyflow.testing import run_on_ranks
from hyflow.testing.references import hf_response_logprobs

pytestmark = pytest.mark.multirank

FAMILIES = ("llama", "llama_tied")
PROMPTS = [[5], [17, 3, 250, 9], [100 + i for i in range(9)], [(7 * i) % 300 for i in range(17)],
           [(13 * i + 1) % 300 for i in range(23)]]
NEW = 10
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.9, n=2, max_new_tokens=NEW, ignore_eos=True, seed=5)


def _tiny_hf(family: str, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.1, pad_token_id=0, tie_word_embeddings=family == "llama_tied")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so each stage must apply its own (and the last the final)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.mul_(1 + 0.3 * torch.randn(param.shape))
    model.generation_config.eos_token_id = None
    return model


def _suite(engine: Any, hf: Any) -> dict:
    """Greedy, sampled and stop-rule generations of ``engine``; plain data for comparison."""
    from hyflow.rollout import GenerationRequest, SamplingConfig

    greedy = engine.generate(PROMPTS).samples
    sampled = engine.generate(PROMPTS, SamplingConfig(**SAMPLED)).samples
    err = 0.0
    for s in sampled:
        want = hf_response_logprobs(hf, s.prompt_ids, s.token_ids, SAMPLED["temperature"])
        err = max(err, max(abs(a - b) for a, b in zip(s.logprobs, want)))
    # Stop ids taken from the greedy responses, so the stop rules fire mid-batch.
    ref = greedy[3].token_ids
    stop = next(ref[j] for j in range(2, NEW) if ref[j] not in ref[:j])
    other = greedy[4].token_ids[3]
    mixed = [
        GenerationRequest(PROMPTS[3], SamplingConfig(temperature=0, max_new_tokens=NEW, eos_token_ids=[stop])),
        GenerationRequest(PROMPTS[4], SamplingConfig(temperature=0, max_new_tokens=NEW, eos_token_ids=[299],
                                                     stop_token_ids=[other], include_stop_token=False)),
        GenerationRequest(PROMPTS[0], SamplingConfig(temperature=0, max_new_tokens=3, ignore_eos=True)),
        GenerationRequest(PROMPTS[2], SamplingConfig(temperature=1.0, n=2, max_new_tokens=NEW,
                                                     eos_token_ids=[stop, other], seed=11)),
        GenerationRequest(PROMPTS[1], SamplingConfig(temperature=0, max_new_tokens=NEW, eos_token_ids=[stop])),
    ]
    res = engine.generate(mixed)
    return {
        "greedy": [s.token_ids for s in greedy],
        "sampled": [s.token_ids for s in sampled],
        "sampled_logprobs": [s.logprobs for s in sampled],
        "logprob_err": err,
        "mixed": [(s.request_index, s.token_ids, s.finish_reason, s.stop_token) for s in res.samples],
        "mixed_logprobs": [s.logprobs for s in res.samples],
        "stops": (stop, other),
    }


def _run(tp: int, pp: int, impls: tuple = ("lean", "megatron")) -> dict:
    """Rank fn: every family and layer path in Layout(tp, pp); plus HF's greedy tokens."""
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationEngine, GenerationConfig, SamplingConfig
    from hyflow.rollout.loading import megatron_from_hf

    torch.set_num_threads(1)
    out: dict = {}
    for family in FAMILIES:
        groups = init_training_groups(Layout(tp=tp, pp=pp))
        hf = _tiny_hf(family)
        model, desc = megatron_from_hf(hf, groups)
        assert (model.pre_process, model.post_process) == (groups.is_first_stage, groups.is_last_stage)
        out[family] = {}
        for impl in impls:
            config = GenerationConfig(sampling=SamplingConfig(temperature=0, max_new_tokens=NEW, ignore_eos=True),
                                   max_concurrent=3, prefill_chunk_size=8, layer_impl=impl)
            engine = GenerationEngine.from_description(model, desc, config, tp_group=groups.pgs.tp,
                                                       pp_group=groups.pgs.pp)
            assert engine.runner.pp_size == pp and (engine.runner.lean is not None) == (impl == "lean")
            assert engine.runner.num_layers == 4 // pp
            out[family][impl] = _suite(engine, hf)
        if pp == 1:
            out[family]["hf"] = []
            for p in PROMPTS:
                ids = torch.tensor([p])
                gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                  do_sample=False, pad_token_id=0)
                out[family]["hf"].append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    """The PP = 1 engine (one rank) and HF on the same weights."""
    return run_on_ranks(_run, 1, 1, 1, ("lean",), timeout=300)[0]


def _check(results: list, reference: dict, impls: tuple) -> None:
    for family in FAMILIES:
        ref = reference[family]["lean"]
        assert ref["greedy"] == reference[family]["hf"], family  # the reference itself is right
        assert any(reason == "stop" for _, _, reason, _ in ref["mixed"]), family  # the stop rules fired
        assert any(reason == "length" for _, _, reason, _ in ref["mixed"]), family
        for rank, got in enumerate(results):
            for impl in impls:
                run = got[family][impl]
                where = (family, impl, rank)
                assert run["greedy"] == reference[family]["hf"], where
                assert run["logprob_err"] <= 1e-4, where
                assert run["sampled"] == ref["sampled"], where
                assert run["stops"] == ref["stops"], where
                assert run["mixed"] == ref["mixed"], where
                for a, b in zip(run["mixed_logprobs"] + run["sampled_logprobs"],
                                ref["mixed_logprobs"] + ref["sampled_logprobs"]):
                    assert len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b)), default=0) < 1e-4, where
                # Every stage and TP rank returns exactly what rank 0 returns.
                assert run == results[0][family][impl], where


def test_pp2_matches_hf_and_the_pp1_engine(reference):
    results = run_on_ranks(_run, 2, 1, 2, timeout=300)
    _check(results, reference, ("lean", "megatron"))


def test_tp2_pp2_matches_hf_and_the_pp1_engine(reference):
    results = run_on_ranks(_run, 4, 2, 2, timeout=300)
    _check(results, reference, ("lean", "megatron"))


def _misbuilt() -> str:
    """Rank fn (2 ranks): a stage model given a pipeline group of one rank is a clear error."""
    import torch.distributed as dist

    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout.loading import megatron_from_hf
    from hyflow.rollout.runner import GenerationLayoutError, ModelRunner

    groups = init_training_groups(Layout(tp=1, pp=2))
    model, _ = megatron_from_hf(_tiny_hf("llama"), groups)
    solo, _ = dist.new_subgroups_by_enumeration([[0], [1]])
    try:
        ModelRunner(model, groups.pgs.tp, pp_group=solo)
    except GenerationLayoutError as e:
        return str(e)
    return ""


def test_stage_model_without_its_pipeline_group_is_an_error():
    messages = run_on_ranks(_misbuilt, 2, timeout=120)
    for m in messages:
        assert "pipeline" in m and "pp_group" in m, m
