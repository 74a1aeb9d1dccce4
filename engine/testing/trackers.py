"""Read back what a run logged to its experiment trackers (W&B offline, MLflow file store,
TensorBoard), for tests."""

from __future__ import annotations

import glob
import json
import os
import struct


def mlflow_metrics(run_dir: str):
    """(run, ``{name: [(step, value)]}`` in MLflow's names, the config text) of the run's MLflow file store."""
    # optional dependency: the tracker's own package, read only by its tests
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    with open(os.path.join(run_dir, "mlflow_run_id")) as f:
        run_id = f.read().strip()
    run = client.get_run(run_id)
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in run.data.metrics}
    config = open(client.download_artifacts(run_id, "config.resolved.yaml", os.path.join(run_dir, "dl"))).read()
    return run, history, config


def wandb_history(run_dir: str):
    """Rows logged to the offline run, read back from its .wandb file: LevelDB's log format (a
    7-byte file header, 32 KiB blocks of records with a 7-byte header each) of protobuf Records."""
    # optional dependency: the tracker's own package, read only by its tests
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


def tensorboard_scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of scalar ``tag`` in the run's ``tensorboard/`` events."""
    # optional dependency: the tracker's own package, read only by its tests
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]
