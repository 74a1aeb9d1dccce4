"""A multi-turn run killed with SIGKILL (every process of ``hyflow train``, no chance to save) and
resumed from its last checkpoint equals the straight run: the same metrics rows (turns, tool and
environment counters, rewards, losses, multi-turn validation every 2 steps) and the same final
weights; ``hyflow eval`` of the final checkpoint gives the last validation's numbers."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hyflow.checkpoint.discovery import checkpoint_status, step_dir_name
from hyflow.data.tasks import make_task_rows
from hyflow.testing.agent import TINY_MULTI_TURN
from hyflow.testing.resume import checkpoint_tensors, process_descendants

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

CORE = "val-core/hyflow/digit_add/reward/mean@1"
NOT_COMPARED = ("timing_s/", "cpu_s", "comm/", "rollout/tokens_per_s", "reshard/seconds", "perf/throughput",
                "perf/time_per_step", "perf/max_")


def _train(config, out, log):
    val = os.path.join(os.path.dirname(config), "val.jsonl")
    return subprocess.Popen([sys.executable, "-m", "hyflow.cli", "train", config, f"trainer.output_dir={out}",
                             "trainer.save_every=1", "trainer.total_steps=4", f"data.val_files=[{val}]",
                             "trainer.val_every=2", "trainer.val_before_train=false"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _rows(out):
    from hyflow.monitor.metrics import read_metrics

    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in read_metrics(out)}


def _kill_all(proc):
    for pid in [proc.pid] + process_descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_kill_9_and_resume_equals_the_straight_run(tmp_path):
    config = tmp_path / "mt.yaml"
    config.write_text(TINY_MULTI_TURN)
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in make_task_rows("digit_add", 6, seed=5)))
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    with open(tmp_path / "a.log", "w") as log:
        assert _train(str(config), straight, log).wait(timeout=900) == 0, open(tmp_path / "a.log").read()[-3000:]
    step2 = os.path.join(resumed, "checkpoints", step_dir_name(2))
    with open(tmp_path / "b.log", "w") as log:
        proc = _train(str(config), resumed, log)
        try:
            deadline = time.time() + 900
            while not checkpoint_status(step2)[0]:
                assert proc.poll() is None, open(tmp_path / "b.log").read()[-3000:]
                assert time.time() < deadline, "step 2's checkpoint never completed"
                time.sleep(0.05)
            _kill_all(proc)  # kill -9: no signal handler, no save
            proc.wait(timeout=60)
        finally:
            _kill_all(proc)
    assert not os.path.isdir(os.path.join(resumed, "checkpoints", step_dir_name(4)))
    with open(tmp_path / "c.log", "w") as log:
        assert _train(str(config), resumed, log).wait(timeout=900) == 0, open(tmp_path / "c.log").read()[-3000:]
    assert "resuming from" in open(tmp_path / "c.log").read()
    a, b = _rows(straight), _rows(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert all(a[s]["num_turns/mean"] > 1 and a[s]["multi_turn/observation_tokens/mean"] > 0 for s in a)
    assert [s for s in a if CORE in a[s]] == [2, 4] and a[4]["val-aux/multi_turn/tool_call_rate"] >= 0
    for step in a:
        assert b[step] == a[step], f"step {step} differs"
    # hyflow eval of the final checkpoint: the multi-turn validation of step 4
    result = str(tmp_path / "eval.json")
    run = subprocess.run([sys.executable, "-m", "hyflow.cli", "eval", "--ckpt", straight, "--data", str(val),
                          "--dp", "2", "--output", result], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    evaluated = json.load(open(result))
    keys = sorted(k for k in a[4] if k.startswith(("val-core/", "val-aux/")))
    assert keys == sorted(k for k in evaluated if k.startswith("val-"))
    for key in keys:
        assert evaluated[key] == pytest.approx(a[4][key], abs=1e-12), key
    final = os.path.join("checkpoints", step_dir_name(4), "actor")
    wa = checkpoint_tensors(os.path.join(straight, final), str(tmp_path))
    wb = checkpoint_tensors(os.path.join(resumed, final), str(tmp_path))
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
