"""The LM job (``configs/lm_tiny.yaml``) on the shared job loop: checkpoints, exact resume and the
shared metrics writer (metrics.jsonl, TensorBoard), as every other job has them."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [os.path.join(REPO, "configs", "lm_tiny.yaml"), "trainer.nproc=1", "actor.layout.tp=1",
        "trainer.total_steps=4", "trainer.save_every=2"]


def _train(*overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hyflow.cli", "train", *TINY, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)


def _rows(run_dir) -> dict[int, dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {row["step"]: row for row in map(json.loads, f)}


def test_lm_job_checkpoints_and_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    done = _train(f"trainer.output_dir={straight}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"step_000002", "step_000004"} <= set(os.listdir(straight / "checkpoints"))
    assert (straight / "tensorboard").is_dir() and (straight / "config.resolved.yaml").is_file()
    # continue step 2 of the straight run in another directory: steps 3-4 are the straight run's
    again = _train(f"trainer.output_dir={resumed}", f"trainer.resume={straight}/checkpoints/step_000002")
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = _rows(straight), _rows(resumed)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "grad_norm", "lr"):
            assert b[step][key] == a[step][key], (step, key)
    assert a[4]["loss"] < a[1]["loss"]
