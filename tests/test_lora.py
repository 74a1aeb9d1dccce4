"""LoRA on the Megatron actor (hyflow.models.lora): config checks, step 0 = the base model bit for
bit, a frozen base (no gradient buffers, no optimizer state), the reference = the base with the
adapters off, the exact merge / unmerge, and checkpoints that hold the adapters only."""

import pytest
import torch

from hyflow.config import ConfigError
from hyflow.models.lora_config import LoRAConfig
from hyflow.testing import run_on_ranks


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("kwargs, needles", [
    (dict(rank=0), ["rank must be a positive integer, got 0"]),
    (dict(rank=-4, alpha=0.0), ["rank must be a positive integer, got -4", "alpha must be a finite number > 0"]),
    (dict(dropout=1.0), ["dropout must be in [0, 1)"]),
    (dict(targets=["q_proj"]), ["'q_proj' is a Hugging Face name", "use 'linear_qkv'"]),
    (dict(targets=["linear_qvk", "linear_proj", "linear_proj"]),
     ["unknown target 'linear_qvk' (did you mean 'linear_qkv'?)", "lists linear_proj more than once"]),
    (dict(targets=[]), ["targets is empty"]),
])
def test_config_rejects_bad_settings_in_one_error(kwargs, needles):
    with pytest.raises(ConfigError) as err:
        LoRAConfig(**kwargs).validate()
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_config_from_a_job_config_names_the_key():
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import QUICKSTART

    cfg = load_job_config(QUICKSTART, ["actor.sft_warmup_steps=0", "actor.lora.rank=8"])
    assert cfg.actor.lora.rank == 8 and cfg.actor.lora.scale == 4.0
    with pytest.raises(ConfigError, match=r"actor.lora.*unknown target 'mlp'"):
        load_job_config(QUICKSTART, ["actor.sft_warmup_steps=0", "actor.lora.targets=[mlp]"])
    with pytest.raises(ConfigError, match="sft_warmup_steps"):
        load_job_config(QUICKSTART, ["actor.lora.rank=8"])  # the quickstart warms up first


# ------------------------------------------------------------------ one rank
def _one_rank():
    import torch.distributed as dist

    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.lora import (BaseModelView, adapter_numel, adapters_disabled, apply_lora,
                                    merge_adapters, unmerge_adapters)
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from hyflow.training.step import train_step

    groups = init_training_groups(Layout(), seed=5)
    desc = tiny_llama(vocab_size=200, num_query_groups=2)  # GQA: fused qkv with 2 groups
    full = random_full_state_dict(desc, seed=3)
    plain = build_gpt_model(desc, groups, spec="local", config_overrides={"perform_initialization": False})
    model = build_gpt_model(desc, groups, spec="local", config_overrides={"perform_initialization": False})
    for m in (plain, model):
        load_full_state_dict(m, full, desc, groups)
    plain.eval()
    base_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = LoRAConfig(rank=4, alpha=8.0)
    adapted = apply_lora(model, cfg, seed=9)
    from hyflow.plan.lora import stage_adapter_params

    out = {"adapted": adapted, "layers": desc.num_layers, "adapter_numel": adapter_numel(model),
           "planned_numel": stage_adapter_params(desc, Layout(), cfg)[0]}
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).unsqueeze(0).expand(2, -1)

    def logits(m):
        with torch.no_grad():
            return m(tokens, pos, None).clone()

    model.eval()
    out["step0_equal"] = torch.equal(logits(model), logits(plain))
    out["trained"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    out["sharded_keys"] = sorted(model.sharded_state_dict().keys())
    chunks = wrap_ddp([model], groups, False)
    out["main_grad"] = sorted(n for n, p in model.named_parameters() if hasattr(p, "main_grad"))
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-2), 3)
    out["optimizer_numel"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    model.train()
    batch = {"tokens": tokens, "position_ids": pos, "labels": torch.roll(tokens, -1, 1),
             "loss_mask": torch.ones(2, 12)}
    for _ in range(2):
        stats = train_step(chunks, optimizer, scheduler, [dict(batch)], groups=groups)
    out["grad_norm"] = stats.get("grad_norm")
    out["base_unchanged"] = all(torch.equal(p, base_weights[n]) for n, p in model.named_parameters()
                                if n in base_weights)
    model.eval()
    trained = logits(model)
    out["trained_differs"] = not torch.equal(trained, logits(plain))
    with adapters_disabled(chunks):
        out["disabled_equal"] = torch.equal(logits(model), logits(plain))
    out["view_equal"] = torch.equal(logits(BaseModelView(chunks[0])), logits(plain))
    out["view_params"] = len(list(BaseModelView(model).parameters()))
    out["active_after"] = torch.equal(logits(model), trained)
    merges = merge_adapters(model)
    merged = logits(model)
    out["merged_close"] = (merged - trained).abs().max().item() / trained.abs().max().item()
    out["kept_bytes"] = sum(m.kept_bytes for m in merges)
    unmerge_adapters(model, merges)
    out["unmerged_exact"] = all(torch.equal(p, base_weights[n]) for n, p in model.named_parameters()
                                if n in base_weights)
    out["after_unmerge"] = torch.equal(logits(model), trained)
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def one_rank():
    return run_on_ranks(_one_rank, 1)[0]


def test_step0_is_the_base_model_exactly(one_rank):
    assert one_rank["adapted"] == one_rank["layers"] * 4  # 4 targets a layer
    assert one_rank["step0_equal"]


def test_only_adapters_train(one_rank):
    trained = one_rank["trained"]
    assert trained and all(n.endswith((".lora_A", ".lora_B")) for n in trained)
    assert one_rank["main_grad"] == trained  # DDP buffers for the adapters only
    assert one_rank["optimizer_numel"] == one_rank["adapter_numel"] == one_rank["planned_numel"]
    assert one_rank["sharded_keys"] == trained  # checkpoints hold the adapters only
    assert one_rank["base_unchanged"] and one_rank["trained_differs"]
    assert one_rank["grad_norm"] > 0


def test_reference_is_the_base_with_adapters_off(one_rank):
    # the trained adapters change the logits; with them off (context or the view) the base's come back
    assert one_rank["disabled_equal"] and one_rank["view_equal"] and one_rank["active_after"]
    assert one_rank["view_params"] == 0  # the view owns no weights: no second copy


def test_merge_matches_and_unmerges_exactly(one_rank):
    assert one_rank["merged_close"] < 1e-5
    assert one_rank["unmerged_exact"] and one_rank["after_unmerge"]


def test_merged_weight_unmerge_is_bit_exact_in_bf16_and_fp32():
    from hyflow.models.lora import MergedWeight

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(64, 48, generator=gen) * 0.02).to(dtype)
        w[0, :4] = torch.tensor([0.0, 1.0, -2.0, 2.0 ** -20])  # ties, binade edges, tiny values
        a = torch.randn(8, 48, generator=gen).to(dtype)
        b = (torch.randn(64, 8, generator=gen) * 0.5).to(dtype)
        original = w.clone()
        merge = MergedWeight(w, a, b, scale=2.0)
        merge.rows = 16  # several blocks
        merge.merge()
        expected = (original.float() + 2.0 * (b.float() @ a.float())).to(dtype)
        assert (w.float() - expected.float()).abs().max() <= expected.float().abs().max() * 1e-2
        assert not torch.equal(w, original)
        merge.unmerge()
        assert torch.equal(w, original), dtype


def test_plan_shows_the_memory_lora_saves():
    from hyflow.plan.core import PlanOptions, build_plan
    from hyflow.testing.rl import QUICKSTART

    args = ["actor.sft_warmup_steps=0"]
    opts = PlanOptions(world_size=2, gpu_memory_gib=80, megatron_ranks=())
    full, lora = build_plan(QUICKSTART, args, opts), build_plan(QUICKSTART, args + ["actor.lora.rank=4"], opts)
    update = {r: next(p for p in plan.phases if p.phase == "actor update") for r, plan in (("full", full), ("lora", lora))}
    assert update["lora"].get("weights") == update["full"].get("weights")  # the base stays, frozen
    assert 0 < update["lora"].get("grads") < update["full"].get("grads") / 4  # the adapters' only
    assert update["full"].get("reference weights") > 0 and update["lora"].get("reference weights") == 0
    assert update["lora"].get("generation weights (LoRA)") > 0  # TP=2 -> TP_g=1: the base stays in the buffer
    assert any(n.startswith("actor.lora (rank 4") and "less" in n for n in lora.notes)


def _first_layer_trains_under_full_recompute():
    from hyflow.models.builder import build_gpt_model, recompute_overrides
    from hyflow.models.description import tiny_llama
    from hyflow.models.lora import apply_lora, lora_modules
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from hyflow.training.step import train_step

    groups = init_training_groups(Layout(), seed=5)
    desc = tiny_llama(vocab_size=200)
    model = build_gpt_model(desc, groups, spec="local",
                            config_overrides={"perform_initialization": False, **recompute_overrides("full")})
    load_full_state_dict(model, random_full_state_dict(desc, seed=3), desc, groups)
    apply_lora(model, LoRAConfig(rank=4), seed=9)
    chunks = wrap_ddp([model], groups, False)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-2), 1)
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    train_step(chunks, optimizer, scheduler, [{"tokens": tokens, "position_ids": torch.arange(12).expand(2, -1),
                                                 "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(2, 12)}],
               groups=groups)
    return [bool(m.lora_B.abs().max() > 0) for m in lora_modules(model)]


def test_full_recomputation_trains_the_first_layers_adapters():
    """Megatron's reentrant recomputation differentiates a block only when its input needs a gradient;
    the frozen embedding's output is made to, so layer 0's adapters train too."""
    trained = run_on_ranks(_first_layer_trains_under_full_recompute, 1)[0]
    assert all(trained), trained
