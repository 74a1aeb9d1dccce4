"""Layout validation and rank algebra (pure; no process groups)."""

import ast
import itertools
import os
import re
from collections import defaultdict

import pytest

from hyflow.config import ConfigError
from hyflow.models.description import tiny_llama, tiny_moe
from hyflow.parallel.layout import Layout, LayoutError, pad_vocab_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# ---- the one rank <-> coordinate mapping -------------------------------------------------------

def _shapes():
    """Explicit shapes (the 1024-rank preset, CP, a pool starting at rank 8) and a seeded sweep."""
    import random

    fixed = [dict(tp=8, pp=4, dp=32), dict(tp=2, cp=2, dp=2, pp=2, start=0), dict(tp=2, pp=2, dp=2, start=8),
             dict(tp=4, pp=1, dp=3, cp=2, start=5), dict(tp=1, pp=3, dp=1, start=17)]
    rng = random.Random(32)
    sweep = [dict(tp=rng.choice([1, 2, 4]), cp=rng.choice([1, 1, 2]), dp=rng.choice([1, 2, 3]),
                  pp=rng.choice([1, 2, 4]), start=rng.choice([0, 1, 4, 12, 512])) for _ in range(20)]
    return fixed + sweep


def _megatron_coords(gen, kinds):
    """rank -> {kind: position in its group of that kind}: Megatron's RankGenerator lists a group's
    ranks in the order of the axis it varies, so a rank's coordinate is its index there."""
    out = defaultdict(dict)
    for kind in kinds:
        for group in gen.get_ranks(kind):
            for i, r in enumerate(group):
                out[r][kind] = i
    return out


@pytest.mark.parametrize("shape", _shapes(), ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_rank_mapping_matches_megatron_rank_generator(shape):
    """Layout.rank_of / coords / groups, the one mapping of hyflow, against Megatron-Core's
    RankGenerator with the same order ("tp-cp-ep-dp-pp") and rank_offset = start, and against the
    formulas the removed types used (ModelLayout's pool offset, the reshard plan's CP = 1 order)."""
    from megatron.core.parallel_state import RankGenerator

    layout = Layout(**shape)
    start = layout.start
    gen = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp",
                        rank_offset=start)
    want = _megatron_coords(gen, ("tp", "cp", "dp", "pp"))
    assert sorted(want) == list(layout.ranks) == list(range(start, start + layout.world_size))
    for rank, coords in want.items():
        assert layout.coords(rank) == coords
        assert layout.rank_of(**coords) == rank
        if layout.cp == 1:  # the old ModelLayout.rank / ReshardPlan.rank_of (pool offset added)
            assert rank == start + coords["tp"] + layout.tp * (coords["dp"] + layout.dp * coords["pp"])
    for kind, token in [("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("mp", "tp-pp"),
                        ("dp_cp", "dp-cp"), ("tp_cp", "tp-cp"), ("tp_dp_cp", "tp-dp-cp")]:
        assert layout.groups(kind) == sorted(sorted(g) for g in gen.get_ranks(token)), kind
    for outside in (start - 1, start + layout.world_size):
        if outside >= 0:
            with pytest.raises(LayoutError, match=f"rank {outside} outside the layout's ranks"):
                layout.coords(outside)


@pytest.mark.parametrize("shape", [dict(tp=2, pp=2, dp=4, ep=2, etp=1), dict(tp=2, pp=2, dp=4, ep=2, etp=1, start=8),
                                   dict(tp=1, pp=2, dp=4, ep=4, start=3), dict(tp=4, pp=1, dp=2, ep=2, etp=2, start=6)])
def test_expert_mapping_matches_megatron_expert_rank_generator(shape):
    from megatron.core.parallel_state import RankGenerator

    layout = Layout(**shape)
    gen = RankGenerator(tp=layout.expert_tp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1,
                        order="tp-cp-ep-dp-pp", rank_offset=layout.start)
    want = _megatron_coords(gen, ("tp", "ep", "dp", "pp"))
    assert sorted(want) == list(layout.ranks)
    for rank, c in want.items():
        coords = {"etp": c["tp"], "ep": c["ep"], "edp": c["dp"], "pp": c["pp"]}
        assert layout.expert_coords(rank) == coords
        assert layout.expert_rank_of(**coords) == rank
        # the removed ModelLayout.expert_rank (CP = 1)
        assert rank == layout.start + coords["etp"] + layout.expert_tp * (coords["ep"] + layout.ep * coords["edp"]) \
            + layout.tp * layout.dp * coords["pp"]
    for kind, token in [("ep", "ep"), ("etp", "tp"), ("edp", "dp"), ("tp_ep", "tp-ep"), ("tp_ep_pp", "tp-ep-pp")]:
        assert layout.expert_groups(kind) == sorted(sorted(g) for g in gen.get_ranks(token)), kind


def test_a_layout_starts_at_rank_0_unless_a_pool_places_it():
    pool = Layout(tp=2, dp=2).at(8)
    assert pool.start == 8 and list(pool.ranks) == [8, 9, 10, 11] and pool.world_size == 4
    assert pool.groups("tp") == [[8, 9], [10, 11]] and pool.rank_of(tp=1, dp=1) == 11
    with pytest.raises(LayoutError, match="layout.start=8: a layout over the whole world starts at rank 0"):
        pool.check_world(4)
    with pytest.raises(LayoutError, match="layout.start=8"):
        pool.with_dp_for(8)
    with pytest.raises(LayoutError, match="layout.start must be a rank >= 0, got -1"):
        Layout(start=-1)


#: Functions outside hyflow.parallel.layout allowed a name of the rank <-> coordinate kind, and why.
_ALLOWED_COORD_FUNCTIONS = {
    # the generation side of the colocated reshard regroups the training coordinates (read from
    # plan.train.coords): not a layout of its own, its ranks are the training ranks
    ("engine/hybrid/reshard_plan.py", "gen_coord"),
}
_COORD_NAME = re.compile(r"^(rank|coords?|\w*_coords?|\w*rank_of\w*|expert_rank\w*|\w*_coord_\w*)$")
_SIZES = {"tp", "pp", "dp", "cp", "ep", "etp", "expert_tp", "expert_dp"}


def _rank_arithmetic(path: str) -> list[str]:
    """Functions of one file that look like rank <-> coordinate arithmetic: a name of that kind,
    or a rank divided (//, %, divmod) by a parallel size (``rank // layout.tp``)."""
    tree = ast.parse(open(path).read())
    rel = os.path.relpath(path, ROOT)
    found = []

    def name(node) -> str:
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""

    def is_rank(node) -> bool:  # rank, global_rank, rank_in_pool (not ranks: a count)
        return re.search(r"(^|_)rank($|_)", name(node)) is not None

    def sizes(node) -> bool:
        return any(name(n) in _SIZES for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _COORD_NAME.match(node.name) \
                and (rel, node.name) not in _ALLOWED_COORD_FUNCTIONS:
            found.append(f"{rel}:{node.lineno} def {node.name}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mod)) \
                and is_rank(node.left) and sizes(node.right):
            found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and name(node.func) == "divmod" and len(node.args) == 2 \
                and is_rank(node.args[0]) and sizes(node.args[1]):
            found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def _library_files():
    for folder in ("engine", "kernels", "launch", "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py"))


def test_one_layout_type_maps_ranks_to_coordinates():
    """Issue 32: hyflow.parallel.layout.Layout is the one place with rank <-> coordinate arithmetic;
    the reshard plan, the weight sync, placement and ``hyflow plan`` read it (no ModelLayout,
    ParallelShape or RolePlacement.rank of their own)."""
    home = os.path.join(ROOT, "engine", "parallel", "layout.py")
    assert _rank_arithmetic(home)  # the scan sees the real thing
    found = [hit for path in _library_files() if path != home for hit in _rank_arithmetic(path)]
    assert not found, "rank <-> coordinate arithmetic outside Layout (use Layout.rank_of / coords):\n" + \
        "\n".join(found)


def test_the_rank_arithmetic_scan_catches_a_second_layout_type(tmp_path):
    """What the old ModelLayout / ReshardPlan / RolePlacement code looked like is reported."""
    copy = tmp_path / "engine" / "placement" / "old.py"
    copy.parent.mkdir(parents=True)
    copy.write_text(
        "class ModelLayout:\n"
        "    def rank(self, tp, pp, dp):\n        return self.start + tp + self.tp * (dp + self.dp * pp)\n"
        "class Plan:\n"
        "    def where(self, rank):\n        pp, rest = divmod(rank, self.train.dp * self.train.tp)\n"
        "        return rank % self.train.tp\n")
    found = _rank_arithmetic(str(copy))
    assert [f.split(" ", 1)[1] for f in found] == [
        "def rank", "divmod(rank, self.train.dp * self.train.tp)", "rank % self.train.tp"]
