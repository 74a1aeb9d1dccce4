"""The RL and DPO jobs with LoRA (actor.lora, critic.lora) on 2 ranks:

* the reference is the actor's base with the adapters off: at step 1 (B = 0) its log-probs equal
  the actor's bit for bit, after an update they differ (they would not, were the adapters left on);
* after the first transition the hybrid engine moves the adapters only (reshard/bytes_received);
* the base weights never change; a checkpoint holds the adapters (and references the base), and a
  fresh set-up resumes the adapters and their optimizer exactly;
* PPO with a LoRA critic (frozen trunk, adapters + value head trained) at PP=2 -> PP_g=1;
* DPO with precomputed reference log-probs of the base view trains the adapters only.
"""

import json
import os

import pytest
import torch

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

BASE = ["trainer.nproc=2", "data.task=digit_add", "data.task_size=64", "data.train_batch_size=4", "rollout.n=4",
        "actor.micro_batch_size=8", "actor.mini_batch_size=16", "actor.sft_warmup_steps=0", "actor.optim.lr=5e-3",
        "rollout.max_new_tokens=4", "rollout.temperature=1.5", "actor.lora.rank=4", "actor.lora.alpha=8",
        "actor.entropy_coeff=0.05"]  # a gradient even where every reward of the random model is 0


def _trained(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _rl(overrides, output_dir):
    import torch.distributed as dist

    import hyflow.jobs.rl as rl
    from hyflow.checkpoint.checkpointer import Checkpointer
    from hyflow.models.lora import BaseModelView
    from hyflow.testing.rl import rl_setup, rl_step

    args = BASE + [f"trainer.output_dir={output_dir}"] + overrides
    cfg, state, job = rl_setup(args)
    models = state.models
    rank = dist.get_rank()
    out = {"reference_is_view": isinstance(models.reference, BaseModelView),
           "adapter_bytes": models.weights.adapters.plan.bytes_recv[rank],
           "weight_bytes": models.weights.plan.bytes_recv[rank], "ref_vs_old": [], "bytes": []}
    frozen = {n: p.detach().clone() for n, p in models.actor.module.named_parameters() if not p.requires_grad}
    for _ in range(3):
        metrics, data = rl_step(cfg, state, job)
        mask = data["response_mask"] > 0
        out["ref_vs_old"].append((data["ref_logp"][mask] - data["old_logp"][mask]).abs().max().item())
        out["bytes"].append(metrics["reshard/bytes_received"])
        out["score"] = metrics["critic/score/mean"]
    out["base_unchanged"] = all(torch.equal(p, frozen[n]) for n, p in models.actor.module.named_parameters()
                                if n in frozen)
    roles = models.trained()
    saved = {name: _trained(m.module) for name, m in roles.items()}
    out["trained_names"] = {name: sorted(t) for name, t in saved.items()}
    ckpt = Checkpointer(cfg.trainer.output_dir, models.groups, models.desc, 2)
    path = rl.RLSteps(cfg, state, job, ckpt).save(state.step)
    ckpt.wait()
    if rank == 0:
        with open(os.path.join(path, "actor", "hyflow_checkpoint.json")) as f:
            out["info"] = json.load(f)
        out["actor_bytes"] = sum(os.path.getsize(os.path.join(path, "actor", f))
                                 for f in os.listdir(os.path.join(path, "actor")) if f.endswith(".distcp"))
    cfg2, state2, job2 = rl_setup(args)
    ckpt2 = Checkpointer(cfg2.trainer.output_dir, state2.models.groups, state2.models.desc, 2)
    out["resumed_step"] = rl.RLSteps(cfg2, state2, job2, ckpt2).resume()
    out["resumed_equal"] = all(torch.equal(saved[name][n], p) for name, m in state2.models.trained().items()
                               for n, p in _trained(m.module).items())
    out["full_bytes"] = sum(p.numel() * p.element_size() for p in models.actor.module.parameters()
                            if not p.requires_grad) * dist.get_world_size()
    return out


@pytest.mark.parametrize("overrides", [
    [],  # quickstart: TP=2 training, TP_g=1 generation
    ["actor.layout.tp=1", "actor.layout.pp=2", "algorithm.adv_estimator=gae", "critic.enable=true",
     "critic.lora.rank=4", "critic.optim.lr=1e-3"],
], ids=["grpo-tp2", "ppo-lora-critic-pp2"])
def test_rl_with_lora(overrides, tmp_path):
    results = run_on_ranks(_rl, 2, overrides, str(tmp_path / "run"), timeout=900)
    for rank, r in enumerate(results):
        assert r["reference_is_view"], rank
        assert r["ref_vs_old"][0] == 0.0, r["ref_vs_old"]  # step 1: the actor is its base exactly
        assert all(d > 0 for d in r["ref_vs_old"][1:]), r["ref_vs_old"]  # the reference ignores the adapters
        assert r["bytes"][0] == r["weight_bytes"] + r["adapter_bytes"], r["bytes"]
        assert r["bytes"][1:] == [r["adapter_bytes"]] * 2 and 0 < r["adapter_bytes"] < r["weight_bytes"] / 10
        assert r["base_unchanged"], rank
        assert all(".lora_" in n for n in r["trained_names"]["actor"])
        if "critic" in r["trained_names"]:  # its adapters and the value head (on the last stage)
            assert {n for n in r["trained_names"]["critic"] if ".lora_" not in n} <= {"output_layer.weight"}
            assert any(".lora_" in n for n in r["trained_names"]["critic"])
        assert r["resumed_step"] == 3 and r["resumed_equal"], rank
    info = results[0]["info"]["extra"]["lora"]
    assert info["rank"] == 4 and info["base"] == {"random_init_seed": 1234}
    assert results[0]["actor_bytes"] < results[0]["full_bytes"] / 3  # the adapters, not the weights


def _preference(output_dir, job):
    import torch.distributed as dist

    import hyflow.jobs.dpo as dpo
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import REPO

    cfg = load_job_config(os.path.join(REPO, "configs", "dpo_quickstart.yaml"), [
        f"job={job}", "trainer.total_steps=3", f"trainer.output_dir={output_dir}", "actor.lora.rank=8",
        "actor.optim.lr=1e-2", "data.task_size=64", "trainer.loggers=[]"])
    history = dpo.run(cfg)
    return history if dist.get_rank() == 0 else None


@pytest.mark.parametrize("job", ["dpo", "kto"])
def test_preference_jobs_with_lora_train_adapters_against_the_base(tmp_path, job):
    history = run_on_ranks(_preference, 2, str(tmp_path / job), job, timeout=900)[0]
    # step 1: the policy is its base exactly, so the implicit rewards (and KTO's KL point) are 0
    assert abs(history[0]["rewards/chosen"]) < 1e-6 and abs(history[0]["rewards/rejected"]) < 1e-6
    if job == "dpo":
        assert abs(history[0]["loss"] - 0.6931471805599453) < 1e-6  # log 2
        assert history[-1]["rewards/margins"] > 0  # the adapters moved the policy away from the base
    else:
        assert history[0]["kl"] == 0.0 and history[-1]["kl"] != 0.0
    step = os.path.join(str(tmp_path / job), "checkpoints", "step_000003", "actor", "hyflow_checkpoint.json")
    with open(step) as f:
        assert json.load(f)["extra"]["lora"]["rank"] == 8


def _job(overrides, out):
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner, load_job_config
    from hyflow.testing.rl import QUICKSTART

    cfg = load_job_config(QUICKSTART, [*BASE, f"trainer.output_dir={out}", "trainer.total_steps=3",
                                       "trainer.loggers=[]", *overrides])
    history = job_runner("rl")(cfg)  # as `hyflow train` runs it: pools go to the pooled loops
    return history if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_pooled_lora_actor_sends_merged_weights_like_colocated(tmp_path):
    """On placement pools the LoRA actor sends W + s B A (merged in the training layout, unmerged
    after the send): the generation pool samples what the colocated engine samples."""
    colocated = run_on_ranks(_job, 2, [], str(tmp_path / "colocated"), timeout=900)[0]
    pooled = run_on_ranks(_job, 3, ["trainer.nproc=3", "placement.pools={train: [0, 2], gen: [2, 3]}",
                                    "placement.actor=train", "placement.rollout=gen"], str(tmp_path / "pooled"),
                          timeout=900)[0]
    assert len(colocated) == len(pooled) == 3
    for a, b in zip(colocated, pooled):
        for key in ("response_length/mean", "actor/entropy", "actor/grad_norm", "critic/score/mean"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
    assert colocated[2]["actor/entropy"] != colocated[0]["actor/entropy"]  # the adapters trained
