"""Checkpoint, resume and fault tolerance of the RL job (issue #7) on 2 CPU ranks.

One reference run A trains 6 steps straight (PPO with a critic, GAE and an adaptive KL
controller, so that the actor, critic, both optimizers and schedulers, the KL controller
and the frozen post-SFT reference all carry state). Against it:

* a run stopped by SIGTERM on *one* rank stops on every rank after the same step, saves, and
  resumed reproduces A's metrics rows and final weights bit for bit;
* a real ``hyflow train`` stopped by SIGTERM exits 0 after saving; resumed, one rank SIGKILLed
  while saving step 4 is named in the launcher's first line with the step to resume from; with
  the newest checkpoint then damaged (one flipped byte), ``resume=auto`` sets it aside, falls back
  to the one before and reproduces A bit for bit;
* A's TP=2 checkpoint resumed into TP=1 (one rank) gives A's loss at the first resumed step;
* Megatron's distributed optimizer (dp=2) resumes bit for bit as well;
* NaN gradients skip the updates, are counted, and stop the run after max_bad_steps with a
  checkpoint.

Timing metrics (``time/*``, throughput) are excluded from the comparisons.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hyflow.testing import run_on_ranks
from hyflow.testing.resume import checkpoint_tensors, process_descendants
from hyflow.checkpoint.discovery import LATEST_FILE, checkpoint_status, step_dir_name

pytestmark = pytest.mark.multirank

CONFIG = """\
job: rl
model: {family: llama, vocab_size: 128, hidden_size: 32, num_layers: 2, num_attention_heads: 4,
        num_query_groups: 2, ffn_hidden_size: 64, max_position_embeddings: 32}
actor:
  layout: {tp: 2, pp: 1}
  optim: {lr: 1.0e-3, clip_grad: 1.0}
  micro_batch_size: 4
  mini_batch_size: 8
  sft_warmup_steps: 2
  sft_lr: 3.0e-3
critic: {enable: true, micro_batch_size: 4, optim: {lr: 1.0e-3}}
rollout: {layout: {tp: 1, pp: 1}, n: 2, max_prompt_length: 16, max_new_tokens: 4}
algorithm: {adv_estimator: gae, use_kl_in_reward: true, kl_ctrl: {type: adaptive, kl_coef: 0.01}}
reward: {kind: rule, rule: exact_match}
data: {task: digit_add, task_size: 64, train_batch_size: 4}
trainer: {total_steps: 6, nproc: 2, save_every: 3, keep_last: 2, log_every: 1, loggers: [console]}
"""
#: wall and CPU time (cpu_s/ and cpu_s_max/), traffic, memory
NOT_COMPARED = ("timing_s/", "cpu_s", "comm/", "rollout/tokens_per_s", "reshard/seconds", "perf/throughput",
                "perf/time_per_step", "perf/max_")


# --------------------------------------------------------------------------- helpers


def _train(config: str, overrides: list, sigterm_call: int = 0, nan_from_call: int = 0) -> dict:
    """Rank function: ``hyflow.jobs.rl.run``; optionally SIGTERM rank 1 during its
    ``sigterm_call``-th step, or make the policy gradients NaN from step call ``nan_from_call``."""
    import torch
    import torch.distributed as dist

    import hyflow.jobs.rl as rl
    from hyflow.jobs.registry import load_job_config
    from hyflow.training.supervisor import DivergenceError

    torch.set_num_threads(1)  # as `hyflow train` runs its ranks (OMP_NUM_THREADS=1)
    cfg = load_job_config(config, overrides)
    calls, snapshot = [0], {}
    orig_step, orig_loss = rl.rl_step, rl.PolicyLoss

    def params(models):
        return [p.detach().clone() for m in models.trained().values() for c in m.chunks for p in c.parameters()]

    def step(cfg_, state, *args, **kwargs):
        calls[0] += 1
        if calls[0] == sigterm_call and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if calls[0] == nan_from_call:
            snapshot["before"] = params(state.models)
        snapshot["models"] = state.models
        return orig_step(cfg_, state, *args, **kwargs)

    class Poisoned(orig_loss):
        def __call__(self, output, batch):
            loss, stats = super().__call__(output, batch)
            return (loss * float("nan") if nan_from_call and calls[0] >= nan_from_call else loss), stats

    rl.rl_step, rl.PolicyLoss = step, Poisoned
    error = None
    try:
        rl.run(cfg)
    except DivergenceError as e:
        error = str(e)
    finally:
        rl.rl_step, rl.PolicyLoss = orig_step, orig_loss
    unchanged = None
    if "before" in snapshot:
        unchanged = all(bool((a == b).all()) for a, b in zip(snapshot["before"], params(snapshot["models"])))
    return {"error": error, "unchanged": unchanged, "calls": calls[0]}


def _rows(run_dir: str) -> dict:
    from hyflow.monitor.metrics import read_metrics

    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)}
            for r in read_metrics(run_dir)}


def _assert_same_weights(dir_a: str, dir_b: str, tmp: str) -> None:
    import torch

    a, b = checkpoint_tensors(dir_a, tmp), checkpoint_tensors(dir_b, tmp)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between {dir_a} and {dir_b}"


def _assert_same_as_a(run_a: str, run_b: str, steps, tmp: str) -> None:
    rows_a, rows_b = _rows(run_a), _rows(run_b)
    assert sorted(rows_b) == list(range(1, 7))
    for step in steps:
        assert rows_b[step] == rows_a[step], f"step {step} metrics differ"
    final = os.path.join("checkpoints", step_dir_name(6))
    for model in ("actor", "critic"):
        _assert_same_weights(os.path.join(run_a, final, model), os.path.join(run_b, final, model), tmp)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "resume.yaml"
    path.write_text(CONFIG)
    return str(path)


@pytest.fixture(scope="module")
def run_a(config, tmp_path_factory):
    """The reference: 6 steps straight, checkpoints at steps 3 and 6."""
    out = str(tmp_path_factory.mktemp("run_a"))
    result = run_on_ranks(_train, 2, config, [f"trainer.output_dir={out}"], timeout=600)[0]
    assert result["error"] is None
    rows = _rows(out)
    assert sorted(rows) == list(range(1, 7))
    assert any(rows[s]["actor/grad_norm"] for s in rows), "the test run must actually train"
    return out


# --------------------------------------------------------------------------- end to end


def test_sigterm_on_one_rank_stops_all_and_resume_is_exact(run_a, config, tmp_path):
    out = str(tmp_path / "run")
    args = [f"trainer.output_dir={out}"]
    first = run_on_ranks(_train, 2, config, args, 2, timeout=600)[0]  # SIGTERM reaches rank 1 only
    assert first["calls"] == 2 and first["error"] is None
    assert sorted(_rows(out)) == [1, 2]
    root = os.path.join(out, "checkpoints")
    assert open(os.path.join(root, LATEST_FILE)).read().strip() == step_dir_name(2)
    assert checkpoint_status(os.path.join(root, step_dir_name(2)))[0]
    second = run_on_ranks(_train, 2, config, args, timeout=600)[0]
    assert second["calls"] == 4
    _assert_same_as_a(run_a, out, range(1, 7), str(tmp_path))


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of rank ``rank`` among the launcher's descendants (from its environment)."""
    for pid in process_descendants(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b"\0".join(env):
            return pid
    raise AssertionError(f"rank {rank} not found under {launcher}")


def _wait_for(predicate, proc, log, what: str, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, open(log).read()[-3000:]
        assert time.time() < deadline, f"the run did not reach {what}"
        time.sleep(0.02)


def _kill_all(proc) -> None:
    victims = process_descendants(proc.pid)  # torchrun starts its ranks in sessions of their own
    for pid in [proc.pid] + victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigterm_rank_kill_and_damage_then_resume_is_exact(run_a, config, tmp_path):
    """A real `hyflow train` (torchrun, 2 ranks, a checkpoint every step):

    1. SIGTERM to the launcher: the ranks finish the step, save, and the launcher exits 0;
    2. the same command resumes; rank 1 is SIGKILLed as it saves step 4: the launcher's first
       failure line names rank 1 and SIGKILL, then where the logs are and the step to resume from;
    3. one flipped byte in the newest complete checkpoint's shard: `trainer.resume=auto` sets it
       aside (renamed), says so, and resumes from the previous one;

    and metrics and final weights equal the uninterrupted run A from that step on."""
    out = str(tmp_path / "run")
    args = [sys.executable, "-m", "hyflow.cli", "train", config, f"trainer.output_dir={out}",
            "trainer.save_every=1"]  # saving more often must not change anything
    root = os.path.join(out, "checkpoints")
    step = lambda n: os.path.join(root, step_dir_name(n))  # noqa: E731
    logs = [str(tmp_path / f"launch{i}.log") for i in range(3)]

    # 1. SIGTERM: exit 0 after a clean save
    with open(logs[0], "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_for(lambda: checkpoint_status(step(1))[0], proc, logs[0], "step 1's checkpoint")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=300) == 0, open(logs[0]).read()[-3000:]
        finally:
            _kill_all(proc)
    text = open(logs[0]).read()
    assert "[hyflow] stopped on SIGTERM: every rank saved and exited cleanly" in text
    stopped = int(open(os.path.join(root, LATEST_FILE)).read().strip().split("_")[1])
    assert 1 <= stopped < 4 and checkpoint_status(step(stopped))[0]
    assert f"resumes from step {stopped} ({step(stopped)})" in text

    # 2. rank 1 dies (SIGKILL) while step 4 is being saved
    with open(logs[1], "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_for(lambda: os.path.isdir(step(4)), proc, logs[1], "step 4's save")
            victim = _rank_pid(proc.pid, 1)
            os.kill(victim, signal.SIGKILL)
            assert proc.wait(timeout=300) == 1
        finally:
            _kill_all(proc)
    lines = open(logs[1]).read().splitlines()
    assert not any("Traceback" in line for line in lines), "\n".join(lines[-40:])
    first = next(i for i, line in enumerate(lines) if "was killed by" in line or " failed: " in line)
    assert lines[first] == f"[hyflow] rank 1 (pid {victim}) was killed by SIGKILL (out of memory? kill -9?)"
    report = lines[first:]
    assert len(report) == 3, report
    assert report[1].startswith("[hyflow] the job stopped (1 other rank(s) stopped with it); logs of every rank: ")
    newest = [e for e in (3, 4) if checkpoint_status(step(e))[0]][-1]
    assert report[2].endswith(f"resumes from step {newest} ({step(newest)})")

    # 3. damage the newest complete checkpoint: resume=auto falls back to the one before
    shard = os.path.join(step(newest), "actor", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    previous = newest - 1
    with open(logs[2], "w") as log:
        resumed = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=400)
    text = open(logs[2]).read()
    assert resumed.returncode == 0, text[-3000:]
    aside = f"{step(newest)}.corrupt-checksum"
    assert f"checkpoint {step(newest)} is damaged and was set aside as {aside}" in text
    assert f"{shard} does not match its checksum" in text
    assert os.path.isdir(aside) and os.path.isfile(os.path.join(aside, "actor", "__0_0.distcp"))  # kept
    assert f"resuming from {step(previous)} (step {previous})" in text
    _assert_same_as_a(run_a, out, range(previous + 1, 7), str(tmp_path))


def test_resume_tp2_checkpoint_into_tp1(run_a, config, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(os.path.join(run_a, "checkpoints", step_dir_name(3)),
                    out / "checkpoints" / step_dir_name(3))
    shutil.copytree(os.path.join(run_a, "checkpoints", "reference"), out / "checkpoints" / "reference")
    args = [f"trainer.output_dir={out}", "trainer.nproc=1", "actor.layout.tp=1", "trainer.total_steps=4"]
    run_on_ranks(_train, 1, config, args, timeout=600)
    a, b = _rows(run_a)[4], _rows(str(out))[4]
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/reward_kl_penalty"):
        assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
    assert b["response_length/mean"] == a["response_length/mean"]


def test_distributed_optimizer_resume_is_exact(config, tmp_path):
    """tp=1 dp=2 with Megatron's distributed optimizer (state sharded over the 2 ranks)."""
    layout = ["actor.layout.tp=1", "actor.optim.distributed_optimizer=true", "critic.optim.distributed_optimizer=true",
              "trainer.total_steps=3", "trainer.save_every=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_on_ranks(_train, 2, config, layout + [f"trainer.output_dir={straight}"], timeout=600)
    for name in (step_dir_name(2), "reference"):
        shutil.copytree(straight / "checkpoints" / name, resumed / "checkpoints" / name)
    run_on_ranks(_train, 2, config, layout + [f"trainer.output_dir={resumed}"], timeout=600)
    assert _rows(str(resumed))[3] == _rows(str(straight))[3]
    final = os.path.join("checkpoints", step_dir_name(3))
    for model in ("actor", "critic"):
        _assert_same_weights(str(straight / final / model), str(resumed / final / model), str(tmp_path))


def test_nan_gradients_are_skipped_counted_and_stop_the_run(config, tmp_path):
    out = str(tmp_path / "run")
    args = [f"trainer.output_dir={out}", "trainer.max_bad_steps=2", "trainer.save_every=0"]
    result = run_on_ranks(_train, 2, config, args, 0, 2, timeout=600)[0]
    assert result["calls"] == 3
    assert "2 consecutive steps (2, 3) had a NaN/inf loss or gradient" in result["error"]
    assert result["unchanged"], "the bad steps' updates must be skipped (actor and critic)"
    rows = _rows(out)
    assert [rows[s]["training/bad_step"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert rows[3]["training/bad_steps_total"] == 2.0
    assert rows[2]["actor/grad_norm"] is None and rows[2]["critic/grad_norm"] is None
    step3 = os.path.join(out, "checkpoints", step_dir_name(3))
    assert checkpoint_status(step3)[0]
    assert str(step3) in result["error"]
    with open(os.path.join(step3, "trainer_state.json")) as f:
        assert json.load(f)["job"]["supervisor"]["consecutive_bad"] == 2


def _async_save_and_load(config: str, out: str) -> dict:
    """Rank function: an asynchronous save (the GPU path; Megatron's background writer also runs on
    CPU) counts only once finalized; it loads back exactly. The optimizer has not stepped yet."""
    import torch

    from hyflow.jobs.registry import load_job_config
    from hyflow.data.tasks import load_data_tokenizer
    from hyflow.checkpoint.checkpointer import Checkpointer
    from hyflow.checkpoint.discovery import latest_checkpoint
    from hyflow.rl.models import build_rl_models

    cfg = load_job_config(config, [f"trainer.output_dir={out}", "actor.sft_warmup_steps=0", "critic.enable=false",
                                   "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false"])
    rl_models = build_rl_models(cfg, load_data_tokenizer(cfg.data))
    models = rl_models.trained()
    actor_chunks = rl_models.actor.chunks
    ckpt = Checkpointer(out, rl_models.groups, rl_models.desc, keep_last=2, async_save=True)
    path = ckpt.save(1, models, {"position": 7})
    pending = latest_checkpoint(ckpt.root, lambda m: None)
    ckpt.wait()
    done = latest_checkpoint(ckpt.root, lambda m: None)
    saved = [p.detach().clone() for p in actor_chunks[0].parameters()]
    with torch.no_grad():
        for p in actor_chunks[0].parameters():
            p.add_(1.0)
    state = ckpt.load(path, models)
    ckpt.close()
    same = all(torch.equal(a, b) for a, b in zip(saved, actor_chunks[0].parameters()))
    return {"pending": pending, "done": done.step if done else None, "job": state["job"], "same": same}


def test_async_save_is_complete_only_after_finalize(config, tmp_path):
    results = run_on_ranks(_async_save_and_load, 2, config, str(tmp_path), timeout=300)
    for r in results:
        assert r["pending"] is None and r["done"] == 1
        assert r["job"] == {"position": 7} and r["same"]
