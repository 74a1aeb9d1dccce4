"""Mixture-of-experts models: HF <-> Megatron conversion with expert parallelism, logit parity with
transformers, bit-identical round trip.

Tiny random Qwen3-MoE (8 experts, top-2, renormalised, QK-norm), Qwen2-MoE (softmax over all
experts, a gated shared expert, Q/K/V biases) and Mixtral are converted at two expert layouts:
TP=2 x EP=2 with ETP=1 (2 ranks, sequence-parallel-free eval) and PP=2 x EP=2 (4 ranks). Each
checkpoint is loaded at its own layout and at the other one (dist-checkpointing reshards the
experts), plus TP=2 x ETP=2 (each expert's weights split over TP); the Megatron logits must equal
transformers' (fp32, <= 1e-5 of the largest logit). The PP=2 x EP=2 checkpoint exported back to HF
must be bit-identical and load in transformers.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from hyflow.testing import run_on_ranks
from hyflow.testing.multirank import default_timeout

pytestmark = pytest.mark.multirank
#: generous on a loaded box; HYFLOW_TEST_TIMEOUT raises it further
TIMEOUT = max(900.0, default_timeout())

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
#: (tp, pp, ep, etp) written; the world each needs (tools.convert.preflight.conversion_world)
WRITTEN = {"tp2ep2": (2, 1, 2, 1), "pp2ep2": (1, 2, 2, None)}
TOLERANCE = 1e-5


def _convert_all(jobs) -> list:
    from hyflow.tools.convert.hf2mcore import convert_rank

    return [convert_rank(job) for job in jobs]


def _logits_all(ckpts: List[str], layout: Tuple[int, int, int, Optional[int]], tokens) -> list:
    from hyflow.tools.convert.verify import checkpoint_logits

    tp, pp, ep, etp = layout
    return [checkpoint_logits(ckpt, tp, pp, tokens, ep=ep, etp=etp) for ckpt in ckpts]


def _hf_logits_all(paths: List[str], layout: Tuple[int, int, int, Optional[int]], tokens) -> list:
    """``actor.checkpoint`` = an HF directory: each rank reads its experts' shards directly."""
    from hyflow.checkpoint.model import build_model_for_loading
    from hyflow.models.sources.hf_weights import load_hf_weights
    from hyflow.models.sources.model_source import hf_description
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.tools.convert.preflight import conversion_world
    from hyflow.tools.convert.verify import forward_logits

    tp, pp, ep, etp = layout
    groups = init_training_groups(Layout(tp=tp, pp=pp, ep=ep, etp=etp).with_dp_for(conversion_world(tp, pp, ep, etp)))
    out = []
    for path in paths:
        desc = hf_description(path)
        model = build_model_for_loading(desc, groups, dtype="fp32", spec="local")
        load_hf_weights(model, path, desc, groups)
        out.append(forward_logits(model.eval(), torch.tensor(tokens), desc.vocab_size, groups))
    return out


def _export_all(jobs) -> list:
    from hyflow.tools.convert.mcore2hf import export_rank

    return [export_rank(job) for job in jobs]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Dict[str, Any]:
    pytest.importorskip("transformers")
    from hyflow.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("hf_moe")
    tokens = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    out: Dict[str, Any] = {"tokens": tokens.tolist(), "path": {}, "logits": {}}
    for name in FAMILIES:
        model = make_tiny_hf_model(str(root / name), name)
        out["path"][name] = str(root / name)
        with torch.no_grad():
            out["logits"][name] = model(tokens).logits.float()
    return out


@pytest.fixture(scope="module")
def checkpoints(sources, tmp_path_factory) -> Dict[Tuple[str, str], str]:
    from hyflow.tools.convert.hf2mcore import prepare_conversion

    root = tmp_path_factory.mktemp("mcore_moe")
    out = {}
    for label, (tp, pp, ep, etp) in WRITTEN.items():
        jobs = []
        for name in FAMILIES:
            plan, job = prepare_conversion(sources["path"][name], str(root / f"{name}_{label}"), tp=tp, pp=pp,
                                           ep=ep, etp=etp)
            jobs.append(job)
            out[(name, label)] = job.out_dir
        run_on_ranks(_convert_all, plan.world_size, jobs, timeout=TIMEOUT)
    return out


def _check(per_rank: list, ckpts: List[Tuple[str, str]], sources, loaded: str) -> None:
    for i, (name, written) in enumerate(ckpts):
        got = [r[i] for r in per_rank if r[i] is not None]
        assert got, "no rank of the last stage returned logits"
        ref = sources["logits"][name]
        for logits in got:
            err = float((logits - ref).abs().max() / ref.abs().max())
            assert err <= TOLERANCE, (name, written, loaded, err)
            assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_two_rank_layouts_match_transformers(sources, checkpoints) -> None:
    """TP=2 x EP=2 (ETP=1) and TP=2 x ETP=2 on 2 ranks, each loading both checkpoints and the HF
    directories directly."""
    ckpts = [(n, label) for label in WRITTEN for n in FAMILIES]
    paths = [checkpoints[c] for c in ckpts]
    for layout in [(2, 1, 2, 1), (2, 1, 1, 2)]:
        per_rank = run_on_ranks(_logits_all, 2, paths, layout, sources["tokens"], timeout=TIMEOUT)
        _check(per_rank, ckpts, sources, f"tp{layout[0]} ep{layout[2]} etp{layout[3]}")
    # the HF directories read directly (no conversion step), experts split by EP and by ETP
    for layout in [(2, 1, 2, 1), (2, 1, 1, 2)]:
        per_rank = run_on_ranks(_hf_logits_all, 2, [sources["path"][n] for n in FAMILIES], layout,
                                sources["tokens"], timeout=TIMEOUT)
        _check(per_rank, [(n, "hf") for n in FAMILIES], sources, f"hf tp{layout[0]} ep{layout[2]} etp{layout[3]}")


def test_four_rank_layout_matches_transformers(sources, checkpoints) -> None:
    """PP=2 x EP=2 on 4 ranks, loading both checkpoints."""
    ckpts = [(n, label) for label in WRITTEN for n in FAMILIES]
    per_rank = run_on_ranks(_logits_all, 4, [checkpoints[c] for c in ckpts], (1, 2, 2, None),
                            sources["tokens"], timeout=TIMEOUT)
    _check(per_rank, ckpts, sources, "pp2 ep2")


def test_round_trip_through_expert_parallel_checkpoint_is_bit_identical(sources, checkpoints, tmp_path) -> None:
    from test_convert_parity import check_round_trip

    from hyflow.tools.convert.mcore2hf import prepare_export

    jobs, outs = [], {}
    for name in FAMILIES:
        outs[name] = str(tmp_path / name)
        jobs.append(prepare_export(checkpoints[(name, "pp2ep2")], outs[name], log=lambda *_: None)[1])
    run_on_ranks(_export_all, 1, jobs, timeout=TIMEOUT)
    check_round_trip(sources, outs)


def test_hf_config_round_trip_and_refusals() -> None:
    from hyflow.models.description import ModelDescriptionError
    from hyflow.models.hf_mapping import (description_from_hf_config, hf_config_from_description,
                                          hf_parameter_shapes)
    from hyflow.testing.tiny_models import tiny_hf_config

    for name in FAMILIES:
        cfg = tiny_hf_config(name).to_dict()
        desc = description_from_hf_config(cfg)
        assert desc.family == name and desc.moe.num_experts == 8 and desc.moe.top_k == 2
        again = description_from_hf_config(hf_config_from_description(desc))
        assert again == desc, name
        shapes = hf_parameter_shapes(desc)
        assert len([k for k in shapes if ".experts.7." in k]) == 3 * desc.num_layers
    qwen2 = description_from_hf_config(tiny_hf_config("qwen2_moe").to_dict())
    assert (qwen2.moe.pre_softmax, qwen2.moe.shared_expert_ffn_hidden_size, qwen2.moe.shared_expert_gate,
            qwen2.qkv_bias) == (True, 48, True, True)
    qwen3 = description_from_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    assert qwen3.qk_layernorm and not qwen3.moe.pre_softmax and not qwen3.qkv_bias
    with pytest.raises(ModelDescriptionError, match="decoder_sparse_step=2"):
        description_from_hf_config(tiny_hf_config("qwen3_moe", decoder_sparse_step=2).to_dict())
    with pytest.raises(ModelDescriptionError, match="mlp_only_layers=\\[1\\]"):
        description_from_hf_config(tiny_hf_config("qwen2_moe", mlp_only_layers=[1]).to_dict())
