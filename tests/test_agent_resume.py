"""A multi-turn run killed with SIGKILL (every process of ``hyflow train``, no chance to save) and
resumed from its last checkpoint equals the straight run: the same metrics rows (turns, tool and
environment counters, rewards, losses) and the same final weights."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hyflow.checkpoint.discovery import checkpoint_status, step_dir_name
from hyflow.testing.agent import TINY_MULTI_TURN
from hyflow.testing.resume import checkpoint_tensors, process_descendants

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

NOT_COMPARED = ("timing_s/", "cpu_s", "comm/", "rollout/tokens_per_s", "reshard/seconds", "perf/throughput",
                "perf/time_per_step", "perf/max_")


def _train(config, out, log):
    return subprocess.Popen([sys.executable, "-m", "hyflow.cli", "train", config, f"trainer.output_dir={out}",
                             "trainer.save_every=1", "trainer.total_steps=4"],
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
    for step in a:
        assert b[step] == a[step], f"step {step} differs"
    final = os.path.join("checkpoints", step_dir_name(4), "actor")
    wa = checkpoint_tensors(os.path.join(straight, final), str(tmp_path))
    wb = checkpoint_tensors(os.path.join(resumed, final), str(tmp_path))
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
