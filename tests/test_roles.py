"""The RL step's roles (:mod:`hyflow.roles`): every implementation declares what its protocol
declares, the step tells none apart by hand, and a config that needs a capability its roles lack
is refused before any rank starts (pooled ``sync`` with exact log-probs runs: the issue's command,
on 2 gloo ranks).

* each implementation has every member of its protocol, each method with the protocol's
  parameters (names, kinds, defaults): ``runtime_checkable`` alone checks names only;
* the cheap-to-build implementations pass ``isinstance`` (the colocated ones do in
  tests/test_rl_trainer.py, built for real);
* nothing in the library asks an object whether it is remote;
* the preflight's capability check against the classes' declarations.
"""

import inspect
import math
import os
import re
import types

import pytest

from hyflow.roles import Critic, Rollouts, RolloutCapabilities, WeightPath, WeightPathCapabilities
from hyflow.testing import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _implementations():
    from hyflow.hybrid.executor import HybridEngine
    from hyflow.placement.pool_models import RemoteRollouts, WeightSender
    from hyflow.placement.remote_critic import RemoteCritic
    from hyflow.rl.critic import LocalCritic
    from hyflow.rl.dispatch import RolloutDispatcher

    return [(WeightPath, HybridEngine), (WeightPath, WeightSender), (Rollouts, RolloutDispatcher),
            (Rollouts, RemoteRollouts), (Critic, LocalCritic), (Critic, RemoteCritic)]


def _members(protocol) -> tuple[dict, set]:
    """The protocol's methods (name -> function) and data members (annotated names)."""
    methods = {k: v for k, v in vars(protocol).items() if not k.startswith("_")
               and (inspect.isfunction(v) or isinstance(v, property))}
    return methods, set(protocol.__annotations__) - set(methods)


def _params(fn) -> list[tuple]:
    fn = fn.fget if isinstance(fn, property) else fn
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("protocol, cls", _implementations(), ids=lambda x: x.__name__)
def test_each_implementation_declares_its_protocols_members(protocol, cls):
    methods, data = _members(protocol)
    assert methods, protocol
    for name, fn in methods.items():
        got = inspect.getattr_static(cls, name, None)
        assert got is not None, f"{cls.__name__} lacks {protocol.__name__}.{name}"
        assert isinstance(got, property) == isinstance(fn, property), (cls.__name__, name)
        assert _params(got) == _params(fn), (cls.__name__, name, _params(got), _params(fn))
    source = inspect.getsource(cls)
    for name in data:  # instance attributes: assigned in the class (or a property / field of it)
        assert re.search(rf"\b(self\.)?{name}\b\s*[:=]|def {name}\(", source), (cls.__name__, name)
    if protocol is not Critic:  # capabilities known from the config alone (the preflight reads them)
        assert callable(getattr(cls, "capabilities_for", None)), cls.__name__


def test_pooled_roles_pass_isinstance():
    from hyflow.placement.pool_models import RemoteRollouts, WeightSender
    from hyflow.placement.remote_critic import RemoteCritic

    sender = WeightSender(types.SimpleNamespace(plan=types.SimpleNamespace(summary=lambda: "plan")))
    assert isinstance(sender, WeightPath) and sender.describe() == "plan"
    assert not isinstance(sender, Rollouts)  # the check can fail
    rollouts = RemoteRollouts(groups=None, rollout_config=None, placement=None, current_weights=False)
    assert isinstance(rollouts, Rollouts)
    assert rollouts.capabilities == RolloutCapabilities(greedy=False, exact_rescore=False, current_weights=False)
    critic = object.__new__(RemoteCritic)  # its members are the class's (no process group needed)
    assert isinstance(critic, Critic) and critic.model is None


def test_no_object_is_asked_whether_it_is_remote():
    pattern = re.compile(r"getattr\([^)]*remote")
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "engine")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                found += [f"{path}:{i}" for i, line in enumerate(open(path), 1) if pattern.search(line)]
    assert found == []
    assert pattern.search('local = not getattr(self.critic, "remote", False)')  # the pattern finds the old code


POOLED = ["actor.layout.tp=1", "placement.pools={train: [0, 1], gen: [1, 2]}", "placement.actor=train",
          "placement.rollout=gen", "actor.sft_warmup_steps=0", "trainer.total_steps=2"]


def _cfg(*overrides):
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import QUICKSTART

    return load_job_config(QUICKSTART, list(overrides))


@pytest.mark.parametrize("overrides, key", [
    (POOLED + ["trainer.mode=sync", "rollout.exact_logprobs=true"], None),  # the command: it runs
    (POOLED + ["trainer.mode=one_step_off", "rollout.exact_logprobs=true"], "rollout.exact_logprobs"),
    (POOLED + ["trainer.mode=sync", "rollout.force_staleness=1"], "rollout.force_staleness"),
    (POOLED + ["trainer.mode=sync", "algorithm.adv_estimator=remax"], "algorithm.adv_estimator"),
    # DAPO's refill rounds are the colocated step's; async pools filter on the generation side
    (POOLED + ["trainer.mode=one_step_off", "algorithm.dynamic_sampling.enable=true"],
     "algorithm.dynamic_sampling.enable"),
    (POOLED + ["trainer.mode=async", "algorithm.dynamic_sampling.enable=true"], None),
    (["trainer.nproc=2", "algorithm.dynamic_sampling.enable=true"], None),
    # colocated: a smaller generation TP cannot re-score exactly, and stale sampling forbids the
    # training-layout re-score; either alone is fine
    (["trainer.nproc=2", "actor.layout.tp=2", "rollout.layout.tp=1", "rollout.exact_logprobs=true",
      "rollout.force_staleness=1"], "rollout.exact_logprobs"),
    (["trainer.nproc=2", "actor.layout.tp=2", "rollout.layout.tp=1", "rollout.exact_logprobs=true"], None),
    (["trainer.nproc=2", "actor.layout.tp=2", "rollout.layout.tp=2", "rollout.exact_logprobs=true",
      "rollout.force_staleness=1"], None),
    (["algorithm.adv_estimator=remax", "rollout.force_staleness=2"], None),
])
def test_capabilities_refuse_what_the_roles_cannot_do(overrides, key):
    from hyflow.config import ConfigError
    from hyflow.jobs.rl_preflight import check_role_capabilities

    cfg = _cfg(*overrides)
    if key is None:
        check_role_capabilities(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_role_capabilities(cfg)
    assert e.value.key == key and "\n" not in str(e.value), str(e.value)


def test_declared_capabilities_follow_the_config():
    from hyflow.hybrid.executor import HybridEngine
    from hyflow.placement.pool_models import RemoteRollouts, WeightSender

    same_tp = _cfg("trainer.nproc=2", "actor.layout.tp=2", "rollout.layout.tp=2")
    assert HybridEngine.capabilities_for(same_tp).exact_in_generation_layout
    assert not HybridEngine.capabilities_for(_cfg("trainer.nproc=2", "actor.layout.tp=2",
                                                  "rollout.layout.tp=1")).exact_in_generation_layout
    assert WeightSender.capabilities_for(same_tp) == WeightPathCapabilities(False, False, False)
    assert RemoteRollouts.capabilities_for(_cfg(*POOLED, "trainer.mode=sync")).exact_logprobs
    assert not RemoteRollouts.capabilities_for(_cfg(*POOLED, "trainer.mode=one_step_off")).exact_logprobs


def _pooled_exact(out):
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner

    cfg = _cfg(*POOLED, "trainer.mode=sync", "rollout.exact_logprobs=true", "trainer.loggers=[]",
               "data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
               "rollout.max_new_tokens=8", f"trainer.output_dir={out}", "trainer.save_every=0")
    history = job_runner("rl")(cfg)  # as `hyflow train` runs it (it died at step 1 before)
    return history if dist.get_rank() == 0 else None


@pytest.mark.multirank
def test_pooled_sync_reports_exact_logprobs(tmp_path):
    history = run_on_ranks(_pooled_exact, 2, str(tmp_path / "run"), timeout=1200)[0]
    assert len(history) == 2
    for step in history:  # re-scored in the training layout after the rows came: the trainer's own numbers
        assert step["rollout/logprob_diff_max"] == 0.0, step["rollout/logprob_diff_max"]
        assert step["staleness"] == 0.0 and math.isfinite(step["actor/pg_loss"])
