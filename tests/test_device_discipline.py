"""Device discipline, proven on a machine without a GPU.

A tensor created without an explicit device is a host tensor: invisible on CPU, a crash or a
per-step host round trip on CUDA. These tests hold the GPU path on CPU:

(a) RL steps (GRPO at TP=2 with sequence parallelism, PPO + GAE with a critic at PP=2, the hybrid
    transition both ways) run under :class:`ImplicitDeviceGuard`: every implicit-device tensor
    factory creates a *meta* tensor, so using one breaks the step, and the call site is recorded;
    no pickling collective (``all_gather_object``, ...) runs in the step;
(b) every role's model (actor, reference, critic, reward model, the generation model's builder) is
    built for a target device and every parameter and buffer lands there;
(c) an AST scan of the step's packages flags tensor factories without ``device=``;
(d) sequence parallelism at TP=2 with sequence lengths not divisible by 2 equals TP=2 without it,
    for the actor and for the critic's value head (whose gradients were x TP under SP).

Allowed host-side call sites carry their reason.
"""

import ast
import dataclasses
import os

import pytest
import torch

from hyflow.testing import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(REPO, "engine")

#: (path suffix, function) -> why a tensor is deliberately created on the host there.
RUNTIME_ALLOW = {
    ("megatron/core/pipeline_parallel/schedules.py", "forward_step_calc_loss"):
        "Megatron's 0-dim token counter; a 0-dim host tensor combines with CUDA tensors as a scalar",
    ("megatron/core/utils.py", "local_multi_tensor_l2_norm"):
        "Megatron's fallback norm without Apex / Transformer Engine (GPU runs use TE's fused kernel)",
}
#: (file relative to engine/, function) -> why the factory there is deliberately host-side.
STATIC_ALLOW = {
    ("rl/update.py", "minibatch_assignment"): "host list of row indices (planning)",
}
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "randperm",
             "linspace", "logspace", "eye", "empty_strided", "as_tensor", "asarray", "scalar_tensor",
             "tril_indices", "triu_indices"}
STEP_PACKAGES = ("jobs", "rl", "training", "hybrid", "rollout")
PICKLING = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


# --------------------------------------------------------------------------- (a)


def _guarded_steps(overrides):
    import hyflow.jobs.rl as rl
    from hyflow.algorithms.kl import make_kl_controller
    from hyflow.jobs.registry import load_job_config
    from hyflow.data.dataset import build_dataset
    from hyflow.data.loader import PromptLoader
    from hyflow.data.tasks import load_data_tokenizer
    from hyflow.monitor.timers import PhaseTimers
    from hyflow.rewards.manager import RewardManager
    from hyflow.rl.models import build_rl_models
    from hyflow.rl.state import RLState
    from hyflow.testing.device_discipline import ImplicitDeviceGuard
    from hyflow.training.supervisor import StepSupervisor

    cfg = load_job_config(os.path.join(REPO, "configs", "quickstart.yaml"), [
        "trainer.nproc=2", "data.task_size=64", "data.train_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=4",
        "actor.mini_batch_size=4", "actor.micro_batch_size=2", "actor.sft_warmup_steps=0", "actor.ppo_epochs=1",
        "actor.max_tokens_per_micro_batch=40"] + overrides)
    tok = load_data_tokenizer(cfg.data)
    dataset = build_dataset(cfg.data, cfg.rollout, tok)
    loader = PromptLoader(dataset, cfg.data.train_batch_size, seed=3)
    models = build_rl_models(cfg, tok)
    state = RLState(models, loader, make_kl_controller(cfg.algorithm), StepSupervisor(3, device=models.groups.device))
    job = rl.StepJob(tok, RewardManager.from_config(cfg.reward), sorted({r.data_source for r in dataset}))
    guard = ImplicitDeviceGuard(allow=RUNTIME_ALLOW)
    metrics, pickled = [], []
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in PICKLING}
    for name, fn in originals.items():  # count pickling collectives: none belongs in a step
        setattr(dist, name, lambda *a, _name=name, _fn=fn, **k: (pickled.append(_name), _fn(*a, **k))[1])
    try:
        with guard:
            for _ in range(2):  # two steps: the transition train -> gen -> train twice
                m, _ = rl.rl_step(cfg, state, loader.next_batch(), job, PhaseTimers())
                state.step += 1
                metrics.append(m)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return sorted(set(guard.violations)), metrics, pickled


@pytest.mark.multirank
@pytest.mark.parametrize("overrides", [
    ["actor.layout.tp=2", "actor.layout.sequence_parallel=true", "algorithm.adv_estimator=grpo"],
    ["actor.layout.tp=1", "actor.layout.pp=2", "algorithm.adv_estimator=gae", "critic.enable=true",
     "actor.pack_sequences=true"],
], ids=["grpo-tp2-sp", "ppo-gae-critic-pp2-packed"])
def test_rl_steps_create_no_tensor_without_a_device(overrides):
    for violations, metrics, pickled in run_on_ranks(_guarded_steps, 2, overrides, timeout=900):
        assert violations == [], "tensors created without a device:\n" + "\n".join(violations)
        assert pickled == [], f"pickling collectives inside the RL step: {pickled}"
        assert all(m["actor/grad_norm"] == m["actor/grad_norm"] for m in metrics)  # the steps really trained


# --------------------------------------------------------------------------- (b)


def _build_for(device_name):
    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    groups = dataclasses.replace(init_training_groups(Layout(tp=2), seed=1), device=torch.device(device_name))
    desc = tiny_llama(vocab_size=100)
    frozen = {"perform_initialization": False}
    roles = {"actor": build_gpt_model(desc, groups, config_overrides=frozen),
             "reference": build_gpt_model(desc, groups, config_overrides=frozen),
             "critic / reward model": build_gpt_model(desc, groups, value_head=True, config_overrides=frozen),
             "generation (hybrid engine's builder call)": build_gpt_model(
                 desc, groups, padded_vocab_size=256, config_overrides=frozen)}
    return {role: sorted({str(t.device) for t in list(m.parameters()) + list(m.buffers())} | {
        str(m.rotary_pos_emb.inv_freq.device)}) for role, m in roles.items()}


@pytest.mark.multirank
def test_every_role_is_built_on_the_target_device():
    for placed in run_on_ranks(_build_for, 2, "meta", timeout=300):
        assert placed == {role: ["meta"] for role in placed}, placed


# --------------------------------------------------------------------------- (c)


def _implicit_factories(path):
    tree = ast.parse(open(path).read())
    owner = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.walk(node):
                owner.setdefault(id(child), node.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            yield node.lineno, owner.get(id(node), "<module>"), node.func.attr


def test_step_packages_name_a_device_for_every_tensor_factory():
    found = []
    for package in STEP_PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ENGINE, package)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ENGINE)
                for line, function, factory in _implicit_factories(path):
                    if (rel, function) not in STATIC_ALLOW:
                        found.append(f"engine/{rel}:{line} in {function}: torch.{factory}(...) without device=")
    assert found == [], "\n".join(found)


def test_the_scan_finds_an_implicit_factory(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef f(n, d):\n    a = torch.zeros(n, device=d)\n    return torch.arange(n)\n")
    assert list(_implicit_factories(str(bad))) == [(4, "f", "arange")]


# --------------------------------------------------------------------------- (d)


def _sp_parity():
    from types import SimpleNamespace

    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rl.batch import MicroBatching, make_micro_batches
    from hyflow.rl.step_losses import PolicyLoss, forward_score, logprob_scorer, loss_weights
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    desc = tiny_llama(vocab_size=96, num_attention_heads=4, num_query_groups=2, num_layers=2)
    lengths = [9, 4, 13, 7, 5]  # odd lengths: widths are padded to a multiple of TP
    gen = torch.Generator().manual_seed(4)
    B, S = len(lengths), max(lengths)
    tokens = torch.randint(0, 96, (B, S), generator=gen)
    mask = torch.zeros(B, S)
    for i, n in enumerate(lengths):
        mask[i, 2:n] = 1.0
    cols = {"tokens": tokens, "response_mask": mask, "old_logp": -torch.rand(B, S, generator=gen) * 3,
            "advantages": torch.randn(B, S, generator=gen)}
    cols["loss_weight"] = cols["token_weight"] = loss_weights(mask, "token-mean", mask.sum(),
                                                              (mask.sum(-1) > 0).sum())
    cfg = SimpleNamespace(policy_loss="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None, entropy_coeff=0.0,
                          use_kl_loss=False, loss_agg_mode="token-mean")
    out = {}
    for sp in (False, True):
        groups = init_training_groups(Layout(tp=2, sequence_parallel=sp), seed=3)
        model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
        load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
        chunks = wrap_ddp([model], groups, distributed_optimizer=False)
        micro = make_micro_batches(cols, lengths, MicroBatching(2).plan(lengths), pad_multiple=2 if sp else 1)
        assert all(mb["tokens"].shape[1] % 2 == 0 for mb in micro) or not sp
        logp = forward_score(chunks, micro, logprob_scorer(96, groups.pgs.tp), groups, (B, S))
        chunks[0].zero_grad_buffer()
        stats = forward_backward(chunks, micro, loss_fn=PolicyLoss(cfg, 96, groups.pgs.tp), with_labels=False)
        grads = torch.cat([b.grad_data.detach().clone().flatten() for b in chunks[0].buffers])
        out[sp] = (logp * mask, sum(float(s["actor/pg_loss"]) for s in stats), grads)
    return out


@pytest.mark.multirank
def test_sequence_parallel_with_odd_lengths_equals_tp_without_it():
    for result in run_on_ranks(_sp_parity, 2, timeout=600):
        (lp0, loss0, g0), (lp1, loss1, g1) = result[False], result[True]
        assert (lp0 - lp1).abs().max() <= 1e-6
        assert abs(loss0 - loss1) <= 1e-6 * max(1.0, abs(loss0))
        assert (g0 - g1).abs().max() <= 1e-5 * float(g0.abs().max()) and g0.abs().max() > 0


def _critic_sp_grads():
    from types import SimpleNamespace

    from hyflow.models.builder import build_gpt_model
    from hyflow.models.description import tiny_llama
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rl.batch import MicroBatching, make_micro_batches
    from hyflow.rl.step_losses import ValueLoss, loss_weights
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    desc = tiny_llama(vocab_size=96, num_attention_heads=4, num_query_groups=2, num_layers=2)
    lengths = [9, 4, 13, 7]
    gen = torch.Generator().manual_seed(5)
    B, S = len(lengths), max(lengths)
    mask = torch.zeros(B, S)
    for i, n in enumerate(lengths):
        mask[i, 2:n] = 1.0
    cols = {"tokens": torch.randint(0, 96, (B, S), generator=gen), "response_mask": mask,
            "old_values": torch.randn(B, S, generator=gen), "returns": torch.randn(B, S, generator=gen)}
    cols["loss_weight"] = cols["token_weight"] = loss_weights(mask, "token-mean", mask.sum(), (mask.sum(-1) > 0).sum())
    out = {}
    for sp in (False, True):
        groups = init_training_groups(Layout(tp=2, sequence_parallel=sp), seed=3)
        model = build_gpt_model(desc, groups, value_head=True, seed=11)  # Megatron's full-size init: same weights
        chunks = wrap_ddp([model], groups, distributed_optimizer=False)
        micro = make_micro_batches(cols, lengths, MicroBatching(2).plan(lengths), pad_multiple=2 if sp else 1)
        chunks[0].zero_grad_buffer()
        stats = forward_backward(chunks, micro, loss_fn=ValueLoss(SimpleNamespace(cliprange_value=0.5)),
                                 with_labels=False)
        # (the schedule ran finalize_model_grads: SP-marked gradients summed over TP)
        head = dict(model.named_parameters())["output_layer.weight"]
        grad = lambda p: p.main_grad if getattr(p, "main_grad", None) is not None else p.grad  # noqa: E731
        out[sp] = (sum(float(s["critic/vf_loss"]) for s in stats), grad(head).detach().clone(),
                   torch.cat([b.grad_data.detach().clone().flatten() for b in chunks[0].buffers]))
    return out


@pytest.mark.multirank
def test_critic_sequence_parallel_gradients_equal_tp_without_it():
    """The value head under SP at TP=2: same loss, same head and trunk gradients as without SP
    (before the fix: head gradient norm 2x, trunk gradients 2x)."""
    for result in run_on_ranks(_critic_sp_grads, 2, timeout=600):
        (loss0, head0, g0), (loss1, head1, g1) = result[False], result[True]
        assert abs(loss0 - loss1) <= 1e-6 * max(1.0, abs(loss0))
        assert float(head0.norm()) > 0
        assert float(head1.norm()) == pytest.approx(float(head0.norm()), rel=1e-5)
        assert (g0 - g1).abs().max() <= 1e-5 * float(g0.abs().max()) and g0.abs().max() > 0


def test_bench_reshard_builds_its_buffers_on_the_model_device():
    """The naive all-gather baseline of ``hyflow bench reshard`` on a host buffer went through gloo on
    a GPU machine while hyflow's reshard used NCCL: the speed-up compared NCCL with gloo."""
    path = os.path.join(REPO, "tools", "bench", "reshard.py")
    assert list(_implicit_factories(path)) == []
