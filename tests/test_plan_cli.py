"""``hyflow plan``: the presets pass at their world sizes on H100-80GB, and configs that do not
divide or do not fit fail with a message that names the numbers and the fix."""

from __future__ import annotations

import json
import os

import pytest

from hyflow.cli import main
from hyflow.plan.core import PlanOptions, build_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")


def _plan(capsys, *args):
    """The human output (table only) and, from a second run with --json, the JSON object."""
    code = main(["plan", *args, "--no-megatron"])
    out, err = capsys.readouterr()
    assert not out.strip().splitlines()[-1].startswith("{")
    assert main(["plan", *args, "--no-megatron", "--json"]) == code
    json_out, json_err = capsys.readouterr()
    assert len(json_out.strip().splitlines()) == 1
    return code, out, json_err, json.loads(json_out)


@pytest.mark.parametrize("name, world, gen", [
    ("llama3_8b_8gpu", 8, (2, 1)),
    ("qwen2_72b_128gpu", 128, (8, 1)),
    ("qwen2_72b_1024gpu", 1024, (4, 1)),
])
def test_presets_fit_h100_80gb(name, world, gen):
    result = build_plan(os.path.join(CONFIGS, name + ".yaml"), [],
                        PlanOptions(world_size=world, gpu_memory_gib=80, megatron_ranks=()))
    assert not result.errors, result.errors
    assert result.fits and result.required_bytes < 80 * 2**30
    assert result.job == "rl" and result.world_size == world
    assert (result.generation["tp"], result.generation["pp"]) == gen
    phases = {p.phase for p in result.phases}
    assert {"actor update", "log-probs", "generation"} <= phases
    assert result.reshard.world_size == world
    assert {r.name for r in result.roles} >= {"actor", "reference"}


def test_seed_deployment_layout(capsys):
    code, out, err, report = _plan(capsys, os.path.join(CONFIGS, "qwen2_72b_1024gpu.yaml"),
                                   "--world-size", "1024")
    assert code == 0, err
    actor = report["roles"]["actor"]["layout"]
    assert (actor["tp"], actor["pp"], actor["dp"]) == (8, 4, 32)
    assert report["generation"]["micro_dp_size"] == 8 and report["generation"]["dp"] == 256
    assert "Generation layout of the actor: TP_g=4 PP_g=1 DP_g=256 (micro-DP 8)" in out
    assert "KV cache" in out and "fits" in out


def test_quickstart_and_lm_on_cpu(capsys):
    code, out, err, report = _plan(capsys, os.path.join(CONFIGS, "quickstart.yaml"), "--device", "cpu")
    assert code == 0, err
    assert report["job"] == "rl" and report["world_size"] == 2
    assert report["memory"]["reserve_bytes"] == 0
    assert report["generation"]["micro_dp_size"] == 2 and report["generation"]["tp"] == 1
    assert report["reshard"]["bytes_recv_max"] > 0
    code, out, err, report = _plan(capsys, os.path.join(CONFIGS, "lm_tiny.yaml"), "--device", "cpu")
    assert code == 0, err
    assert report["job"] == "lm" and report["generation"] is None and report["reshard"] is None
    assert set(report["memory"]["phases"]["train"]["items"]) == {  # attention buffer: the CPU's local spec
        "weights", "grads", "optimizer", "activations", "attention buffer", "logits", "backward transient"}


@pytest.mark.parametrize("args, code, needles", [
    (["qwen2_72b_1024gpu.yaml", "--world-size", "1000"], 2,
     ["world size 1000 is not divisible by tp*pp*cp = 8*4*1 = 32"]),
    (["qwen2_72b_1024gpu.yaml", "actor.layout.tp=16"], 2,
     ["tp=16 does not divide the 8 key/value groups"]),
    (["qwen2_72b_1024gpu.yaml", "rollout.layout.tp=3"], 2, ["rollout.layout tp=3 pp=1 must divide"]),
    (["llama3_8b_8gpu.yaml", "rollout.max_concurrent=1024"], 1,
     ["memory: phase 'generation' needs", "of 80 GiB per GPU: DOES NOT FIT",
      "KV cache 64.0 GiB", "256 sequences x 4096 tokens", "lower rollout.max_concurrent"]),
    (["qwen2_72b_128gpu.yaml", "--gpu-memory", "40"], 1,
     ["memory: phase 'generation' needs", "but a GPU has 40.0 GiB"]),
])
def test_failures_are_clear(capsys, args, code, needles):
    got, out, err, report = _plan(capsys, os.path.join(CONFIGS, args[0]), *args[1:])
    assert got == code, out + err
    assert not report["ok"] and report["errors"]
    for needle in needles:
        assert needle in out + err, needle
    assert err.startswith("hyflow plan: ")  # with --json, the error also reaches the person
    assert out.count(report["errors"][0]) == 1  # the human output states it once
    advice = report["errors"][0].partition("Try: ")[2].split("; ")
    assert len(advice) == len(set(advice))  # each remedy named once


def test_generation_phase_counts_offloaded_state_out():
    path = os.path.join(CONFIGS, "llama3_8b_8gpu.yaml")
    opts = PlanOptions(world_size=8, gpu_memory_gib=80, megatron_ranks=())

    def resident(*overrides):
        result = build_plan(path, list(overrides), opts)
        gen = next(p for p in result.phases if p.phase == "generation")
        update = next(p for p in result.phases if p.phase == "actor update")
        return gen.get("actor grads+optimizer"), update.get("grads"), update.get("optimizer")

    kept, grads, optim = resident("rollout.offload_grad_buffers=false", "rollout.offload_optimizer=false")
    assert kept == grads + optim > 0
    assert resident("rollout.offload_grad_buffers=true", "rollout.offload_optimizer=false")[0] == optim
    assert resident("rollout.offload_grad_buffers=false", "rollout.offload_optimizer=true")[0] == grads
    assert resident("rollout.offload_grad_buffers=true", "rollout.offload_optimizer=true")[0] == 0


def test_plan_with_critic_and_cpu_staging():
    """PPO with a critic plans (the critic is a role of its own); on CPU every phase counts the
    TP merge's shared-memory staging, sized like the executor's."""
    from hyflow.hybrid.reshard_plan import staging_bytes_per_rank

    path = os.path.join(CONFIGS, "quickstart.yaml")
    result = build_plan(path, ["critic.enable=true", "algorithm.adv_estimator=gae"],
                        PlanOptions(world_size=2, device="cpu", megatron_ranks=()))
    assert not result.errors, result.errors
    assert {r.name for r in result.roles} >= {"actor", "critic"}
    s = result.reshard.tp_ratio
    assert s == 2
    want = staging_bytes_per_rank(max(result.reshard.bytes_recv) // (s - 1), s)
    assert want > 0 and all(p.get("reshard staging") == want for p in result.phases)
    gpu = build_plan(path, [], PlanOptions(world_size=2, megatron_ranks=()))
    assert all(p.get("reshard staging") == 0 for p in gpu.phases)


def test_plan_shows_pools_weight_sync_and_both_modes(capsys):
    code, out, err, report = _plan(capsys, os.path.join(CONFIGS, "qwen2_72b_1024gpu.yaml"), "trainer.mode=one_step_off")
    assert code == 0, err
    pools = {p["name"]: p for p in report["placement"]["pools"]}
    assert set(pools) == {"train", "gen"} and pools["gen"]["ranks"] == [512, 1024]
    assert all(p["bytes"] > 0 for p in pools.values())  # memory per pool
    sync = report["weight_sync"]
    # each of the 128 generation replicas (TP_g=4) receives the model once (its replicated norms once
    # per TP_g rank: a few MiB); a rank only its slice
    assert 128 * sync["model_bytes"] <= sync["total_bytes"] <= 128 * sync["model_bytes"] * 1.001
    assert sync["bytes_recv_max"] * 4 >= sync["model_bytes"] > sync["bytes_recv_max"]
    modes = report["throughput"]
    assert modes["sync"]["steps_per_s"] > 0 and modes["one_step_off"]["steps_per_s"] > 0
    assert "Weight sync training pool -> generation pool" in out and "one_step_off (train 512 GPUs" in out
