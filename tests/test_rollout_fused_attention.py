"""The rollout's attention and decode loop on the path a GPU needs (checked on CPU):

* :class:`CachedAttention` equals a float64 reference on every path (prefill from 0, ragged
  decode, uniform decode, a later prefill chunk), with the batch's slots contiguous or
  scattered, with grouped-query heads; keys / values reach SDPA as views of the cache (never a
  gathered copy), a mask only where rows see different keys, always an additive float mask,
  and never together with ``enable_gqa`` (no fused CUDA kernel takes both);
* :class:`SDPAttention` (training / scoring spec) never repeats keys / values;
* the sampler's device-side uniforms are bit-identical to the host reference;
* a decode step reads the device once (``tolist`` of the drawn tokens and log-probs), counted
  with patched ``Tensor.item`` / ``tolist`` / ``__bool__`` / ``__int__`` / ``__float__`` /
  ``__index__``; compaction keeps decode batches contiguous and changes no sample.
"""
from __future__ import annotations

import math

import pytest
import torch

from hyflow.rollout import kv_cache as kv_mod
from hyflow.rollout.kv_cache import CachedAttention, ForwardBatch, KVCache
from hyflow.testing import run_on_ranks

H, G, D = 6, 2, 8  # 6 query heads over 2 key/value groups
LAYERS, SLOTS, CAP = 2, 6, 16


def _reference(q, keys, values, positions):
    """float64 attention of row r's queries [s, H, D] over its keys 0..position (GQA by repeat)."""
    s = q.shape[0]
    out = torch.zeros(s, H * D, dtype=torch.float64)
    k = keys.double().repeat_interleave(H // G, 0)  # [H, T, D]
    v = values.double().repeat_interleave(H // G, 0)
    for i in range(s):
        n = positions[i] + 1
        scores = torch.einsum("hd,htd->ht", q[i].double(), k[:, :n]) / math.sqrt(D)
        out[i] = torch.einsum("ht,htd->hd", scores.softmax(-1), v[:, :n]).reshape(-1)
    return out


class _Spy:
    """Records what CachedAttention hands to SDPA."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, **kw):
            self.calls.append(dict(k=k, mask=attn_mask, causal=is_causal, gqa=enable_gqa, q=q))
            return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kw)

        monkeypatch.setattr(kv_mod.F, "scaled_dot_product_attention", spy)


def _run(cache, slots, starts, width, q, k, v):
    cache.batch = ForwardBatch.build(slots, starts, width, rep=H // G, dtype=torch.float32,
                                     device=torch.device("cpu"))
    attn = CachedAttention(cache, 0, H, G, D)
    b = len(slots)
    return attn(q.permute(1, 0, 2, 3), k.permute(1, 0, 2, 3), v.permute(1, 0, 2, 3)).reshape(width, b, H * D)


@pytest.mark.parametrize("case", ["prefill", "ragged_decode", "uniform_decode", "chunk"])
@pytest.mark.parametrize("slots", [[0, 1, 2], [4, 1, 3]], ids=["contiguous", "scattered"])
def test_cached_attention_paths_match_float64(monkeypatch, case, slots):
    spy = _Spy(monkeypatch)
    g = torch.Generator().manual_seed(7)
    width, starts = {"prefill": (5, [0, 0, 0]), "ragged_decode": (1, [4, 9, 6]),
                     "uniform_decode": (1, [7, 7, 7]), "chunk": (3, [5, 5, 5])}[case]
    b = len(slots)
    cache = KVCache(LAYERS, SLOTS, G, CAP, D, torch.float32)
    history = torch.randn(2, SLOTS, G, CAP, D, generator=g)  # keys / values already in the cache
    cache.keys[0].copy_(history[0])
    cache.values[0].copy_(history[1])
    q = torch.randn(b, width, H, D, generator=g)
    k = torch.randn(b, width, G, D, generator=g)
    v = torch.randn(b, width, G, D, generator=g)
    out = _run(cache, slots, starts, width, q, k, v)
    for r, slot in enumerate(slots):
        keys, values = history[0, slot].clone(), history[1, slot].clone()  # [G, CAP, D]
        keys[:, starts[r]:starts[r] + width] = k[r].transpose(0, 1)
        values[:, starts[r]:starts[r] + width] = v[r].transpose(0, 1)
        # the cache holds the new keys / values at their positions
        torch.testing.assert_close(cache.keys[0][slot, :, :starts[r] + width], keys[:, :starts[r] + width])
        want = _reference(q[r], keys, values, [starts[r] + i for i in range(width)])
        torch.testing.assert_close(out[:, r].double(), want, rtol=1e-5, atol=1e-5)
    (call,) = spy.calls
    assert not (call["gqa"] and call["mask"] is not None)
    if case == "prefill":  # own keys, causal, no mask, no cache read
        assert call["causal"] and call["mask"] is None and call["gqa"]
        assert call["k"].untyped_storage().data_ptr() != cache.keys[0].untyped_storage().data_ptr()
    else:  # a view of the cache: same storage, no gather
        assert call["k"].untyped_storage().data_ptr() == cache.keys[0].untyped_storage().data_ptr()
        assert call["q"].shape[1] == call["k"].shape[1] == G  # GQA folded into the query axis
        if case == "uniform_decode":
            assert call["mask"] is None
        else:
            assert call["mask"] is not None and call["mask"].dtype == torch.float32


def test_continued_prefill_chunk_runs_in_query_blocks_with_their_own_masks(monkeypatch):
    """A later prefill chunk (rows continuing at one position) attends in query blocks sized by
    the mask budget; each block reads the cache up to its last query only, and the result equals
    float64 attention."""
    spy = _Spy(monkeypatch)
    slots, start, width = [0, 1], 5, 7
    rep = H // G
    monkeypatch.setattr(kv_mod, "PREFILL_MASK_BYTES", 4 * rep * (start + width) * 3)  # 3 queries a block
    assert kv_mod.prefill_query_block(width, start + width, rep) == 3
    g = torch.Generator().manual_seed(11)
    cache = KVCache(LAYERS, SLOTS, G, CAP, D, torch.float32)
    history = torch.randn(2, SLOTS, G, CAP, D, generator=g)
    cache.keys[0].copy_(history[0])
    cache.values[0].copy_(history[1])
    q = torch.randn(2, width, H, D, generator=g)
    k = torch.randn(2, width, G, D, generator=g)
    v = torch.randn(2, width, G, D, generator=g)
    out = _run(cache, slots, [start, start], width, q, k, v)
    assert cache.batch.chunk_start == start and cache.batch.mask is None  # no whole-chunk mask
    for r, slot in enumerate(slots):
        keys, values = history[0, slot].clone(), history[1, slot].clone()
        keys[:, start:start + width] = k[r].transpose(0, 1)
        values[:, start:start + width] = v[r].transpose(0, 1)
        want = _reference(q[r], keys, values, [start + i for i in range(width)])
        torch.testing.assert_close(out[:, r].double(), want, rtol=1e-5, atol=1e-5)
    assert [c["k"].shape[2] for c in spy.calls] == [start + 3, start + 6, start + 7]
    assert [tuple(c["mask"].shape) for c in spy.calls] == [(1, 1, rep * 3, start + 3), (1, 1, rep * 3, start + 6),
                                                         (1, 1, rep, start + 7)]
    assert all(c["k"].untyped_storage().data_ptr() == cache.keys[0].untyped_storage().data_ptr() for c in spy.calls)


def test_contiguous_and_scattered_slots_give_identical_outputs():
    g = torch.Generator().manual_seed(3)
    history = torch.randn(2, SLOTS, G, CAP, D, generator=g)
    q, k, v = (torch.randn(3, 1, n, D, generator=g) for n in (H, G, G))
    outs = []
    for slots in ([0, 1, 2], [5, 0, 3]):
        cache = KVCache(LAYERS, SLOTS, G, CAP, D, torch.float32)
        for r, slot in enumerate(slots):  # the same sequences, placed in other slots
            cache.keys[0][slot] = history[0, r]
            cache.values[0][slot] = history[1, r]
        outs.append(_run(cache, slots, [3, 8, 5], 1, q, k, v))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def test_forward_batch_plans_on_the_host(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append("item"))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append("tolist"))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: calls.append("bool") or True)
    fb = ForwardBatch.build([2, 3, 4], [6, 6, 6], 1, rep=3, dtype=torch.float32, device=torch.device("cpu"))
    assert (fb.span, fb.rows, fb.mask, fb.kv_len, fb.fresh) == ((2, 5), None, None, 7, False)
    fb = ForwardBatch.build([4, 2], [3, 6], 1, rep=3, dtype=torch.float32, device=torch.device("cpu"))
    assert fb.span == (2, 5) and fb.rows is not None and fb.mask.shape == (3, 1, 3, 7)
    fb = ForwardBatch.build([1, 0], [0, 0], 4, rep=3, dtype=torch.float32, device=torch.device("cpu"))
    assert fb.fresh and fb.mask is None and fb.kv_len == 4
    assert calls == []


def test_device_uniforms_equal_the_host_reference():
    from hyflow.rollout.sampler import device_uniforms, stream_seed, uniforms, _signed

    streams = [stream_seed(s, i, j) for s in (0, 7, 2**40) for i in range(20) for j in range(5)]
    streams += [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    steps = [(13 * i) % 700 for i in range(len(streams))]
    want = uniforms(streams, steps)
    got = device_uniforms(torch.tensor([_signed(s) for s in streams]), torch.tensor(steps))
    assert torch.equal(got, want)
    assert any(s >= 2**63 for s in streams)


# --------------------------------------------------------------------- SDPAttention


def _sdpa_without_repeat(sq: int, sk: int, explicit: bool):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import hyflow.models.sdpa_attention as sdpa_mod
    from hyflow.models.sdpa_attention import SDPAttention
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    init_training_groups(Layout())
    cfg = TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0, use_cpu_initialization=True)
    attn = SDPAttention(cfg, 1, AttnMaskType.causal, "self",
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups(["tp"]))
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(sq, 2, 6, 8, generator=g), torch.randn(sk, 2, 2, 8, generator=g), \
        torch.randn(sk, 2, 2, 8, generator=g)
    mask = None
    if explicit:
        mask = torch.rand(2, 1, sq, sk, generator=g) > 0.6
        mask[..., 0] = False
    seen = []
    real = sdpa_mod.F.scaled_dot_product_attention

    def spy(*args, **kw):
        seen.append((kw.get("attn_mask") is not None, kw.get("enable_gqa", False), args[0].shape[1],
                     None if kw.get("attn_mask") is None else kw["attn_mask"].dtype))
        return real(*args, **kw)

    repeat = torch.Tensor.repeat_interleave
    sdpa_mod.F.scaled_dot_product_attention = spy
    torch.Tensor.repeat_interleave = lambda *a, **kw: (_ for _ in ()).throw(AssertionError("K/V repeated"))
    try:  # the pooled worker runs other tests next: put both back
        out = attn(q, k, v, mask)
    finally:
        sdpa_mod.F.scaled_dot_product_attention = real
        torch.Tensor.repeat_interleave = repeat
    # float64 reference, written out (repeat here is the reference's own business)
    rep = 3
    k64 = torch.cat([k.double()[:, :, i:i + 1].expand(sk, 2, rep, 8) for i in range(2)], 2)
    v64 = torch.cat([v.double()[:, :, i:i + 1].expand(sk, 2, rep, 8) for i in range(2)], 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k64) / math.sqrt(8)
    masked = mask if mask is not None else (torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(masked, float("-inf")).softmax(-1), v64)
    return out, ref.reshape(sq, 2, 48), seen


@pytest.mark.parametrize("sq,sk,explicit", [(7, 7, False), (1, 9, False), (3, 9, False), (5, 5, True)],
                         ids=["causal", "decode", "chunk", "mask"])
def test_sdpa_attention_never_repeats_kv(sq, sk, explicit):
    out, ref, seen = run_on_ranks(_sdpa_without_repeat, 1, sq, sk, explicit)[0]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    ((has_mask, gqa, q_heads, mask_dtype),) = seen
    assert not (has_mask and gqa)
    if (sq, explicit) == (sk, False):
        assert gqa and not has_mask  # the training forward: is_causal + enable_gqa
    else:
        assert has_mask and mask_dtype == torch.float32 and q_heads == 2  # folded, additive mask


def _sdpa_attention():
    """The SDPA spec's core attention: 6 query heads, 2 key/value groups, head size 8, one rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hyflow.models.sdpa_attention import SDPAttention
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    init_training_groups(Layout())
    cfg = TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0, use_cpu_initialization=True)
    return SDPAttention(cfg, 1, AttnMaskType.causal, "self",
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups(["tp"]))


def _sdpa_packed_bounds():
    from hyflow.models.context_parallel import sequence_bounds
    from hyflow.rl.batch import packed_attention_mask

    attn = _sdpa_attention()
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(12, 1, 6, 8, generator=g), torch.randn(12, 1, 2, 8, generator=g), \
        torch.randn(12, 1, 2, 8, generator=g)
    lengths = [4, 7]  # two packed sequences and one padding token
    return attn(q, k, v, sequence_bounds(lengths, 12)), attn(q, k, v, packed_attention_mask(lengths, 12, q.device))


def test_sdpa_attention_runs_packed_rows_per_sequence_from_their_bounds():
    """A packed row's sequence bounds (1-D ``attention_mask``) give what its block-diagonal causal
    mask gives, with one causal kernel call per sequence instead of an ``s x s`` mask."""
    by_bounds, by_mask = run_on_ranks(_sdpa_packed_bounds, 1)[0]
    torch.testing.assert_close(by_bounds, by_mask, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ decode loop on a model

SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _decode_syncs_and_compaction():
    from transformers import LlamaConfig, LlamaForCausalLM

    import hyflow.rollout.scheduler as sched
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationEngine, GenerationConfig, SamplingConfig
    from hyflow.rollout.loading import megatron_from_hf

    torch.set_num_threads(1)
    groups = init_training_groups(Layout())
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.1, tie_word_embeddings=False)).eval()
    model, desc = megatron_from_hf(hf, groups)
    prompts = [[5, 9, 200], [17, 3, 250, 9, 8, 1], [100 + i for i in range(11)], [7], [44, 45]]
    engine = GenerationEngine.from_description(model, desc, GenerationConfig(max_concurrent=4), tp_group=groups.pgs.tp)
    counts, state = [], {"on": False}
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counting(name):
        def method(self, *args, **kwargs):
            if state["on"]:
                counts[-1][name] = counts[-1].get(name, 0) + 1
            return originals[name](self, *args, **kwargs)
        return method

    real_decode = sched.Scheduler._decode

    def decode(self, seqs):
        counts.append({})
        state["on"] = True
        try:
            return real_decode(self, seqs)
        finally:
            state["on"] = False

    out = {}
    sched.Scheduler._decode = decode
    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, counting(name))
    try:
        cases = {"greedy": dict(temperature=0), "sampled": dict(temperature=0.8),
                 "top_k": dict(temperature=0.8, top_k=20), "top_p": dict(temperature=0.8, top_p=0.9)}
        for case, kw in cases.items():
            counts.clear()
            res = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=9, ignore_eos=True, seed=4, **kw))
            out[case] = (list(counts), res.stats.decode_steps)
    finally:
        sched.Scheduler._decode = real_decode
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    # Compaction: with stops every ~15 ids responses end at different steps and holes open
    # below running sequences; the samples equal those of one sequence at a time.
    params = SamplingConfig(n=3, max_new_tokens=12, temperature=1.0, seed=2, eos_token_ids=list(range(0, 300, 15)))
    batched = engine.generate(prompts, params)
    engine.config.max_concurrent = 1
    alone = engine.generate(prompts, params)
    out["compaction"] = (batched.stats.compactions, [s.token_ids for s in batched.samples],
                         [s.token_ids for s in alone.samples], [s.logprobs for s in batched.samples],
                         [s.logprobs for s in alone.samples])
    return out


@pytest.fixture(scope="module")
def decode_run():
    return run_on_ranks(_decode_syncs_and_compaction, 1, timeout=600)[0]


@pytest.mark.parametrize("case", ["greedy", "sampled", "top_k"])
def test_one_host_read_per_decode_step(decode_run, case):
    counts, steps = decode_run[case]
    assert len(counts) == steps > 5
    for step in counts:
        assert step == {"tolist": 1}, step


def test_top_p_reads_only_for_the_nucleus_check(decode_run):
    counts, steps = decode_run["top_p"]
    for step in counts:  # the tokens, plus the data-dependent "does the nucleus fit" check
        assert step.get("tolist") == 1 and set(step) <= {"tolist", "__bool__"}, step


def test_compaction_moves_sequences_and_changes_no_sample(decode_run):
    moves, batched, alone, lp_batched, lp_alone = decode_run["compaction"]
    assert moves > 0
    assert batched == alone
    assert len({len(t) for t in batched}) > 2  # lengths differ: holes did open
    for a, b in zip(lp_batched, lp_alone):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


# --------------------------------------------------------------- GPU: kernels and syncs


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["prefill", "uniform_decode", "ragged_decode", "chunk"])
def test_cuda_attention_runs_on_a_fused_kernel_without_syncs(case):
    """Each path under the fused kernel it is meant for (SDPA raises when that kernel cannot
    run the call), and without a host-device synchronisation."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    width, starts = {"prefill": (5, [0, 0, 0]), "ragged_decode": (1, [4, 9, 6]),
                     "uniform_decode": (1, [7, 7, 7]), "chunk": (3, [5, 5, 5])}[case]
    kernel = SDPBackend.EFFICIENT_ATTENTION if case in ("ragged_decode", "chunk") else SDPBackend.FLASH_ATTENTION
    cache = KVCache(LAYERS, SLOTS, G, 64, 64, torch.bfloat16, device=dev)
    q = torch.randn(width, 3, H, 64, dtype=torch.bfloat16, device=dev)
    k = torch.randn(width, 3, G, 64, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.batch = ForwardBatch.build([0, 1, 2], starts, width, rep=H // G, dtype=torch.bfloat16, device=dev)
        with sdpa_kernel([kernel]):
            out = CachedAttention(cache, 0, H, G, 64)(q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (width, 3, H * 64) and bool(torch.isfinite(out).all())


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.8, top_k=20)],
                         ids=["greedy", "sampled", "top_k"])
def test_cuda_sampling_step_needs_no_sync(kw):
    from hyflow.rollout.sampler import RowParams, VocabParallelSampler, stream_seed

    dev = torch.device("cuda")
    logits = torch.randn(8, 1000, device=dev)
    sampler = VocabParallelSampler(990, 1000)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        params = RowParams.build([kw["temperature"]] * 8, [kw.get("top_k", 0)] * 8, [1.0] * 8,
                                 streams=[stream_seed(1, i, 0) for i in range(8)], steps=[3] * 8, device=dev)
        tokens, logprobs = sampler(logits, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(tokens.max()) < 990 and bool((logprobs <= 0).all())


@pytest.mark.gpu
def test_cuda_device_uniforms_equal_the_host_reference():
    from hyflow.rollout.sampler import _signed, device_uniforms, stream_seed, uniforms

    streams = [stream_seed(9, i, j) for i in range(64) for j in range(4)] + [2**64 - 1, 2**63]
    steps = list(range(len(streams)))
    got = device_uniforms(torch.tensor([_signed(s) for s in streams], device="cuda"),
                          torch.tensor(steps, device="cuda"))
    assert torch.equal(got.cpu(), uniforms(streams, steps))


def _packed_sdpa_reads():
    """Synchronising tensor methods called in a packed SDPA forward + backward: (name, on the bounds?)."""
    from hyflow.models.context_parallel import sequence_bounds

    attn = _sdpa_attention()
    bounds = sequence_bounds([5, 3, 7], 16)
    q = torch.randn(16, 1, 6, 8, requires_grad=True)
    k, v = torch.randn(16, 1, 2, 8, requires_grad=True), torch.randn(16, 1, 2, 8, requires_grad=True)
    calls = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counting(name):
        def method(self, *args, **kwargs):
            calls.append((name, self is bounds))
            return originals[name](self, *args, **kwargs)
        return method

    try:
        for name in originals:
            setattr(torch.Tensor, name, counting(name))
        attn(q, k, v, bounds).sum().backward()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return calls, bounds.device.type


def test_packed_sdpa_reads_only_its_host_bounds():
    """A packed row's attention reads its sequence bounds as a list (on the host: no device wait per
    layer) and nothing else from a tensor, forward and backward."""
    calls, device = run_on_ranks(_packed_sdpa_reads, 1)[0]
    assert calls == [("tolist", True)] and device == "cpu"
