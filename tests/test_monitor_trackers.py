"""Experiment trackers: a 3-step quickstart logs its metrics and resolved config to a W&B offline
run and an MLflow file store (each skipped when its package is absent); the config names a
missing tracker before any rank starts."""

import os
import subprocess
import sys

import pytest

from hyflow.jobs.registry import load_job_config
from hyflow.config import ConfigError
from hyflow.monitor.metrics import MetricsWriter, read_metrics
from hyflow.testing.trackers import mlflow_metrics, wandb_history

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def _available(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.multirank
@pytest.mark.skipif(not (_available("wandb") or _available("mlflow")), reason="neither wandb nor mlflow installed")
def test_quickstart_logs_to_wandb_offline_and_mlflow(tmp_path):
    loggers = [t for t in ("wandb", "mlflow") if _available(t)]
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    out = subprocess.run([sys.executable, "-m", "hyflow.cli", "train", QUICKSTART, "actor.sft_warmup_steps=0",
                          "trainer.total_steps=3", f"trainer.output_dir={run_dir}",
                          f"trainer.loggers=[console,{','.join(loggers)}]", "trainer.experiment_name=q3"],
                         capture_output=True, text=True, timeout=900, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    if "mlflow" in loggers:
        run, history, config = mlflow_metrics(run_dir)
        assert run.info.run_name == "q3" and run.info.status == "FINISHED"
        for key in ("critic/score/mean", "actor/pg_loss", "comm/bytes", "timing_s/step"):
            assert history[key] == [(r["step"], pytest.approx(r[key])) for r in rows], key
        assert "adv_estimator: grpo" in config and run.data.params["trainer.total_steps"] == "3"
    if "wandb" in loggers:
        logged, files = wandb_history(run_dir)
        assert [r["_step"] for r in logged] == [1, 2, 3]
        for row, got in zip(rows, logged):
            assert got["critic/score/mean"] == pytest.approx(row["critic/score/mean"])
            assert got["comm/bytes"] == pytest.approx(row["comm/bytes"])
        assert "adv_estimator: grpo" in open(os.path.join(files, "files", "config.resolved.yaml")).read()


def test_tensorboard_gets_the_config_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(str(tmp_path), loggers=["tensorboard"], config_text="job: rl\n") as w:
        w.log(1, {"reward/mean": 0.5, "kl": float("nan")})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.5]
    assert "kl" not in acc.Tags()["scalars"]  # non-finite values stay out of the trackers
    assert any("config" in tag for tag in acc.Tags()["tensors"])


def test_a_missing_tracker_package_fails_in_the_config(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match="trainer.loggers.*mlflow is not installed"):
        load_job_config(QUICKSTART, ["trainer.loggers=[console,mlflow]"])
    with pytest.raises(ConfigError, match="trainer.loggers"):
        load_job_config(QUICKSTART, ["trainer.loggers=[console,neptune]"])
