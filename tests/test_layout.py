"""Layout validation and rank algebra (pure; no process groups)."""

import itertools

import pytest

from hyflow.config import ConfigError
from hyflow.models.description import tiny_llama, tiny_moe
from hyflow.parallel.layout import Layout, LayoutError, pad_vocab_size


@pytest.mark.parametrize("kwargs, needle", [
    (dict(tp=0), "layout.tp must be a positive integer, got 0"),
    (dict(pp=-1), "layout.pp must be a positive integer, got -1"),
    (dict(dp=1.5), "layout.dp must be a positive integer, got 1.5"),
    (dict(cp=True), "layout.cp must be a positive integer, got True"),
    (dict(ep=0), "layout.ep must be a positive integer, got 0"),
    (dict(etp=0), "layout.etp must be a positive integer or null (= tp), got 0"),
    (dict(tp=1, sequence_parallel=True), "sequence_parallel=true needs tp > 1"),
    (dict(pp=1, vpp=2), "layout.vpp=2 (interleaved pipeline) needs pp > 1"),
    (dict(pp=2, vpp=0), "layout.vpp must be a positive integer or null, got 0"),
])
def test_invalid_layouts_are_rejected_with_the_numbers(kwargs, needle):
    with pytest.raises(LayoutError) as err:
        Layout(**kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("layout, model_kw, needle", [
    (Layout(tp=3), dict(num_attention_heads=4, num_query_groups=4), "tp=3 does not divide num_attention_heads=4"),
    (Layout(tp=4), dict(num_attention_heads=8, num_query_groups=2), "tp=4 does not divide the 2 key/value groups"),
    (Layout(tp=2), dict(ffn_hidden_size=129), "tp=2 does not divide ffn_hidden_size=129"),
    (Layout(pp=3), dict(num_layers=4), "pp=3 = 3 pipeline stages do not divide num_layers=4"),
    (Layout(pp=2, vpp=3), dict(num_layers=4), "pp=2 x vpp=3 = 6 pipeline stages do not divide num_layers=4"),
])
def test_layout_rejects_models_that_do_not_divide(layout, model_kw, needle):
    with pytest.raises(LayoutError) as err:
        layout.check_model(tiny_llama(**model_kw))
    assert needle in str(err.value)


def test_sequence_constraints():
    with pytest.raises(LayoutError, match=r"cp=2 needs the sequence length \(30\) divisible by 2\*cp = 4"):
        Layout(cp=2).check_model(tiny_llama(), seq_length=30)
    with pytest.raises(LayoutError, match=r"sequence_parallel with tp=2 needs the sequence length \(31\)"):
        Layout(tp=2, sequence_parallel=True).check_model(tiny_llama(), seq_length=31)
    Layout(tp=2, sequence_parallel=True).check_model(tiny_llama(), seq_length=32)


def test_world_size_mismatch_names_every_factor():
    with pytest.raises(LayoutError) as err:
        Layout(tp=2, pp=2, dp=2).check_world(6)
    msg = str(err.value)
    assert "tp=2 x cp=1 x dp=2 x pp=2 = 8 ranks" in msg and "6" in msg


def test_with_dp_for():
    assert Layout(tp=2, pp=2).with_dp_for(16).dp == 4
    with pytest.raises(LayoutError, match="world size 6 is not divisible by tp\\*pp\\*cp = 2\\*2\\*1 = 4"):
        Layout(tp=2, pp=2).with_dp_for(6)


def test_layout_error_is_a_config_error():
    assert issubclass(LayoutError, ConfigError)


def test_pad_vocab_size():
    assert pad_vocab_size(49152, 1) == 49152
    assert pad_vocab_size(49153, 1) == 49280
    assert pad_vocab_size(32000, 8) == 32768
    assert pad_vocab_size(100, 2, divisible_by=1) == 100
    assert pad_vocab_size(101, 2, divisible_by=1) == 102
    with pytest.raises(LayoutError):
        pad_vocab_size(0, 1)


def _reference_rank(layout, tp, cp, dp, pp):
    # Megatron's default order "tp-cp-ep-dp-pp": tp varies fastest, pp slowest.
    return ((pp * layout.dp + dp) * layout.cp + cp) * layout.tp + tp


@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 1, 2, 2), (4, 2, 2, 1), (8, 1, 32, 4), (1, 1, 4, 1)])
def test_rank_algebra_round_trips(tp, cp, dp, pp):
    layout = Layout(tp=tp, cp=cp, dp=dp, pp=pp)
    seen = set()
    for t, c, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
        r = layout.rank_of(tp=t, cp=c, dp=d, pp=p)
        assert r == _reference_rank(layout, t, c, d, p)
        assert layout.coords(r) == {"tp": t, "cp": c, "dp": d, "pp": p}
        seen.add(r)
    assert seen == set(range(layout.world_size))


def test_groups_for_a_1024_rank_layout_partition_the_ranks():
    layout = Layout(tp=8, pp=4, dp=32)
    for kind, size in [("tp", 8), ("pp", 4), ("dp", 32), ("mp", 32), ("dp_cp", 32)]:
        groups = layout.groups(kind)
        assert all(len(g) == size for g in groups), kind
        assert sorted(r for g in groups for r in g) == list(range(1024)), kind
    tp0 = layout.groups("tp")[0]
    assert tp0 == list(range(8))
    assert layout.groups("pp")[0] == [0, 256, 512, 768]
    assert layout.groups("embd")[0] == [0, 768]
    assert layout.groups("pos_embd")[0] == [0]


def test_groups_match_megatron_enumeration():
    """Our enumeration equals Megatron's RankGenerator for the same order."""
    from megatron.core.parallel_state import RankGenerator

    layout = Layout(tp=2, pp=2, dp=2, cp=2)
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    for kind, token in [("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"),
                        ("mp", "tp-pp"), ("dp_cp", "dp-cp"), ("tp_cp", "tp-cp")]:
        assert layout.groups(kind) == sorted(sorted(g) for g in gen.get_ranks(token)), kind


@pytest.mark.parametrize("layout, model, needle", [
    (Layout(ep=2, dp=2), tiny_llama(), "layout.ep=2 etp=None: expert parallelism needs a mixture-of-experts model"),
    (Layout(ep=3, dp=3), tiny_moe(), "layout.ep=3 does not divide the 8 experts"),
    (Layout(etp=3, dp=3), tiny_moe(), "layout.etp=3 does not divide the expert ffn_hidden_size=32"),
    (Layout(tp=2, dp=1), tiny_moe(), "tp=2 with a mixture-of-experts model needs layout.sequence_parallel=true"),
])
def test_layout_checks_experts_against_the_model(layout, model, needle):
    with pytest.raises(LayoutError) as err:
        layout.check_model(model)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_expert_grid_must_fit_a_pipeline_stage():
    with pytest.raises(LayoutError, match=r"ep=4 x etp=1 = 4 ranks per expert replica do not divide the tp x cp x dp "
                                          r"= 1 x 1 x 2 = 2 ranks"):
        Layout(ep=4).with_dp_for(2)
    with pytest.raises(LayoutError, match="ep=2 x etp=2 = 4 ranks"):
        Layout(tp=2, ep=2, dp=1).check_world(2)
    assert Layout(tp=2, ep=2, etp=1, sequence_parallel=True).with_dp_for(2).expert_dp == 1
    # generation copies of a tp=2 MoE model run without sequence parallelism
    Layout(tp=2).check_model(tiny_moe(), training=False)


def test_expert_groups_match_megatron_enumeration():
    """The expert grid equals Megatron's expert RankGenerator (etp fastest, then ep, edp, pp)."""
    from megatron.core.parallel_state import RankGenerator

    layout = Layout(tp=2, pp=2, dp=4, ep=2, etp=1)
    gen = RankGenerator(tp=1, ep=2, dp=4, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for kind, token in [("ep", "ep"), ("etp", "tp"), ("edp", "dp"), ("tp_ep", "tp-ep"), ("tp_ep_pp", "tp-ep-pp")]:
        assert layout.expert_groups(kind) == sorted(sorted(g) for g in gen.get_ranks(token)), kind
    assert layout.expert_coords(9) == {"etp": 0, "ep": 1, "edp": 0, "pp": 1}
    assert "ep=2 etp=1" in layout.describe()


def test_unknown_group_kind():
    with pytest.raises(LayoutError, match="unknown group kind 'xx'"):
        Layout().groups("xx")


def test_two_layouts_coexist_as_values():
    train, gen = Layout(tp=4, pp=1, dp=1), Layout(tp=2, pp=1, dp=2)
    assert train.world_size == gen.world_size == 4
    assert train.groups("tp") == [[0, 1, 2, 3]]
    assert gen.groups("tp") == [[0, 1], [2, 3]]
    assert train != gen and hash(train) != hash(gen)
