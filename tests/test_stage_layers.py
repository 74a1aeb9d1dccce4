"""Uneven pipeline stages (``Layout.stage_layers``): the config knob and its one error, the RL
actor's automatic split, the memory estimate, and - through the real Megatron-Core model at
PP=2 with 1/3 of a 4-layer model - log-probs and gradients equal to the unsharded model's."""

import pytest
import torch

from hyflow.config import ConfigError
from hyflow.models.description import tiny_llama
from hyflow.parallel.layout import Layout, LayoutError, merge_stage_layers
from hyflow.testing import run_on_ranks

QUICKSTART = "configs/quickstart.yaml"
PP2 = ["actor.layout.tp=1", "actor.layout.pp=2", "model.num_layers=4"]


def _load(overrides):
    from hyflow.jobs.registry import load_job_config

    return load_job_config(QUICKSTART, list(overrides))


# ---------------------------------------------------------------------------- the config knob
@pytest.mark.parametrize("split,match", [
    ("[1,2]", r"sums to 3 layers but the model has num_layers=4"),
    ("[4]", r"lists 1 stage\(s\) but pp=2"),
    ("[0,4]", r"positive whole number"),
])
def test_a_bad_split_is_one_config_error(split, match):
    with pytest.raises(ConfigError, match=match):
        _load(PP2 + [f"actor.layout.stage_layers={split}"])


def test_megatron_form_and_virtual_stages_are_checked():
    with pytest.raises(LayoutError, match=r"middle stages \[1, 2\] differ"):
        Layout(pp=4, stage_layers=[2, 1, 2, 1])
    with pytest.raises(LayoutError, match="interleaved pipeline"):
        Layout(pp=2, vpp=2, stage_layers=[1, 3])
    assert Layout(pp=4, stage_layers=[3, 2, 2, 1]).megatron_stage_kwargs(8) == {
        "num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 1}
    assert Layout(pp=2, stage_layers=[2, 2]).megatron_stage_kwargs(4) == {}  # even: Megatron's default
    assert Layout(pp=2).layers_per_stage(4) == (2, 2)
    assert merge_stage_layers((3, 2, 2, 1), 2) == (5, 3)


def test_the_actor_split_is_automatic_and_an_explicit_one_is_kept():
    from hyflow.models.stage_split import balanced_stage_layers, job_head_layers

    big_vocab = PP2 + ["model.vocab_size=4096"]  # an output layer worth several of its 64-wide layers
    cfg = _load(big_vocab)
    layout = cfg.actor_layout(2)
    head = job_head_layers(cfg, cfg.model)
    want = balanced_stage_layers(4, 2, head)
    assert head > 2 and want == [3, 1] and layout.stage_layers == (3, 1)
    assert layout.stage_layers == _load(big_vocab).actor_layout(2).stage_layers  # deterministic
    assert any("stage_layers: automatic 3/1" in n for n in cfg.notes)
    # the quickstart's own output layer (128 x 64) is light: the split stays even
    assert _load(PP2).actor_layout(2).stage_layers == (2, 2)
    assert _load(PP2 + ["actor.layout.stage_layers=[2,2]"]).actor_layout(2).stage_layers == (2, 2)
    assert _load(["actor.layout.tp=1"]).actor_layout(2).stage_layers is None  # no pipeline, nothing to split
    # 6 layers at PP=4 do not split evenly: the automatic split still builds
    assert sum(_load(["actor.layout.tp=1", "actor.layout.pp=4", "model.num_layers=6",
                      "trainer.nproc=4"]).actor_layout(4).stage_layers) == 6


def test_memory_estimate_counts_each_stage_own_layers():
    from hyflow.plan import memory_estimate as mem

    desc = tiny_llama(vocab_size=200)
    per_layer = mem.layer_params(desc, 1)
    even = mem.stage_params(desc, Layout(pp=2))
    uneven = mem.stage_params(desc, Layout(pp=2, stage_layers=[1, 3]))
    assert uneven[0] == even[0] - per_layer and uneven[1] == even[1] + per_layer
    est = mem.training_estimates(desc, Layout(pp=2, stage_layers=[3, 1]), dtype="fp32", seq=16, micro_batch_size=2,
                                 n_micro=4, attention="sdpa", recompute="none", distributed_optimizer=False)
    layer_act = mem.layer_activation_bytes(desc, Layout(pp=2), 16, 2, "sdpa", "none", "fp32")
    # stage 0 keeps 2 micro-batches of 3 layers, stage 1 one micro-batch of 1 layer (+ each stage's input)
    acts = [e.get("activations") for e in est]
    assert acts[0] - acts[1] == pytest.approx(2 * 3 * layer_act - 1 * 1 * layer_act + 16 * 2 * 64 * 4, abs=2)
    assert "2 micro-batch chunk(s) x 3 layer(s)" in next(i.note for i in est[0].items if i.name == "activations")


def test_plan_reports_and_uses_the_split():
    from hyflow.plan.core import PlanOptions, build_plan
    from hyflow.plan.report import format_table

    result = build_plan(QUICKSTART, PP2 + ["actor.layout.stage_layers=[1,3]"],
                        PlanOptions(world_size=2, megatron_ranks=()))
    assert not result.errors, result.errors
    actor = result.roles[0]
    assert actor.layout.stage_layers == (1, 3)
    from hyflow.plan import memory_estimate as mem
    assert actor.stage_params == mem.stage_params(actor.model, Layout(pp=2, stage_layers=[1, 3]))
    text = format_table(result)
    assert "stages 1/3" in text and "pipeline stages: builds 1/3 layers, actor.layout.stage_layers" in text


# ------------------------------------------------------------------ through the real model
def _parity(tp, pp, split):
    """Per-token log-probs of a batch and every parameter's gradient of a policy loss, by global
    name (gathered over TP), plus Megatron's own layer numbering on this stage."""
    import torch.distributed as dist

    from hyflow.models.builder import build_gpt_model
    from hyflow.models.weights import _tp_unslice, global_name, layer_offset, load_full_state_dict, \
        random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.rl.batch import MicroBatching, make_micro_batches
    from hyflow.rl.step_losses import PolicyLoss, forward_score, logprob_scorer
    from hyflow.testing.rl import random_policy_batch
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    groups = init_training_groups(Layout(tp=tp, pp=pp, stage_layers=split), seed=3)
    desc = tiny_llama(vocab_size=90, num_layers=4, tied_embeddings=False)
    model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    offset = layer_offset(desc, groups)
    numbers = [layer.layer_number - 1 for layer in model.decoder.layers]  # Megatron's global numbering
    chunks = wrap_ddp([model], groups, distributed_optimizer=False)
    lengths = [9, 4, 13, 6]
    B, S = len(lengths), max(lengths)
    cols, cfg = random_policy_batch(lengths, 90)
    mask = cols["response_mask"]
    micro = make_micro_batches(cols, lengths, MicroBatching(2).plan(lengths), packed=False)
    logp = forward_score(chunks, micro, logprob_scorer(90, groups.pgs.tp, 1.0, fused=False), groups, (B, S))
    chunks[0].zero_grad_buffer()
    forward_backward(chunks, micro, loss_fn=PolicyLoss(cfg, 90, groups.pgs.tp, 1.0, fused=False), with_labels=False)
    grads = {}
    for name, param in model.named_parameters():
        shards = [torch.empty_like(param.main_grad) for _ in range(groups.pgs.tp.size())]
        dist.all_gather(shards, param.main_grad.contiguous(), group=groups.pgs.tp)
        full = _tp_unslice(shards, param)
        key = global_name(name, offset)
        grads[key] = full[:90].clone() if key in ("embedding.word_embeddings.weight", "output_layer.weight") else full
    return {"logp": (logp * mask).clone(), "grads": grads, "offset": offset, "numbers": numbers}


@pytest.fixture(scope="module")
def unsharded():
    return run_on_ranks(_parity, 1, 1, 1, None)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("tp,split", [(1, (1, 3)), (1, (3, 1))], ids=["pp2-1-3", "pp2-3-1"])
def test_uneven_pp2_equals_the_unsharded_model(unsharded, tp, split):
    results = run_on_ranks(_parity, tp * 2, tp, 2, split, timeout=600)
    grads = {}
    for rank, r in enumerate(results):
        stage = rank // tp
        # Megatron numbers this stage's layers from the offset the weights code uses
        assert r["offset"] == sum(split[:stage]) and r["numbers"] == list(range(r["offset"], r["offset"] + split[stage]))
        assert (r["logp"] - unsharded["logp"]).abs().max() <= 1e-6
        grads.update(r["grads"])
    assert set(grads) == set(unsharded["grads"])
    for name, want in unsharded["grads"].items():
        scale = max(1.0, float(want.abs().max()))
        assert (grads[name] - want).abs().max() <= 1e-6 * scale, name
    assert float(unsharded["grads"]["decoder.layers.0.mlp.linear_fc1.weight"].abs().max()) > 0


# ------------------------------------------------------------------------ HF <-> Megatron
def _convert(job):
    from hyflow.tools.convert.hf2mcore import convert_rank

    convert_rank(job)


def _logits_at(ckpt, split, tokens):
    from hyflow.checkpoint.model import load_model_from_checkpoint
    from hyflow.parallel.groups import init_training_groups
    from hyflow.tools.convert.verify import forward_logits

    groups = init_training_groups(Layout(pp=len(split), stage_layers=split))
    model, desc, _ = load_model_from_checkpoint(ckpt, groups)
    model.eval()
    return forward_logits(model, torch.tensor(tokens), desc.vocab_size, groups)


def _export(job):
    from hyflow.tools.convert.mcore2hf import export_rank

    export_rank(job)


@pytest.mark.multirank
def test_hf_to_megatron_at_uneven_pp_and_back_round_trips(tmp_path):
    """hf2mcore --pp 2 --stage-layers 1,3 writes each layer under its global index: loaded at
    another uneven split (3/1) the logits are HF's, and the export back to HF is bit-identical."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from hyflow.tools.convert.hf2mcore import prepare_conversion
    from hyflow.tools.convert.mcore2hf import prepare_export
    from hyflow.testing.tiny_models import make_tiny_hf_model

    src = str(tmp_path / "hf")
    hf = make_tiny_hf_model(src, "llama3", weights_format="safetensors")  # 4 layers
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(tokens).logits.float()
    plan, job = prepare_conversion(src, str(tmp_path / "mcore"), pp=2, stage_layers=[1, 3])
    assert plan.stage_layers == (1, 3) and job.stage_layers == (1, 3)
    run_on_ranks(_convert, 2, job, timeout=600)
    got = run_on_ranks(_logits_at, 2, str(tmp_path / "mcore"), (3, 1), tokens.tolist(), timeout=600)[-1]
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    _, back_job = prepare_export(str(tmp_path / "mcore"), str(tmp_path / "back"))
    run_on_ranks(_export, 1, back_job, timeout=600)
    src_t, back_t = load_file(f"{src}/model.safetensors"), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(src_t) == sorted(back_t)
    for key in src_t:
        assert torch.equal(src_t[key], back_t[key]), key
    with pytest.raises(Exception, match="sums to 3 layers"):
        prepare_conversion(src, str(tmp_path / "bad"), pp=2, stage_layers=[1, 2])
