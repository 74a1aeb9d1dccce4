"""User reward functions that never return (issue #39 point 10): each call is stopped at
``reward.timeout_s`` in its worker process, scored ``reward.timeout_score`` and counted in
``reward/timeouts``, and the run goes on; a file that hangs at import fails the pre-flight check
instead of hanging it; a rank making no progress says where it is."""

import io
import time

import pytest

from hyflow.rewards.manager import RewardManager
from hyflow.rewards.user_function import RewardError
from hyflow.rewards.worker import TIMED_OUT, FunctionPool, probe_user_function

SLEEPY = """\
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(10_000)
    if solution_str == "spin":
        while True:
            pass
    if solution_str == "crash":
        os._exit(7)
    if solution_str == "raise":
        raise KeyError("no verdict")
    return {"score": float(solution_str == ground_truth), "len": len(solution_str)}
"""


@pytest.fixture
def sleepy(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(SLEEPY)
    return str(path)


def _calls(solutions):
    return [("digits", s, "7", None, f"row {i}") for i, s in enumerate(solutions)]


def test_calls_that_hang_time_out_one_by_one_and_the_rest_is_scored(sleepy):
    pool = FunctionPool(sleepy, workers=3, timeout_s=1.0)
    try:
        start = time.monotonic()
        results = pool.map(_calls(["7", "hang", "spin", "3", "hang", "7"]))
        took = time.monotonic() - start
        assert results[0] == (1.0, {"len": 1.0}) and results[3] == (0.0, {"len": 1.0}) and results[5][0] == 1.0
        assert [i for i, r in enumerate(results) if r is TIMED_OUT] == [1, 2, 4] and pool.timeouts == 3
        assert took < 30, took  # each hung call cost its timeout (in parallel), not forever
        assert pool.map(_calls(["7"])) == [(1.0, {"len": 1.0})]  # killed workers were replaced
    finally:
        pool.close()


def test_the_batch_timeout_bounds_a_whole_batch(sleepy):
    pool = FunctionPool(sleepy, workers=1, timeout_s=100.0, batch_timeout_s=1.0)
    try:
        start = time.monotonic()
        results = pool.map(_calls(["7", "hang", "7", "7"]))
        assert results[0] == (1.0, {"len": 1.0}) and results[1:] == [TIMED_OUT] * 3
        assert time.monotonic() - start < 20 and pool.timeouts == 3
    finally:
        pool.close()


def test_errors_and_crashes_name_the_row(sleepy):
    pool = FunctionPool(sleepy, workers=2, timeout_s=30.0)
    try:
        with pytest.raises(RewardError, match=r"compute_score\(\) from .*reward.py raised KeyError: 'no verdict' on "
                                              r"row 1 \(data_source='digits'\)") as err:
            pool.map(_calls(["7", "raise"]))
        assert "KeyError" in str(err.value.__cause__)  # the worker's traceback, for the rank's log
        with pytest.raises(RewardError, match=r"crashed its worker process \(exit code 7\) on row 0"):
            pool.map(_calls(["crash"]))
    finally:
        pool.close()


def test_a_file_that_hangs_at_import_fails_in_its_time_limit(tmp_path):
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(10_000)\ndef compute_score(a, b, c, d=None):\n    return 0.0\n")
    start = time.monotonic()
    with pytest.raises(RewardError, match="did not finish within 2 s"):
        probe_user_function(str(path), "compute_score", import_timeout_s=2.0)
    assert time.monotonic() - start < 20
    with pytest.raises(RewardError, match="defines no function 'score'"):
        probe_user_function(_ok(tmp_path), "score")


def _ok(tmp_path):
    path = tmp_path / "ok.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    return str(path)


def test_the_preflight_names_a_hanging_import(tmp_path, monkeypatch):
    from hyflow.config import ConfigError
    from hyflow.jobs import rl_preflight
    from hyflow.jobs.registry import load_job_config
    from hyflow.testing.rl import QUICKSTART

    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(10_000)\n")
    # the preflight reads the constant it imported at its top
    monkeypatch.setattr(rl_preflight, "DEFAULT_IMPORT_TIMEOUT_S", 2.0)
    cfg = load_job_config(QUICKSTART, ["reward.kind=function", f"reward.function_path={path}", "reward.timeout_s=1",
                                       f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="reward.function_path.*did not finish within 2 s"):
        rl_preflight.preflight(cfg)


def test_the_manager_scores_timeouts_with_the_configured_score(sleepy):
    from types import SimpleNamespace

    cfg = SimpleNamespace(kind="function", function_path=sleepy, function_name="compute_score", model_checkpoint=None,
                          timeout_s=1.0, batch_timeout_s=0.0, workers=2, timeout_score=-1.0)
    manager = RewardManager.from_config(cfg)
    try:
        batch = manager.score(["7", "hang", "4"], ["digits"] * 3, ["7"] * 3)
    finally:
        manager.close()
    assert batch.scores == [1.0, -1.0, 0.0] and batch.timeouts == 1
    assert batch.extras["len"][0] == 1.0 and batch.extras["len"][1] != batch.extras["len"][1]  # NaN: no extras


def _rl_with_a_hanging_reward(reward: str, out: str) -> list:
    """Rank function: two RL steps whose reward function hangs on most responses."""
    from hyflow.jobs.registry import load_job_config
    from hyflow.jobs.rl import run
    from hyflow.testing.rl import QUICKSTART

    cfg = load_job_config(QUICKSTART, [
        "trainer.nproc=1", "actor.layout.tp=1", "actor.sft_warmup_steps=0", "trainer.total_steps=2",
        "trainer.loggers=[console]", f"trainer.output_dir={out}", "data.train_batch_size=4", "rollout.n=2",
        "actor.mini_batch_size=8", "actor.micro_batch_size=8", "reward.kind=function", f"reward.function_path={reward}",
        "reward.timeout_s=0.5", "reward.workers=4", "reward.timeout_score=0"])
    return [{k: v for k, v in row.items() if k.startswith(("reward/", "critic/score"))} for row in run(cfg)]


@pytest.mark.multirank
def test_an_rl_run_goes_on_past_a_reward_that_never_returns(tmp_path):
    from hyflow.testing import run_on_ranks

    reward = tmp_path / "reward.py"
    reward.write_text("import time\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    time.sleep(10_000)\n")
    rows = run_on_ranks(_rl_with_a_hanging_reward, 1, str(reward), str(tmp_path / "run"), timeout=900)[0]
    assert len(rows) == 2 and all(r["reward/timeouts"] == 8 for r in rows), rows  # 4 prompts x 2 samples
    assert all(r["critic/score/mean"] == 0.0 for r in rows)


# --------------------------------------------------------------------------- the watchdog


def test_the_watchdog_names_the_phase_of_a_stalled_rank_and_backs_off():
    from hyflow.monitor import watchdog
    from hyflow.monitor.timers import PhaseTimers

    now = [0.0]
    out = io.StringIO()
    dog = watchdog.Watchdog(60.0, rank=1, out=out, clock=lambda: now[0]).start()
    try:
        timers = PhaseTimers()
        with timers.phase("update_actor"):
            now[0] = 59.0
            assert dog.check() is None
            now[0] = 61.0
            line = dog.check()
            assert line.startswith("[hyflow] rank 1: no progress for 1.0 min in phase 'update_actor'")
            now[0] = 100.0
            assert dog.check() is None  # the next report at 2x
            now[0] = 121.0
            assert "2.0 min" in dog.check()
        assert dog.phase == "the step, after phase 'update_actor'" and dog.check() is None
    finally:
        dog.stop()
    assert watchdog._active is None
    watchdog.beat("anything")  # no watchdog: nothing happens
