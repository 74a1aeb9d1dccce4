"""Experiment trackers: a 3-step quickstart logs its metrics and resolved config to a W&B offline
run and an MLflow file store (each skipped when its package is absent); the config names a
missing tracker before any rank starts."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from hyflow.jobs.registry import load_job_config
from hyflow.config import ConfigError
from hyflow.monitor.metrics import MetricsWriter, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def _available(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _mlflow_metrics(run_dir):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    with open(os.path.join(run_dir, "mlflow_run_id")) as f:
        run_id = f.read().strip()
    run = client.get_run(run_id)
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in run.data.metrics}
    config = open(client.download_artifacts(run_id, "config.resolved.yaml", os.path.join(run_dir, "dl"))).read()
    return run, history, config


def _wandb_history(run_dir):
    """Rows logged to the offline run, read back from its .wandb file: LevelDB's log format (a
    7-byte file header, 32 KiB blocks of records with a 7-byte header each) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, chunks, partial = 7, [], b""
    while pos + 7 <= len(data):
        space = 32768 - pos % 32768
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if space < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += space
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):  # a whole record, or the last piece of one
            chunks.append(partial)
    rows = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows, os.path.dirname(path)


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
        run, history, config = _mlflow_metrics(run_dir)
        assert run.info.run_name == "q3" and run.info.status == "FINISHED"
        for key in ("critic/score/mean", "actor/reward_kl_penalty", "comm/bytes", "timing_s/step"):
            assert history[key] == [(r["step"], pytest.approx(r[key])) for r in rows], key
        assert "adv_estimator: grpo" in config and run.data.params["trainer.total_steps"] == "3"
    if "wandb" in loggers:
        logged, files = _wandb_history(run_dir)
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
