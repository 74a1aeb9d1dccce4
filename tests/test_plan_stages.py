"""The compute cost model of ``hyflow plan``: balanced pipeline stages and the CPU layout ranking."""

import pytest

from hyflow.models.description import ModelDescription
from hyflow.plan import stages as st


def _smollm2():  # SmolLM2-135M's shape
    return ModelDescription(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_attention_heads=9,
                            num_query_groups=3, ffn_hidden_size=1536, max_position_embeddings=2048,
                            rope_theta=100000.0, norm_eps=1e-5, tied_embeddings=True)


def test_the_output_layer_costs_about_eight_smollm2_layers():
    d = _smollm2()
    head = st.head_in_layers(d, mean_seq=50, response_fraction=1.0, fused=False)
    assert 7.5 < head < 8.5  # 2 h V against 2 x 3.5M matmul weights per layer
    # the fused head scores response tokens only (and recomputes once in the backward)
    assert st.head_in_layers(d, 50, 0.3, fused=True) == pytest.approx(head * 0.3 * 4 / 3)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_balanced_split_lightens_the_last_stage_and_never_does_worse(pp):
    head = 7.9
    layers = st.balanced_stage_layers(30, pp, head)
    assert sum(layers) == 30 and len(layers) == pp and min(layers) >= 1
    assert len(set(layers[1:-1])) <= 1  # Megatron-Core: only the first and last stage may differ
    assert layers[-1] < layers[0]
    even = [30 // pp] * pp if 30 % pp == 0 else None
    if even:
        assert max(st.stage_costs(layers, head)) < max(st.stage_costs(even, head))
        assert st.bubble_step_factor(layers, head, 8) < st.bubble_step_factor(even, head, 8)
    # no output layer to carry: the split stays even where it can
    if even:
        assert st.balanced_stage_layers(30, pp, 0.0) == even


def test_balanced_split_for_smollm2_at_pp2():
    assert st.balanced_stage_layers(30, 2, 7.94) == [19, 11]  # 19 vs 11 + 7.94
    assert st.balanced_stage_layers(30, 1, 7.94) == [30]
    with pytest.raises(ValueError, match="cannot fill"):
        st.balanced_stage_layers(2, 4, 1.0)


def test_cpu_layouts_rank_dp_first_when_threads_cost_cpu_time():
    d = _smollm2()
    args = dict(tokens=32 * 50, rows=32, response_tokens=32 * 15, micro_batch_size=4, per_thread_flops=70e9)
    ranked = st.cpu_layouts(d, 2, thread_efficiency=0.75, **args)
    names = [(c.layout.tp, c.layout.pp, c.layout.dp, c.threads) for c in ranked]
    assert sorted(names) == sorted([(1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 1, 2)])
    assert names[0] == (1, 1, 2, 1)
    pp = next(c for c in ranked if c.layout.pp == 2)
    assert pp.state_gib == pytest.approx(ranked[0].state_gib / 2) and pp.note.startswith("stages ")
    assert pp.note == "stages " + "/".join(map(str, pp.layout.stage_layers))  # the balanced split it costed
    # perfectly scaling threads and no communication would win: the ranking follows its inputs
    assert (st.cpu_layouts(d, 2, thread_efficiency=1.0, **args)[0].threads) == 2
    assert all(c.update_s == pytest.approx(c.compute_s + c.comm_s) for c in ranked)


def test_plan_on_cpu_explains_the_layout_it_picks():
    from hyflow.plan.core import PlanOptions, build_plan
    from hyflow.plan.report import format_table

    result = build_plan("configs/quickstart.yaml", ["actor.layout.pp=2", "actor.layout.tp=1"],
                        PlanOptions(world_size=2, device="cpu", megatron_ranks=()))
    assert not result.errors, result.errors
    cpu = result.compute["cpu"]
    assert cpu["cores"] >= 1 and cpu["per_thread_gflops"] > 0 and 0 < cpu["thread_efficiency"] <= 1
    stages = result.compute["stages"]
    assert stages["balanced"][-1] <= stages["even"][-1]
    # actor.layout.stage_layers=null: the plan builds (and reports) the balanced split
    assert stages["automatic"] and stages["built"] == stages["balanced"]
    assert result.roles[0].layout.stage_layers == tuple(stages["balanced"])
    text = format_table(result)
    assert "CPU layouts on" in text and "<- pick" in text and "pick: actor.layout" in text
    assert f"pipeline stages: builds {'/'.join(map(str, stages['balanced']))} layers, automatic" in text
