"""Checkpoint and resume of ``trainer.mode: one_step_off`` on 4 gloo ranks (training TP=2 on ranks
0-1, generation TP_g=1 x 2 on ranks 2-3), the quickstart model with an SFT warm-up (so the frozen
post-warm-up reference is saved too).

A straight run A trains 3 steps, checkpoints after steps 2 and 3. At the save after step 2 the
generation pool holds batch 3, sampled with the weights of update 1 and not yet sent. Against A:

* SIGTERM to one training and one generation rank during step 2: every rank stops after step 2
  with a checkpoint that holds that batch (per generation rank, tensors only); resumed, step 3 is
  trained on it: staleness 1 and every metric equal to A's (a batch regenerated on resume would
  be sampled with w_2: staleness 0, other rollouts);
* a real ``hyflow train`` SIGKILLed (kill -9, every process) after the save of step 2, then resumed
  with the same command, reproduces A's metrics of every step and A's final actor weights.

Timing, CPU time, traffic and memory metrics are not compared (as in ``test_resume``).
"""

import os
import signal
import subprocess
import sys

import pytest

from hyflow.checkpoint.discovery import checkpoint_status, step_dir_name
from hyflow.testing import run_on_ranks
from hyflow.testing.resume import checkpoint_tensors, kill_9_when

pytestmark = pytest.mark.multirank

OVERRIDES = ["trainer.mode=one_step_off", "trainer.nproc=4", "data.train_batch_size=8", "rollout.n=4",
             "actor.mini_batch_size=16", "actor.micro_batch_size=16", "actor.sft_warmup_steps=2",
             "trainer.total_steps=3", "trainer.save_every=2", "trainer.loggers=[]"]
NOT_COMPARED = ("timing_s/", "cpu_s", "comm/", "perf/", "rollout/tokens_per_s", "reshard/seconds")


def _run(overrides, out, sigterm_step=0):
    """Rank function: the RL job as `hyflow train` runs it; with ``sigterm_step``, training rank 1
    SIGTERMs itself in that step's update and generation rank 3 while it samples the next batch."""
    import torch
    import torch.distributed as dist

    import hyflow.jobs.rl as rl
    from hyflow.jobs.registry import job_runner, load_job_config
    from hyflow.placement.pool_models import GenerationSide
    from hyflow.testing.rl import QUICKSTART

    torch.set_num_threads(1)  # as `hyflow train` runs its ranks
    cfg = load_job_config(QUICKSTART, [*overrides, f"trainer.output_dir={out}"])
    rank, calls = dist.get_rank(), [0]
    orig_step, orig_generate = rl.rl_step, GenerationSide.generate

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == sigterm_step and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return orig_step(*args, **kwargs)

    def generate(self, records, step_number, n):
        if step_number == sigterm_step + 1 and rank == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return orig_generate(self, records, step_number, n)

    rl.rl_step, GenerationSide.generate = step, generate
    try:
        history = job_runner("rl")(cfg)
    finally:
        rl.rl_step, GenerationSide.generate = orig_step, orig_generate
    return [h["step"] for h in history] if rank == 0 else None


def _rows(run_dir: str) -> dict:
    from hyflow.monitor.metrics import read_metrics

    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight"))
    assert run_on_ranks(_run, 4, OVERRIDES, out)[0] == [1, 2, 3]
    rows = _rows(out)
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    return out


def test_sigterm_saves_the_in_flight_batch_and_resume_trains_on_it(run_a, tmp_path):
    import torch

    from hyflow.placement.inflight import inflight_file

    out = str(tmp_path / "run")
    assert run_on_ranks(_run, 4, OVERRIDES, out, 2)[0] == [1, 2]  # stopped after step 2 on every rank
    saved = os.path.join(out, "checkpoints", step_dir_name(2))
    assert checkpoint_status(saved)[0]
    for rank in (2, 3):  # each generation replica's batch 3, sampled with w_1, as plain tensors
        data = torch.load(inflight_file(saved, rank), weights_only=True)
        assert data["step"] == 3 and data["weight_version"] == 1 and data["has_batch"]
        assert data["meta"].shape[0] == 4 * 4  # its 4 prompts x rollout.n samples
    assert not os.path.exists(inflight_file(saved, 0))  # the training ranks hold no batch
    assert run_on_ranks(_run, 4, OVERRIDES, out)[0] == [3]
    a, b = _rows(run_a), _rows(out)
    assert sorted(b) == [1, 2, 3]
    assert b[3]["staleness"] == 1.0  # trained on the batch sampled before the save, with w_1
    assert b[2].pop("weight_sync/bytes_sent") == 0.0  # stopping after step 2: no weights sent
    a[2].pop("weight_sync/bytes_sent")
    for step in (1, 2, 3):
        assert b[step] == a[step], f"step {step} differs from the straight run"


def test_kill_9_after_a_save_then_resume_equals_the_straight_run(run_a, tmp_path):
    from hyflow.testing.rl import QUICKSTART

    out = str(tmp_path / "run")
    args = [sys.executable, "-m", "hyflow.cli", "train", QUICKSTART, *OVERRIDES, f"trainer.output_dir={out}"]
    step2 = os.path.join(out, "checkpoints", step_dir_name(2))
    kill_9_when(args, lambda: checkpoint_status(step2)[0], str(tmp_path / "launch.log"),
                float(os.environ.get("HYFLOW_TEST_TIMEOUT", 600)))
    killed_at = sorted(_rows(out))
    assert killed_at[:2] == [1, 2] and killed_at[-1] < 3, killed_at
    resumed = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=float(os.environ.get("HYFLOW_TEST_TIMEOUT", 600)))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    a, b = _rows(run_a), _rows(out)
    assert sorted(b) == [1, 2, 3]
    for step in (1, 2, 3):
        assert b[step] == a[step], f"step {step} differs from the straight run"
    final = os.path.join("checkpoints", step_dir_name(3), "actor")
    wa = checkpoint_tensors(os.path.join(run_a, final), str(tmp_path))
    wb = checkpoint_tensors(os.path.join(out, final), str(tmp_path))
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert (wa[key] == wb[key]).all(), key


def test_checkpoints_need_the_training_pool_at_rank_0():
    from hyflow.config import ConfigError
    from hyflow.jobs.rl_preflight import check_pooled_supported as check_supported
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import QUICKSTART

    ok = load_job_config(QUICKSTART, ["trainer.mode=one_step_off", "trainer.nproc=4", "trainer.save_every=2",
                                      "trainer.resume=auto"])
    check_supported(ok)  # saving and resuming are supported
    swapped = load_job_config(QUICKSTART, ["trainer.mode=one_step_off", "trainer.nproc=4",
                                           "placement.pools={gen: [0, 2], train: [2, 4]}", "placement.actor=train",
                                           "placement.rollout=gen"])
    with pytest.raises(ConfigError, match="actor's pool to start at rank 0"):
        check_supported(swapped)
