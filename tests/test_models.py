"""Model descriptions, RoPE frequencies, SDPA core attention and the model builder."""

import math

import pytest
import torch

from hyflow.models.description import ModelDescription, ModelDescriptionError, RopeScaling, tiny_llama
from hyflow.testing import run_on_ranks


# ------------------------------------------------------------------ description
@pytest.mark.parametrize("overrides, needle", [
    (dict(family="gpt2"), "unsupported model family 'gpt2'"),
    (dict(num_attention_heads=6, num_query_groups=4), "num_attention_heads=6 is not a multiple of num_query_groups=4"),
    (dict(hidden_size=0), "model.hidden_size must be a positive integer, got 0"),
    (dict(head_dim=15), "head_dim=15 must be even"),
    (dict(rope_scaling={"type": "proportional", "factor": 2.0}), "rope_scaling.type='proportional' is not supported"),
    (dict(rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     "high_freq_factor must exceed low_freq_factor"),
])
def test_description_rejects_inconsistent_models(overrides, needle):
    with pytest.raises(ModelDescriptionError) as err:
        tiny_llama(**overrides)
    assert needle in str(err.value)


def test_description_round_trip(tmp_path):
    desc = tiny_llama(rope_scaling={"type": "llama3", "factor": 8.0}, qkv_bias=True, eos_token_ids=[2, 5])
    desc.save(str(tmp_path))
    back = ModelDescription.load(str(tmp_path))
    assert back == desc and isinstance(back.rope_scaling, RopeScaling)
    with pytest.raises(ModelDescriptionError, match="unknown model description keys \\['bogus'\\]"):
        ModelDescription.from_dict({**desc.to_dict(), "bogus": 1})
    with pytest.raises(ModelDescriptionError, match="no model description at"):
        ModelDescription.load(str(tmp_path / "missing"))


def test_parameter_count_matches_built_shapes():
    from hyflow.models.weights import full_parameter_shapes

    for desc in (tiny_llama(), tiny_llama(tied_embeddings=True, qkv_bias=True)):
        counted = sum(math.prod(s) for s in full_parameter_shapes(desc).values())
        assert counted == desc.num_parameters()


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 128},
])
def test_inv_freq_matches_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 50000.0} if scaling is None else {**scaling, "rope_theta": 50000.0}
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params,
                                   max_position_embeddings=1024)
    kind = params["rope_type"]
    if kind == "default":
        d = 64
        want = 1.0 / (50000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    ours = tiny_llama(hidden_size=256, num_attention_heads=4, num_query_groups=4, rope_theta=50000.0,
                      rope_scaling=None if scaling is None else {
                          "type": kind, **{k: v for k, v in scaling.items() if k != "rope_type"}})
    torch.testing.assert_close(ours.inv_freq().float(), want.float(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- SDPA attention
def _reference_attention(q, k, v, mask_bool=None):
    """float64 softmax(q k^T / sqrt(d)) v with GQA, causal aligned to the end of keys."""
    sq, b, nh, d = q.shape
    sk, _, ng, _ = k.shape
    rep = nh // ng
    q64, k64, v64 = q.double(), k.double().repeat_interleave(rep, 2), v.double().repeat_interleave(rep, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q64, k64) / math.sqrt(d)
    if mask_bool is None:
        i = torch.arange(sq)[:, None] + (sk - sq)
        mask_bool = torch.arange(sk)[None, :] > i  # True = masked out
    scores = scores.masked_fill(mask_bool, float("-inf"))
    ctx = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v64)
    return ctx.reshape(sq, b, nh * d)


def _sdpa_case(sq: int, sk: int, explicit_mask: bool):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hyflow.models.sdpa_attention import SDPAttention
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    init_training_groups(Layout())
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0, use_cpu_initialization=True)
    attn = SDPAttention(cfg, 1, AttnMaskType.causal, "self",
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups(["tp"]))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sq, 3, 4, 8, generator=g)
    k = torch.randn(sk, 3, 2, 8, generator=g)
    v = torch.randn(sk, 3, 2, 8, generator=g)
    mask = None
    if explicit_mask:
        mask = torch.rand(3, 1, sq, sk, generator=g) > 0.7
        mask[..., 0] = False  # every query sees at least one key
    out = attn(q, k, v, mask)
    return out, _reference_attention(q, k, v, mask)


@pytest.mark.parametrize("sq,sk,explicit", [(7, 7, False), (1, 9, False), (3, 9, False), (5, 5, True)],
                         ids=["causal", "decode", "chunk", "mask"])
def test_sdpa_attention_matches_float64_reference(sq, sk, explicit):
    out, ref = run_on_ranks(_sdpa_case, 1, sq, sk, explicit)[0]
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ builder
def _build_checks(tp: int):
    import torch.distributed as dist

    from hyflow.models.builder import build_gpt_model
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    groups = init_training_groups(Layout(tp=tp))
    desc = tiny_llama(vocab_size=200)  # padded to 128 * tp
    model = build_gpt_model(desc, groups)
    emb = model.embedding.word_embeddings.weight
    out = model.output_layer.weight
    rows = emb.shape[0]
    start = groups.tp_rank * rows
    pad_from = max(desc.vocab_size - start, 0)
    critic = build_gpt_model(desc, groups, value_head=True)
    tokens = torch.randint(0, desc.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    values = critic(tokens, torch.arange(8).expand(2, 8), None)
    return {
        "rank": dist.get_rank(), "rows": rows, "pad_zero": bool((emb[pad_from:] == 0).all() and (out[pad_from:] == 0).all()),
        "real_nonzero": bool((emb[:pad_from].abs().sum(-1) > 0).all()) if pad_from else True,
        "value_shape": tuple(values.shape), "values": values.detach(),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_builder_pads_vocab_and_builds_value_head(tp):
    results = run_on_ranks(_build_checks, tp, tp)
    # 200 rounded up to a multiple of 128 * tp: 256 for tp=1 and for tp=2.
    assert sum(r["rows"] for r in results) == 256
    for r in results:
        assert r["pad_zero"] and r["real_nonzero"]
        assert r["value_shape"] == (2, 8, 1)
    if tp == 2:  # both TP ranks see the same (replicated) values
        torch.testing.assert_close(results[0]["values"], results[1]["values"])


def _logits_in_dtype(dtype: str):
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    groups = init_training_groups(Layout())
    desc = tiny_llama()
    model = build_gpt_model(desc, groups, dtype=dtype)
    load_full_state_dict(model, random_full_state_dict(desc, seed=2), desc, groups)
    tokens = torch.randint(0, desc.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens, torch.arange(12).expand(2, 12), None)
    return {p.dtype for p in model.parameters()}, logits.float()


def test_bf16_model_has_bf16_parameters_and_tracks_fp32():
    dtypes16, logits16 = run_on_ranks(_logits_in_dtype, 1, "bf16")[0]
    dtypes32, logits32 = run_on_ranks(_logits_in_dtype, 1, "fp32")[0]
    assert dtypes16 == {torch.bfloat16} and dtypes32 == {torch.float32}
    assert torch.isfinite(logits16).all()
    err = (logits16 - logits32).norm() / logits32.norm()
    assert 0 < err < 0.05  # bf16 rounding is visible but small


def test_transformer_engine_norm_names_load_and_gather_like_the_local_spec():
    """TE's fused norms are named ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``;
    the full state dict (random init, converters) uses ``input_layernorm`` / ``pre_mlp_layernorm``."""
    from types import SimpleNamespace

    from hyflow.models.weights import canonical_name, load_full_state_dict
    from hyflow.parallel.layout import Layout

    class Holder(torch.nn.Module):
        def __init__(self, **params):
            super().__init__()
            for k, v in params.items():
                setattr(self, k, v)

    te_layer = Holder(
        self_attention=Holder(linear_qkv=Holder(layer_norm_weight=torch.nn.Parameter(torch.zeros(4)))),
        mlp=Holder(linear_fc1=Holder(layer_norm_weight=torch.nn.Parameter(torch.zeros(4)))))
    model = Holder(decoder=Holder(layers=torch.nn.ModuleList([te_layer])))
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.3.mlp.linear_fc1.weight") == "decoder.layers.3.mlp.linear_fc1.weight"
    full = {"decoder.layers.0.input_layernorm.weight": torch.full((4,), 2.0),
            "decoder.layers.0.pre_mlp_layernorm.weight": torch.full((4,), 3.0)}
    desc = SimpleNamespace(num_layers=1)
    groups = SimpleNamespace(layout=Layout(tp=1, pp=1), pp_rank=0, tp_rank=0)
    load_full_state_dict(model, full, desc, groups)
    assert te_layer.self_attention.linear_qkv.layer_norm_weight.tolist() == [2.0] * 4
    assert te_layer.mlp.linear_fc1.layer_norm_weight.tolist() == [3.0] * 4
