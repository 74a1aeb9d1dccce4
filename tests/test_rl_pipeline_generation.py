"""The RL trainer generating with pipeline parallelism (rollout.layout.pp = 2).

The tiny quickstart model trained at PP = 2 from the same seed, two GRPO steps: once generating
at PP_g = 2 (each rank keeps its stage) and once at PP_g = 1 (the hybrid engine merges the
stages into more micro-DP replicas); on 2 ranks (training TP 1: one replica of two stages) and
on 4 ranks (training TP 2, generation TP 1: two replicas of two stages). Sampling is keyed by the global request index,
so both runs must generate the same responses with the same log-probs at every step (step 2
after an update, so the reshard of updated weights is covered too), every rank must see all of
them, and the trainer's old log-probs of the PP_g = 2 samples must equal the sampler's.
"""

import os

import pytest

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = [
    "trainer.nproc=2", "actor.layout.tp=1", "actor.layout.pp=2", "rollout.layout.tp=1",
    "actor.sft_warmup_steps=0", "data.task_size=64", "data.train_batch_size=8", "rollout.n=4",
    "actor.micro_batch_size=8", "actor.mini_batch_size=32", "rollout.max_new_tokens=4",
    "rollout.temperature=1.0", "actor.optim.lr=1e-2",
]


def _steps(overrides: list, steps: int = 2):
    import torch

    from hyflow.testing.rl import rl_setup, rl_step

    torch.set_num_threads(1)
    cfg, state, job = rl_setup(OVERRIDES + ["data.seed=3"] + overrides)
    models = state.models
    plan = models.weights.plan
    generated = []
    original = models.rollouts.generate

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        generated.append([(s.request_index, s.sample_index, s.prompt_ids, s.token_ids, s.logprobs,
                           s.finish_reason) for s in result.samples.to_outputs()])
        return result

    models.rollouts.generate = capture
    old_vs_sampled = []
    for _ in range(steps):
        _, data = rl_step(cfg, state, job)
        mask = data["response_mask"].bool()
        rollout_lp = torch.zeros_like(data["old_logp"])
        for row, (_, _, prompt, tokens, logprobs, _) in enumerate(generated[-1]):
            if tokens:
                rollout_lp[row, len(prompt):len(prompt) + len(tokens)] = torch.tensor(logprobs)
        old_vs_sampled.append(float((data["old_logp"][mask] - rollout_lp[mask]).abs().max()))
    return generated, old_vs_sampled, (plan.gen.tp, plan.gen.pp, plan.gen_dp_size)


@pytest.mark.parametrize("world, layout, replicas", [
    (2, [], (1, 2)),  # identity pipeline: one replica of 2 stages vs 2 replicas
    (4, ["trainer.nproc=4", "actor.layout.tp=2"], (2, 4)),  # (TP2, PP2) -> (TP1, PP2): 2 replicas of 2 stages
], ids=["tp1pp2-ranks2", "tp2pp2-ranks4"])
def test_generation_pp2_equals_pp1_in_the_trainer(world, layout, replicas):
    pp2 = run_on_ranks(_steps, world, layout + ["rollout.layout.pp=2"], timeout=300)
    pp1 = run_on_ranks(_steps, world, layout + ["rollout.layout.pp=1"], timeout=300)
    assert pp2[0][2] == (1, 2, replicas[0]) and pp1[0][2] == (1, 1, replicas[1])  # (TP_g, PP_g, replicas)
    for rank in range(world):
        gen2, gen1 = pp2[rank][0], pp1[rank][0]
        assert len(gen2) == len(gen1) == 2
        for step, (a, b) in enumerate(zip(gen2, gen1)):
            assert len(a) == 8 * 4, (rank, step)
            assert [x[:4] for x in a] == [x[:4] for x in b], (rank, step)  # prompts and tokens
            assert [x[5] for x in a] == [x[5] for x in b], (rank, step)
            for x, y in zip(a, b):
                assert len(x[4]) == len(y[4]) and max(abs(u - v) for u, v in zip(x[4], y[4])) < 1e-4
        assert gen2 == pp2[0][0]  # every rank returns the same samples
        # The trainer scores the PP_g = 2 responses as the sampler did (same weights, same tokens).
        assert max(pp2[rank][1]) < 1e-4, pp2[rank][1]
    # The two steps generated different responses (the update changed the policy or the data).
    assert [x[3] for x in pp2[0][0][0]] != [x[3] for x in pp2[0][0][1]]
