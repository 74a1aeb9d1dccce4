"""The DPO / KTO jobs end to end on CPU ranks (issue #17): learning on the quickstart task,
preemption and resume bit for bit (the precomputed reference log-probs come from the cache, not
a second pass), the NaN guard, metrics / plot files and export of the trained actor.

Timing metrics (``time/*``, ``tokens_per_s``) are excluded from the comparisons.
"""

import math
import os
import signal

import pytest

from hyflow.checkpoint.checkpointer import LATEST_FILE, step_dir_name
from hyflow.testing import run_on_ranks
from hyflow.testing.resume import checkpoint_tensors

pytestmark = pytest.mark.multirank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = """\
model: {family: llama, vocab_size: 128, hidden_size: 32, num_layers: 2, num_attention_heads: 4,
        num_query_groups: 2, ffn_hidden_size: 64, max_position_embeddings: 32}
actor: {layout: {tp: 2}, micro_batch_size: 2, optim: {lr: 1.0e-2, clip_grad: 1.0}}
algorithm: {beta: 0.5}
data: {task: pref_digit_add, task_size: 48, train_batch_size: 8, max_prompt_length: 16, max_completion_length: 8}
trainer: {total_steps: 4, nproc: 2, save_every: 2, keep_last: 2, loggers: [console]}
"""
NOT_COMPARED = ("time/", "tokens_per_s")


def _train(config: str, overrides: list, sigterm_call: int = 0, nan_from_call: int = 0) -> dict:
    """Rank function: ``hyflow.jobs.dpo.run``; optionally SIGTERM rank 1 during its
    ``sigterm_call``-th step, or make the loss NaN from step call ``nan_from_call``. Counts the
    reference precomputations."""
    import torch
    import torch.distributed as dist

    import hyflow.jobs.dpo as job
    import hyflow.jobs.preference_models as models
    from hyflow.jobs.registry import load_job_config
    from hyflow.training.supervisor import DivergenceError

    torch.set_num_threads(1)  # as `hyflow train` runs its ranks
    cfg = load_job_config(config, overrides)
    calls, precomputed, snapshot = [0], [0], {}
    originals = (job.dpo_step, job.kto_step, job.dpo_loss_fn, job.kto_loss_fn, models.precompute)

    def counted(*args, **kwargs):
        precomputed[0] += 1
        return originals[4](*args, **kwargs)

    def step(original):
        def wrapped(cfg_, policy, *args, **kwargs):
            calls[0] += 1
            if calls[0] == sigterm_call and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if calls[0] == nan_from_call:
                snapshot["before"] = [p.detach().clone() for p in policy.chunks[0].parameters()]
            snapshot["policy"] = policy
            return original(cfg_, policy, *args, **kwargs)
        return wrapped

    def poisoned(original):
        def make(*args, **kwargs):
            fn, captured = original(*args, **kwargs)
            if not nan_from_call or calls[0] < nan_from_call:
                return fn, captured
            return (lambda logits, batch: (fn(logits, batch)[0] * float("nan"), {})), captured
        return make

    job.dpo_step, job.kto_step = step(originals[0]), step(originals[1])
    job.dpo_loss_fn, job.kto_loss_fn = poisoned(originals[2]), poisoned(originals[3])
    models.precompute = counted
    error = None
    try:
        history = job.run(cfg)
    except DivergenceError as e:
        error, history = str(e), None
    finally:
        job.dpo_step, job.kto_step, job.dpo_loss_fn, job.kto_loss_fn, models.precompute = originals
    unchanged = None
    if "before" in snapshot:
        after = [p.detach() for p in snapshot["policy"].chunks[0].parameters()]
        unchanged = all(bool((a == b).all()) for a, b in zip(snapshot["before"], after))
    return {"error": error, "unchanged": unchanged, "calls": calls[0], "precomputed": precomputed[0],
            "history": history}


def _rows(run_dir: str) -> dict:
    from hyflow.monitor.metrics import read_metrics

    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "pref.yaml"
    path.write_text(CONFIG)
    return str(path)


JOBS = {"dpo": ["job=dpo", "algorithm.precompute_ref_logprobs=true"],  # the cached table
        "kto": ["job=kto"]}                                              # the frozen reference model


@pytest.mark.parametrize("name", sorted(JOBS))
def test_preempted_run_resumes_bit_for_bit(config, tmp_path, name):
    import torch

    straight = str(tmp_path / "a")
    a = run_on_ranks(_train, 2, config, JOBS[name] + [f"trainer.output_dir={straight}"], timeout=600)[0]
    assert a["error"] is None and a["calls"] == 4
    out = str(tmp_path / "b")
    args = JOBS[name] + [f"trainer.output_dir={out}"]
    first = run_on_ranks(_train, 2, config, args, 2, timeout=600)[0]  # SIGTERM reaches rank 1 only
    assert first["calls"] == 2 and first["error"] is None
    root = os.path.join(out, "checkpoints")
    assert open(os.path.join(root, LATEST_FILE)).read().strip() == step_dir_name(2)
    second = run_on_ranks(_train, 2, config, args, timeout=600)[0]
    assert second["calls"] == 2
    if name == "dpo":  # computed once per run, then loaded from the cache
        assert (a["precomputed"], first["precomputed"], second["precomputed"]) == (1, 1, 0)
        assert os.path.exists(os.path.join(root, "reference_logps.pt"))
    rows_a, rows_b = _rows(straight), _rows(out)
    assert sorted(rows_b) == [1, 2, 3, 4] and rows_a == rows_b
    assert rows_a[4]["rewards/margins"] != rows_a[1]["rewards/margins"]
    final = os.path.join("checkpoints", step_dir_name(4), "actor")
    wa = checkpoint_tensors(os.path.join(straight, final), str(tmp_path))
    wb = checkpoint_tensors(os.path.join(out, final), str(tmp_path))
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    if name == "dpo":
        assert os.path.exists(os.path.join(straight, "rewards.png"))
        _check_export(straight, wa, str(tmp_path / "hf"))


def _check_export(run_dir: str, weights: dict, hf_dir: str) -> None:
    """``hyflow export`` of the run directory writes the last checkpoint's actor."""
    import torch
    from safetensors.torch import load_file

    from hyflow.cli import main

    assert main(["export", "--ckpt", run_dir, "--out", hf_dir]) == 0
    exported = {}
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors"):
            exported.update(load_file(os.path.join(hf_dir, f)))
    emb = next(v for k, v in weights.items() if k.endswith("embedding.word_embeddings.weight"))
    assert torch.equal(exported["model.embed_tokens.weight"], emb[:exported["model.embed_tokens.weight"].shape[0]])


def test_nan_losses_skip_updates_then_stop_with_a_checkpoint(config, tmp_path):
    out = str(tmp_path / "run")
    result = run_on_ranks(_train, 2, config, ["job=dpo", f"trainer.output_dir={out}", "trainer.max_bad_steps=2",
                                              "trainer.total_steps=6"], 0, 2, timeout=600)[0]
    assert result["error"] and "2 consecutive steps (2, 3)" in result["error"]
    assert result["unchanged"] is True  # the NaN steps' updates were skipped
    rows = _rows(out)
    assert sorted(rows) == [1, 2, 3] and rows[3]["training/bad_steps_total"] == 2.0 and rows[1]["training/bad_step"] == 0.0
    assert open(os.path.join(out, "checkpoints", LATEST_FILE)).read().strip() == step_dir_name(3)


def test_quickstart_config_learns_the_preferences(tmp_path):
    """configs/dpo_quickstart.yaml on a smaller dataset (256 pairs, 32 a step, 100 steps): the
    chosen answer's implicit reward beats the rejected one's on >= 85% of pairs and the margins
    grow. (The full config's run is in README / BENCHMARKS.)"""
    quick = os.path.join(REPO, "configs", "dpo_quickstart.yaml")
    history = run_on_ranks(_train, 2, quick, [f"trainer.output_dir={tmp_path}", "trainer.total_steps=100",
                                              "data.task_size=256", "data.train_batch_size=32",
                                              "actor.micro_batch_size=16", "trainer.save_every=0",
                                              "trainer.loggers=[console]"], timeout=900)[0]["history"]
    acc = [h["rewards/accuracies"] for h in history]
    margins = [h["rewards/margins"] for h in history]
    # (float-level noise moves the last-20 mean by a few points around 0.9 from run to run)
    assert sum(acc[-20:]) / 20 >= 0.85 and sum(acc[-20:]) / 20 > sum(acc[:10]) / 10 + 0.2, acc
    assert sum(margins[-10:]) / 10 > sum(margins[10:20]) / 10 > sum(margins[:10]) / 10
    for key in ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "logps/chosen",
                "logps/rejected", "tokens_per_s", "time/ref", "time/update", "epoch"):
        assert all(key in h and math.isfinite(h[key]) for h in history), key
    assert os.path.exists(os.path.join(tmp_path, "rewards.png"))
