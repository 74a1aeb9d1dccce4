"""Long prompts: chunked prefill of a 4K-token prompt on a tiny model.

Greedy generation after a 4096-token prompt gives the same tokens whether the prompt is
prefilled whole or in chunks of 256 tokens, and the generation's extra memory (the
peak of tensor bytes allocated during ``generate``, less the KV cache) agrees with the planner's
generation transient (:func:`hyflow.plan.memory_estimate.generation_transient`) from 30% below (the plan
is an upper bound) to 15% above. The whole prompt's prefill from position 0 is causal attention
without a mask or score matrix; a later chunk attends over the cache in query blocks, each with
its own mask of at most ``PREFILL_MASK_BYTES``, so 256-token chunks need less than a third of the
whole prompt's extra memory.
"""
from __future__ import annotations

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

PROMPT, NEW = 4096, 8
CHUNKS = (0, 256)


def _desc():
    from hyflow.models.description import tiny_llama

    return tiny_llama(num_layers=2, vocab_size=256, max_position_embeddings=8192)


def _generate() -> dict:
    from hyflow.models.builder import build_gpt_model
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.plan.measure import TensorMemoryTracker
    from hyflow.rollout import GenerationEngine, GenerationConfig, SamplingConfig

    groups = init_training_groups(Layout())
    desc = _desc()
    model = build_gpt_model(desc, groups, spec="local", seed=0)
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for chunk in CHUNKS:
        engine = GenerationEngine.from_description(model, desc, GenerationConfig(
            sampling=SamplingConfig(temperature=0, max_new_tokens=NEW, ignore_eos=True),
            max_concurrent=1, prefill_chunk_size=chunk, cpu_weight_packing=False))
        tracker = TensorMemoryTracker()
        with tracker:
            result = engine.generate([prompt])
        out[chunk] = {"tokens": result.samples[0].token_ids, "peak": tracker.peak,
                      "forwards": engine.last_stats.prefill_forwards}
    return out


def test_chunked_prefill_same_tokens_and_bounded_memory():
    from hyflow.plan.memory_estimate import generation_transient, kv_cache_bytes

    result = run_on_ranks(_generate, 1, timeout=900)[0]
    desc = _desc()
    cache = kv_cache_bytes(desc, 1, 1, slots=1, capacity=PROMPT + NEW - 1, dtype="fp32")
    for got in result.values():
        got["cache"] = cache
    whole = result[0]
    for chunk in CHUNKS:
        got = result[chunk]
        assert got["tokens"] == whole["tokens"], chunk
        assert got["forwards"] == (-(-PROMPT // chunk) if chunk else 1)
        extra = got["peak"] - cache
        planned = generation_transient(desc, 1, prefill_tokens=chunk or PROMPT, rows=1, dtype="fp32",
                                       chunked=bool(chunk), context=PROMPT + NEW)
        print(f"chunk {chunk or 'none'}: peak {got['peak'] / 2**20:.1f} MiB (KV cache "
              f"{got['cache'] / 2**20:.1f} MiB, extra {extra / 2**20:.1f} MiB, planned "
              f"{planned / 2**20:.1f} MiB)")
        # the plan is an upper bound: the lean decoder frees a block's intermediates as they are consumed
        assert 0.7 * planned < extra < 1.15 * planned, (chunk, extra, planned)
    assert result[256]["peak"] - cache < (whole["peak"] - cache) / 3  # chunking bounds the extra memory

