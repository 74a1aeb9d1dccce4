"""GRPO on a tiny mixture-of-experts actor (configs/moe_quickstart.yaml): expert parallelism does not
change a step, and routing replay routes the actor's forwards through the rollout's experts.

* EP=2 on 2 ranks (each rank holds 4 of the 8 experts; generation gathers all of them on every
  replica) equals the 1-rank EP=1 run: reward, losses, entropy, grad norm, router aux loss over
  2 steps within 1e-5, with routing replay on. The load-balancing loss is Megatron's statistic of
  a micro-batch (expert shares of its tokens), so the micro-batches must hold the same rows in
  both runs: one sequence each (``actor.micro_batch_size=1``: no padding either).
* The training forwards use the recorded experts: the rollout's routing is replaced by another
  choice (every token sent to the experts after its own). With replay, the old-log-prob forward
  follows the replaced routing (``rollout/routing_mismatch`` = 1 and the log-probs move far from
  the sampler's) and the first update forward follows it too (PPO's KL to the old log-probs stays
  ~0 on the first mini-batch); recording only, nothing changes. Ignoring the routing fails both.
"""

import pytest
import torch

from hyflow.testing import run_on_ranks
from hyflow.testing.multirank import default_timeout

pytestmark = pytest.mark.multirank
#: generous on a loaded box; HYFLOW_TEST_TIMEOUT raises it further
TIMEOUT = max(900.0, default_timeout())

BASE = [
    "data.task_size=200", "data.train_batch_size=4", "rollout.n=4", "rollout.max_new_tokens=5",
    "rollout.temperature=1.2", "actor.micro_batch_size=4", "actor.mini_batch_size=8", "actor.ppo_epochs=1",
    "actor.optim.lr=2e-3", "actor.sft_warmup_steps=0", "trainer.seed=5", "data.seed=3",
]
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "moe/load_balancing_loss",
        "response_length/mean", "rollout/logprob_diff_max")


def _config():
    from hyflow.testing.rl import REPO

    return f"{REPO}/configs/moe_quickstart.yaml"


def _steps(overrides, steps=2):
    import torch.distributed as dist

    from hyflow.testing.rl import rl_setup, rl_step

    cfg, state, job = rl_setup(BASE + [f"trainer.nproc={dist.get_world_size()}"] + overrides, config=_config())
    return [rl_step(cfg, state, job)[0] for _ in range(steps)]


COMMON = ["rollout.routing_replay=true", "actor.micro_batch_size=1"]


@pytest.fixture(scope="module")
def one_rank():
    return run_on_ranks(_steps, 1, COMMON + ["actor.layout.ep=1"], timeout=TIMEOUT)[0]


@pytest.mark.parametrize("layout", [["actor.layout.ep=2"], ["actor.layout.ep=1", "actor.layout.pp=2",
                                                            "rollout.layout.pp=2"]], ids=["ep2", "pp2-gen-pp2"])
def test_expert_parallel_grpo_equals_one_rank(one_rank, layout):
    """EP=2 (DP=2), and PP=2 with generation PP_g=2 (each generation stage records its own layers'
    experts; the stages exchange them) both equal the one-rank run."""
    one = one_rank
    two = run_on_ranks(_steps, 2, COMMON + layout, timeout=TIMEOUT)[0]
    for step, (want, got) in enumerate(zip(one, two)):
        for key in KEYS:
            assert key in want and key in got, key
            a, b = want[key], got[key]
            tol = 1e-6 if key == "rollout/logprob_diff_max" else 1e-5 * max(abs(a), abs(b), 1e-6)
            assert abs(a - b) <= tol, (step + 1, key, a, b)
        assert got["rollout/routing_mismatch"] == want["rollout/routing_mismatch"]
        if "actor.layout.ep=2" in layout:
            assert got["reshard/bytes_received"] > 0  # every replica gathered the other rank's experts


def _tampered_step(mode: str):
    """One step whose recorded routing is replaced by each token's next experts (id + 1 mod E)."""
    import hyflow.jobs.rl as rl
    from hyflow.rollout.dp import SampleTensors
    from hyflow.testing.rl import rl_setup, rl_step

    cfg, state, job = rl_setup(BASE + ["trainer.nproc=1", "actor.layout.ep=1", "rollout.routing_replay=false",
                                       f"rollout.{mode}=true",
                                       "actor.mini_batch_size=16"],  # one update: its forward precedes any change
                               config=_config())
    experts = cfg.model.moe.num_experts
    original = rl.generate_round

    def tampered(*args, **kwargs):
        rnd = original(*args, **kwargs)
        s = rnd.samples
        assert s.routing is not None and bool((s.routing > 0).any())
        shifted = torch.where(s.routing > 0, s.routing % experts + 1, 0).to(s.routing.dtype)  # e -> e + 1
        rnd.samples = SampleTensors(s.meta, s.tokens, s.logprobs, routing=shifted)
        return rnd

    rl.generate_round = tampered
    try:
        return rl_step(cfg, state, job)[0]
    finally:
        rl.generate_round = original


def test_training_forwards_use_the_recorded_experts():
    replay = run_on_ranks(_tampered_step, 1, "routing_replay", timeout=TIMEOUT)[0]
    record = run_on_ranks(_tampered_step, 1, "record_routing", timeout=TIMEOUT)[0]
    # every recorded decision differs from the router's own (the shifted set is another set)
    assert replay["rollout/routing_mismatch"] == pytest.approx(1.0)
    assert record["rollout/routing_mismatch"] == pytest.approx(1.0)
    # recording only: the old log-probs are the sampler's up to rounding; replayed: another network
    assert record["rollout/logprob_diff_max"] < 1e-4
    assert replay["rollout/logprob_diff_max"] > 1e-3  # 1.9e-2 measured (a random model: small logits)
    # the update's first forward routes like the old-log-prob forward did (same weights, same experts)
    assert abs(replay["actor/ppo_kl"]) < 1e-6, replay["actor/ppo_kl"]
