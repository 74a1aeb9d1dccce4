"""docs/verl.md's verl command line, exactly as documented, on 2 CPU ranks with a tiny HF model:
it trains, validates before the first step and every 5 steps, and the core validation metric
reaches metrics.jsonl, TensorBoard, the W&B offline run and MLflow; ``hyflow eval`` of the final
checkpoint with the same ``compute_score`` file gives the numbers the run logged at its last step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hyflow.monitor.metrics import read_metrics

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = "val-core/hyflow/digit_add/acc/mean@1"
AUX = "val-aux/hyflow/digit_add/reward/mean@1"


def _hyflow(args, env, cwd):
    out = subprocess.run([sys.executable, "-m", "hyflow.cli", *args], capture_output=True, text=True, timeout=1200,
                         env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def test_the_documented_verl_command_validates_into_every_tracker_and_eval_agrees(tmp_path):
    for package in ("transformers", "wandb", "mlflow", "tensorboard", "pyarrow"):
        pytest.importorskip(package)
    from hyflow.testing.trackers import mlflow_metrics, tensorboard_scalars, wandb_history
    from hyflow.testing.verl_example import documented_command, make_verl_example

    paths = make_verl_example(str(tmp_path))
    out_dir = str(tmp_path / "out")
    args = documented_command(os.path.join(REPO, "docs", "verl.md"), dict(paths, OUT=out_dir))
    assert len([a for a in args if "=" in a]) == 18 and "trainer.test_freq=5" in args
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    run = _hyflow(args, env, str(tmp_path))
    assert "ppo_mini_batch_size=4 prompts -> actor.mini_batch_size=16 responses (x rollout.n=4)" in run.stderr
    rows = read_metrics(out_dir)
    assert [r["step"] for r in rows] == list(range(0, 11))  # step 0: the validation before training
    validated = {r["step"]: r for r in rows if CORE in r}
    assert sorted(validated) == [0, 5, 10]
    assert all(AUX in r and "timing_s/testing" in r for r in validated.values())
    expected = [(s, pytest.approx(validated[s][CORE])) for s in (0, 5, 10)]
    assert tensorboard_scalars(out_dir, CORE) == expected
    logged, _ = wandb_history(out_dir)
    assert [(r["_step"], r[CORE]) for r in logged if CORE in r] == expected
    _, history, _ = mlflow_metrics(out_dir)
    assert history[CORE.replace("@", "_at_")] == expected  # MLflow takes no '@' in a name (verl: _at_)
    # hyflow eval of the final checkpoint with the same compute_score file: the numbers of step 10
    result = str(tmp_path / "eval.json")
    _hyflow(["eval", "--ckpt", out_dir, "--data", os.path.join(paths["DATA"], "test.parquet"),
             "--reward", os.path.join(paths["DATA"], "reward.py"), "--dp", "2", "--output", result], env,
            str(tmp_path))
    evaluated = json.load(open(result))
    keys = [k for k in validated[10] if k.startswith(("val-core/", "val-aux/"))]
    assert keys and sorted(k for k in evaluated if k.startswith("val-")) == sorted(keys)
    for key in keys:
        assert evaluated[key] == pytest.approx(validated[10][key], abs=1e-12), key
