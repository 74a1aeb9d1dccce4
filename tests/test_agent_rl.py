"""Multi-turn trajectories through the RL step on 2 CPU ranks (a tiny model, a simulated user that
answers every turn, so trajectories have observations whatever the model writes):

* no observation token carries loss: the gradient of the actor's loss reaches the logits that
  predict every sampled assistant token and none of those predicting observation tokens (it would
  with the single-response mask, ``response = everything after the prompt``);
* exact mode (``rollout.exact_logprobs``) reports the training forward's log-probs of every
  assistant token (``rollout/logprob_diff_max == 0``) at PP=2 -> PP_g=1, where sampling alone differs;
* packed rows and token-budget micro-batches give the same update as padded rows; rollout
  correction, RLOO and PPO with a critic (GAE) run over the trajectories with zero advantages on
  observations;
* the multi-turn metrics are reported;
* validation (``data.val_files``) of a multi-turn run validates trajectories, scored as in
  training (the simulated user's per-turn rewards count: single responses would score ~0), the
  same numbers twice for the same weights, with the tool-call rate.
"""

import pytest

from hyflow.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _config(tmp_path_factory):
    from hyflow.testing.agent import TINY_MULTI_TURN

    path = tmp_path_factory.mktemp("mt") / "tiny_multi_turn.yaml"
    path.write_text(TINY_MULTI_TURN)
    return str(path)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return _config(tmp_path_factory)


def _holes(mask_row):
    """Positions of a row's observations: mask 0 between its first and last sampled token."""
    ones = [i for i, m in enumerate(mask_row) if m > 0]
    return [i for i in range(ones[0], ones[-1]) if mask_row[i] == 0] if ones else []


def _runs(config: str, runs: dict) -> dict:
    """Each run: (overrides, steps); returns its per-step metrics, and for runs named ``grads`` the
    logits' gradient norms at observation and assistant positions."""
    import torch

    import hyflow.jobs.rl as rl
    from hyflow.rollout.config import GenerationConfig
    from hyflow.testing.rl import rl_setup, rl_step
    from hyflow.validation.rl import Validation, validate_actor

    torch.set_num_threads(1)
    out = {}
    original = rl.PolicyLoss
    for name, (overrides, steps) in runs.items():
        seen = {"holes": [], "sampled": [], "adv_holes": []}

        class Capture(original):
            captured, grads = seen, name == "grads"

            def __call__(self, output, batch):
                seen = self.captured
                if isinstance(output, torch.Tensor) and output.requires_grad and self.grads:
                    mask = batch["response_mask"].detach().clone()

                    def hook(grad, mask=mask, seen=seen):
                        norms = grad.detach().float().pow(2).sum(-1)  # [b, s]: the logits at s predict s + 1
                        for row in range(mask.shape[0]):
                            m = mask[row].tolist()
                            seen["holes"] += [float(norms[row, t - 1]) for t in _holes(m)]
                            seen["sampled"] += [float(norms[row, t - 1]) for t, v in enumerate(m) if v > 0]
                    output.register_hook(hook)
                for row in range(batch["response_mask"].shape[0]):
                    m = batch["response_mask"][row].tolist()
                    seen["adv_holes"] += [float(batch["advantages"][row, t]) for t in _holes(m)]
                return super().__call__(output, batch)

        rl.PolicyLoss = Capture
        try:
            cfg, state, job = rl_setup(list(overrides), config)
            metrics = [rl_step(cfg, state, job)[0] for _ in range(steps)]
            if cfg.data.val_files:  # validated twice, as the job does after the steps
                validation = Validation.from_config(cfg, job.tokenizer, job.reward,
                                                    GenerationConfig.from_settings(cfg.rollout).sampling, job.agent)
                metrics += [validate_actor(validation, state.models) for _ in range(2)]
        finally:
            rl.PolicyLoss = original
        out[name] = {"metrics": metrics, **seen}
    return out


def _merge(results):
    """Per run: rank 0's metrics (identical on every rank) and every rank's captures."""
    out = {}
    for name in results[0]:
        out[name] = dict(results[0][name])
        for key in ("holes", "sampled", "adv_holes"):
            out[name][key] = [v for r in results for v in r[name][key]]
    return out


def test_multi_turn_training_paths(config, tmp_path):
    import json

    from hyflow.data.tasks import make_task_rows

    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in make_task_rows("digit_add", 6, seed=5)))
    exact = ["rollout.exact_logprobs=true"]
    runs = {
        "grads": (["actor.fused_output_layer=false"], 2),
        "exact": (exact, 2),
        "off": ([], 2),
        "padded": (["actor.layout.pp=1", "actor.micro_batch_size=2"], 1),
        "packed": (["actor.layout.pp=1", "actor.pack_sequences=true", "actor.micro_batch_size=3"], 1),
        "budget": (["actor.layout.pp=1", "actor.max_tokens_per_micro_batch=64"], 1),
        "tis": (["actor.rollout_correction.mode=token_tis"], 1),
        "rloo": (["algorithm.adv_estimator=rloo"], 1),
        "gae": (["algorithm.adv_estimator=gae", "critic.enable=true"], 1),
        "val": ([f"data.val_files=[{val}]"], 1),
    }
    got = _merge(run_on_ranks(_runs, 2, config, runs, timeout=1200))

    grads = got["grads"]
    assert len(grads["holes"]) > 20 and len(grads["sampled"]) > 20  # trajectories with observations
    assert max(grads["holes"]) == 0.0  # no loss on any observation token
    assert sum(g > 0 for g in grads["sampled"]) > 0.5 * len(grads["sampled"])  # (0 where a group ties)
    step, first, again = got.pop("val")["metrics"]
    key = "val-core/hyflow/digit_add/reward/mean@1"
    # 3 turns' rewards (>= 0.1 each) + the final turn's score; single responses scored 0.0 here
    assert first[key] == again[key] and first[key] >= 0.3 - 1e-6
    assert first["val-aux/multi_turn/tool_call_rate"] == again["val-aux/multi_turn/tool_call_rate"]
    assert 0.0 <= first["val-aux/multi_turn/tool_call_rate"] <= 1.0
    for name, result in got.items():
        assert max(abs(a) for a in result["adv_holes"]) == 0.0, name
        for m in result["metrics"]:
            assert m["num_turns/mean"] > 1.5 and m["multi_turn/observation_tokens/mean"] > 5, name
            assert m["multi_turn/end_reason/failed"] == 0 and m["actor/grad_norm"] == m["actor/grad_norm"], name

    assert [m["rollout/logprob_diff_max"] for m in got["exact"]["metrics"]] == [0.0, 0.0]
    assert all(0 < m["rollout/logprob_diff_max"] < 1e-4 for m in got["off"]["metrics"])
    # the same rollouts (same seeds) in three micro-batch layouts: the same update
    base = got["padded"]["metrics"][0]
    for name in ("packed", "budget"):
        m = got[name]["metrics"][0]
        assert m["critic/score/mean"] == base["critic/score/mean"], name
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert m[key] == pytest.approx(base[key], rel=1e-5, abs=1e-7), (name, key)
    assert "rollout_corr/seq_is_weight_mean" in got["tis"]["metrics"][0] or any(
        k.startswith("rollout_corr/") for k in got["tis"]["metrics"][0])
    assert "critic/vf_loss" in got["gae"]["metrics"][0]


def _faulty_step(config: str, tools_yaml: str, secret: str) -> dict:
    import time

    import torch

    from hyflow.data.tokenizer import CharTokenizer
    from hyflow.testing.rl import rl_setup, rl_step

    torch.set_num_threads(1)
    overrides = ["rollout.multi_turn.environment=hyflow.testing.agent:FaultyCalls",
                 f"rollout.multi_turn.environment_kwargs={{read_path: {secret}, turns: 2}}",
                 f"rollout.multi_turn.tool_config_path={tools_yaml}", "rollout.multi_turn.tools=[python]",
                 "rollout.multi_turn.tool_timeout=3.0", "rollout.multi_turn.max_tool_response_length=40",
                 "rollout.multi_turn.max_response_tokens=400", "model.max_position_embeddings=512"]
    cfg, state, job = rl_setup(overrides, config)
    start = time.monotonic()
    metrics, data = rl_step(cfg, state, job)
    text = CharTokenizer().decode(data["tokens"].flatten().tolist())
    return {"metrics": metrics, "seconds": time.monotonic() - start, "text": text}


def test_faulty_tools_inside_an_rl_step(config, tmp_path):
    """A tool that sleeps forever, one that raises, one that returns 10 MB, and Python code reading
    the run directory and opening a socket, called by every trajectory: the step finishes within
    its timeout budget, the errors are counted, nothing outside the sandbox is read or touched."""
    from hyflow.testing.agent import FAULT_TOOLS_YAML

    (tmp_path / "tools.yaml").write_text(FAULT_TOOLS_YAML)
    run = tmp_path / "run"
    run.mkdir()
    secret = run / "config.resolved.yaml"
    secret.write_text("SECRET-RUN-FILE")
    got = run_on_ranks(_faulty_step, 2, config, str(tmp_path / "tools.yaml"), str(secret), timeout=1200)
    for rank in got:
        m = rank["metrics"]
        trajectories = 8  # 4 prompts x 2 samples
        assert m["multi_turn/tool_calls/mean"] == 8  # 4 calls a turn, 2 turns
        # the sleeper times out in every turn (a sandbox start on a loaded box may too)
        assert 2 * trajectories <= m["multi_turn/tool_timeouts"] <= 4 * trajectories
        assert m["multi_turn/tool_errors"] == 6 * trajectories  # sleeper, raiser, the sandbox's refusal per turn
        assert m["multi_turn/end_reason/failed"] == 0 and m["multi_turn/dropped_groups"] == 0
        assert rank["seconds"] < 300  # not 3600 s: one 3 s timeout per wave, the calls in parallel
        assert "sandbox's directory" in rank["text"] and "characters cut" in rank["text"]
        assert "SECRET-RUN-FILE" not in rank["text"]
    assert sorted(p.name for p in run.iterdir()) == ["config.resolved.yaml"]
    assert secret.read_text() == "SECRET-RUN-FILE"
