"""Exact resume of ``trainer.mode: async`` (k=2, new weights after 2 decode steps) on 4 gloo ranks.

A straight run A trains 4 steps and checkpoints after steps 2 and 4. At the save after step 2 each
generation replica streams loader batch 4 (started with ``w_1``; it takes ``w_2`` 2 decode steps
after it became due, which is where the save's control message arrives): training batch 3 (sampled
with ``w_0``) is formed and not sent, loader batch 4's samples are finished or half generated. The
checkpoint holds all of that per generation rank, tensors only, with every token's weight version,
each group's completion step and batch, and the loader's position. A real ``hyflow train`` SIGKILLed (kill -9, every process) once that checkpoint is
complete, then resumed with the same command, reproduces A's metrics of every step (staleness and
version spread included) and A's final actor weights, and its generation ranks end at A's loader
position with nothing left over (no prompt skipped or repeated).
"""

import os
import subprocess
import sys

import pytest

from hyflow.checkpoint.discovery import checkpoint_status, step_dir_name
from hyflow.testing import run_on_ranks
from hyflow.testing.resume import checkpoint_tensors, kill_9_when

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

OVERRIDES = ["trainer.mode=async", "trainer.max_staleness=2", "trainer.update_after_tokens=2", "trainer.nproc=4",
             "data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
             "actor.sft_warmup_steps=2", "trainer.total_steps=4", "trainer.save_every=2", "trainer.loggers=[]"]
NOT_COMPARED = ("timing_s/", "cpu_s", "comm/", "perf/", "rollout/tokens_per_s", "reshard/seconds",
                "fully_async/rollouter/")  # timing: the generation pool's idle share


def _run(overrides, out):
    import torch
    import torch.distributed as dist

    from hyflow.jobs.registry import job_runner, load_job_config
    from hyflow.testing.rl import QUICKSTART

    torch.set_num_threads(1)  # as `hyflow train` runs its ranks
    cfg = load_job_config(QUICKSTART, [*overrides, f"trainer.output_dir={out}"])
    history = job_runner("rl")(cfg)
    return [h["step"] for h in history] if dist.get_rank() == 0 else None


def _rows(run_dir: str) -> dict:
    from hyflow.monitor.metrics import read_metrics

    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in read_metrics(run_dir)}


def _inflight(run_dir: str, step: int, rank: int) -> dict:
    import torch

    from hyflow.placement.inflight import inflight_file

    return torch.load(inflight_file(os.path.join(run_dir, "checkpoints", step_dir_name(step)), rank),
                      weights_only=True)


def _killed_and_resumed(tmp_path, overrides) -> tuple[str, str]:
    """The straight run A and the same ``hyflow train`` SIGKILLed (every process) once its step-2
    checkpoint is complete, then resumed with the same command (B). B's metrics of every step equal
    A's, so do its final actor weights, and its generation ranks end at A's loader position and
    counters with nothing left in flight (no prompt skipped or repeated). Returns both run directories."""
    from hyflow.testing.rl import QUICKSTART

    run_a = str(tmp_path / "straight")
    assert run_on_ranks(_run, 4, overrides, run_a)[0] == [1, 2, 3, 4]
    out = str(tmp_path / "run")
    args = [sys.executable, "-m", "hyflow.cli", "train", QUICKSTART, *overrides, f"trainer.output_dir={out}"]
    step2 = os.path.join(out, "checkpoints", step_dir_name(2))
    timeout = float(os.environ.get("HYFLOW_TEST_TIMEOUT", 600))
    kill_9_when(args, lambda: checkpoint_status(step2)[0], str(tmp_path / "launch.log"), timeout)
    assert sorted(_rows(out))[:2] == [1, 2]
    resumed = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    a, b = _rows(run_a), _rows(out)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert b[step] == a[step], f"step {step} differs from the straight run"
    for rank in (2, 3):  # the same prompts drawn, none left in flight
        end_a, end_b = _inflight(run_a, 4, rank), _inflight(out, 4, rank)
        assert end_b["loader"] == end_a["loader"] and end_b["counters"] == end_a["counters"]
        assert end_b["groups"].shape[0] == 0
    final = os.path.join("checkpoints", step_dir_name(4), "actor")
    wa = checkpoint_tensors(os.path.join(run_a, final), str(tmp_path))
    wb = checkpoint_tensors(os.path.join(out, final), str(tmp_path))
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert (wa[key] == wb[key]).all(), key
    return run_a, out


def test_kill_9_mid_sample_then_resume_equals_the_straight_run(tmp_path):
    import torch

    from hyflow.rollout.dp import META

    run_a, out = _killed_and_resumed(tmp_path, OVERRIDES)
    a = _rows(run_a)
    assert [a[s]["fully_async/staleness/max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    half = 0
    for rank in (2, 3):
        saved = _inflight(run_a, 2, rank)
        assert saved["step"] == 3 and saved["version"] == 3
        groups = saved["groups"]  # per group: loader step, prompt, dataset index, completion step, batch, samples
        batch, n = groups[:, 4].tolist(), groups[:, 5].tolist()
        assert batch == [3] * 4 + [0] * 4 and n == [4] * 8  # batch 3 formed, not sent; loader batch 4 streaming
        assert groups[4:, 0].tolist() == [4] * 4
        p = saved["samples"]  # every sample of those groups as it stood, in group order
        lengths = p["meta"][:, META.index("response_len")]
        versions = torch.split(p["versions"], lengths.tolist())
        assert {v for part in versions[:16] for v in part.tolist()} == {0}
        assert {v for part in versions[16:] for v in part.tolist()} == {1}
        unfinished = p["meta"][16:, META.index("finish")] == 0
        half += int((unfinished & (lengths[16:] > 0)).sum())
    assert half > 0  # samples half generated when the checkpoint was taken
    for rank in (2, 3):
        end = _inflight(out, 4, rank)["counters"]
        assert end["dropped"] == 0 and end["started"] == 4 * 4  # 4 batches of 4 prompts here: each started once


def test_dynamic_sampling_books_and_checkpoint(tmp_path):
    """DAPO's dynamic sampling on the generation pool (:mod:`hyflow.jobs.async_filter`), here one
    replica of TP_g=2 (its first rank scores, the decisions are broadcast to the other), after a
    warm-up that leaves the exact-match reward near 0.4 (some groups all wrong or all right, some
    mixed): every trained group has reward variance (the training side's own recount), groups were
    filtered, and the filtered count equals the replica's own books (started = trained + dropped +
    in flight, dropped = filtered + stale), the same on both its ranks, and the checkpoint holds the
    counts of batches not sent yet. (One run: a kill -9 and resume of it, ~35 s more, equalled the
    straight run when it was written; the filter's counts round-trip in test_async_filter, the
    rest of the resume is the test above.)"""
    overrides = [*OVERRIDES, "rollout.layout.tp=2", "algorithm.dynamic_sampling.enable=true",
                 "algorithm.dynamic_sampling.max_rounds=8", "actor.sft_warmup_steps=40"]
    run_a = str(tmp_path / "straight")
    assert run_on_ranks(_run, 4, overrides, run_a)[0] == [1, 2, 3, 4]
    a = [_rows(run_a)[s] for s in (1, 2, 3, 4)]
    assert all(m["dynamic_sampling/kept_groups"] == 8 and m["dynamic_sampling/gave_up"] == 0 for m in a)
    filtered = sum(m["dynamic_sampling/filtered_groups"] for m in a)
    stale = sum(m["fully_async/count/dropped_stale_samples"] for m in a) / 4  # rollout.n = 4
    assert all(m["dynamic_sampling/generated_groups"] == 8 + m["dynamic_sampling/filtered_groups"] for m in a)
    # the counts of batches formed or forming and not sent travel in the checkpoint (in-flight file v3)
    assert _inflight(run_a, 2, 2)["filtered"] == _inflight(run_a, 2, 3)["filtered"] != []
    end, other = _inflight(run_a, 4, 2), _inflight(run_a, 4, 3)
    assert end["counters"] == other["counters"]  # both ranks of the replica decided alike
    books = end["counters"]
    assert books["started"] == 4 * 8 + books["dropped"] + end["groups"].shape[0]
    assert books["dropped"] == filtered + stale and filtered > 0
