"""One run per run directory and its history (issue #39 points 2 and 6): an exclusive lock held by
rank 0 (a second run is refused in one line, before its ranks start or by rank 0 when two launches
race), a run that finds only set-aside checkpoints refuses to start over silently, and
metrics.jsonl is never truncated (deduplicated on resume, moved aside by a fresh run)."""

import json
import os
import subprocess
import sys
import time

import pytest

from hyflow.checkpoint.discovery import resume_candidates, step_dir_name
from hyflow.checkpoint.errors import CheckpointError
from hyflow.checkpoint.run_lock import LOCK_FILE, RunDirInUse, RunLock, check_unlocked, current_owner
from hyflow.testing import run_on_ranks
from hyflow.testing.rl import QUICKSTART

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HOLDER = """
import sys, time
from hyflow.checkpoint.run_lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def held(tmp_path):
    """A run directory locked by another process (as a running job's rank 0 holds it)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield out, proc
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_is_exclusive_names_its_owner_and_dies_with_it(held):
    out, proc = held
    owner = current_owner(str(out))
    assert owner["pid"] == proc.pid and owner["released"] is False
    with pytest.raises(RunDirInUse, match=rf"in use by another run \(pid {proc.pid} on .*delete .*{LOCK_FILE}"):
        RunLock(str(out)).acquire()
    proc.kill()
    proc.wait()  # killed: the kernel drops its flock, the file still names it (no stale lock)
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == proc.pid
    check_unlocked(str(out))
    with RunLock(str(out)):
        assert current_owner(str(out))["pid"] == os.getpid()
    assert current_owner(str(out)) is None and json.loads((out / LOCK_FILE).read_text())["released"]


def test_a_second_run_into_a_locked_directory_is_one_line_before_any_rank(held):
    out, proc = held
    start = time.time()
    result = subprocess.run([sys.executable, "-m", "hyflow.cli", "train", QUICKSTART, f"trainer.output_dir={out}"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"in use by another run (pid {proc.pid}" in lines[0], result.stderr
    assert "launching" not in result.stdout and time.time() - start < 120


def _take_lock(config: str, out: str) -> dict:
    """Rank function: what a rank runs when two launches raced past the pre-flight check."""
    from hyflow.cli import _locked_run
    from hyflow.jobs.registry import load_job_config

    cfg = load_job_config(config, [f"trainer.output_dir={out}", "trainer.nproc=1", "actor.layout.tp=1"])
    try:
        _locked_run(cfg)
    except RunDirInUse as e:
        return {"error": str(e), "peer": getattr(e, "peer", False)}
    return {"error": None}


@pytest.mark.multirank
def test_rank_0_refuses_a_locked_directory_and_every_rank_stops(held):
    out, proc = held
    result = run_on_ranks(_take_lock, 1, QUICKSTART, str(out), timeout=300)[0]
    assert f"pid {proc.pid}" in result["error"] and not result["peer"]


# --------------------------------------------------------------------------- history


def test_only_set_aside_checkpoints_refuse_a_silent_start_over(tmp_path):
    from hyflow.jobs.preflight import preflight
    from hyflow.jobs.registry import load_job_config
    from hyflow.config import ConfigError

    root = tmp_path / "checkpoints"
    for name in (f"{step_dir_name(2)}.corrupt-checksum", f"{step_dir_name(4)}.corrupt-size"):
        (root / name).mkdir(parents=True)
    with pytest.raises(CheckpointError, match="only set-aside ones .*step_000002.corrupt-checksum, "
                                              "step_000004.corrupt-size.*trainer.resume=never"):
        resume_candidates("auto", str(tmp_path))
    assert resume_candidates("never", str(tmp_path)) == ([], True)
    cfg = load_job_config(QUICKSTART, [f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="only set-aside ones"):
        preflight(cfg)
    preflight(load_job_config(QUICKSTART, [f"trainer.output_dir={tmp_path}", "trainer.resume=never"]))


def test_metrics_are_deduplicated_on_resume_and_never_truncated(tmp_path):
    from hyflow.monitor.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    # two runs interleaved (the old failure), a torn line, rows after the checkpoint at step 3
    rows = [1, 2, 2, 3, 3, 4, 5]
    path.write_text("".join(json.dumps({"step": s, "x": i}) + "\n" for i, s in enumerate(rows)) + '{"step": 6, "x"')
    with MetricsWriter(str(tmp_path), tensorboard=False, resume_step=3, required_keys=()) as w:
        assert w.last_step == 3
        w.log(4, {"x": 100})
    assert [(r["step"], r["x"]) for r in read_metrics(str(path))] == [(1, 0), (2, 2), (3, 4), (4, 100)]
    with MetricsWriter(str(tmp_path), tensorboard=False, required_keys=()) as w:  # a fresh run over it
        w.log(1, {"x": 7})
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.") and p.name != "metrics.jsonl"]
    assert len(kept) == 1 and [r["step"] for r in read_metrics(str(kept[0]))] == [1, 2, 3, 4]
    assert [r["x"] for r in read_metrics(str(path))] == [7]


def test_tests_never_read_the_working_trees_run_directories(tmp_path):
    """Issue #39 point 9: `make train` then `make test` failed because a test pre-flight-checked the
    quickstart config, whose runs/quickstart held the finished run. The tests that check run
    directories run here from a directory whose runs/ holds locked runs with only set-aside
    checkpoints (every check of them refuses): they must still pass."""
    for name in ("quickstart", "rl"):
        (tmp_path / "runs" / name / "checkpoints" / f"{step_dir_name(3)}.corrupt-checksum").mkdir(parents=True)
    holders = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "runs" / name)], stdout=subprocess.PIPE,
                                text=True) for name in ("quickstart", "rl")]
    try:
        assert all(h.stdout.readline().strip() == "locked" for h in holders)
        tests = [os.path.join(REPO, "tests", "test_placement_config.py")]  # relative run directories: from cwd
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", REPO, *tests],
                             capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    finally:
        for h in holders:
            h.kill()
            h.wait()
