"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``trainer.loggers`` picks them (``console`` is the progress line, not a tracker here)::

    trainer:
      loggers: [console, tensorboard, wandb, mlflow]
      project_name: my-project          # W&B project / MLflow experiment
      experiment_name: grpo-run-1       # W&B / MLflow run name (default: the run directory's name)

Each tracker gets every step's metrics and the resolved config as text (TensorBoard: a text
summary; W&B: the run's config plus the YAML file saved with the run; MLflow: the YAML as an
artifact plus the flattened keys as parameters). A resumed run continues the same W&B / MLflow
run (its id is kept in the run directory).

* W&B: offline with ``WANDB_MODE=offline`` (files under ``<output_dir>/wandb``; ``wandb sync``
  uploads them later); every other ``WANDB_*`` variable applies as usual.
* MLflow: ``MLFLOW_TRACKING_URI`` when set (a server, ``sqlite:///...``), else the file store
  ``<output_dir>/mlruns`` (``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri
  <output_dir>/mlruns``).

The packages are optional (``pip install wandb mlflow``); a config that names a missing one
fails before any rank starts (:func:`check_available`).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any, Mapping, Optional, Sequence
import time

import yaml

__all__ = ["TRACKERS", "check_available", "open_trackers"]

_LOG = logging.getLogger(__name__)
#: logger name -> the package it needs
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_available(loggers: Sequence[str]) -> Optional[str]:
    """A message naming the first tracker whose package is missing, else None."""
    for name in loggers:
        package = TRACKERS.get(name)
        if package and importlib.util.find_spec(package) is None:
            return f"{name} is not installed: `pip install {package}`, or remove it from trainer.loggers"
    return None


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def _saved_id(output_dir: str, name: str, resume: bool) -> Optional[str]:
    path = os.path.join(output_dir, f"{name}_run_id")
    if resume and os.path.exists(path):
        with open(path) as f:
            return f.read().strip() or None
    return None


def _save_id(output_dir: str, name: str, run_id: str) -> None:
    with open(os.path.join(output_dir, f"{name}_run_id"), "w") as f:
        f.write(run_id + "\n")


class TensorBoardTracker:
    def __init__(self, output_dir: str, resume_step: Optional[int], config_text: Optional[str]) -> None:
        # optional dependency (tensorboard / wandb / mlflow), imported only when that tracker is chosen
        from torch.utils.tensorboard import SummaryWriter

        kwargs = {"purge_step": resume_step + 1} if resume_step is not None else {}
        self.writer = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"), **kwargs)
        if config_text:
            self.writer.add_text("config", "```yaml\n" + config_text + "\n```", global_step=resume_step or 0)

    def log(self, step: int, row: Mapping[str, float]) -> None:
        for key, value in row.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, output_dir: str, resume_step: Optional[int], config_text: Optional[str],
                 project: str, name: str) -> None:
        # optional dependency (tensorboard / wandb / mlflow), imported only when that tracker is chosen
        import wandb

        run_id = _saved_id(output_dir, "wandb", resume_step is not None)
        config = yaml.safe_load(config_text) if config_text else None
        self.run = wandb.init(project=project, name=name, dir=output_dir, config=config, id=run_id,
                              resume="allow" if run_id else None, reinit="finish_previous")
        _save_id(output_dir, "wandb", self.run.id)
        if config_text:
            path = os.path.join(output_dir, "config.resolved.yaml")
            if os.path.exists(path):
                self.run.save(path, base_path=output_dir, policy="now")

    def log(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log(dict(row), step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_name(key: str) -> str:
    """``key`` as MLflow stores it: ``@`` (not allowed there) spelled ``_at_``, as verl does."""
    return key.replace("@", "_at_")


class MlflowTracker:
    def __init__(self, output_dir: str, resume_step: Optional[int], config_text: Optional[str],
                 project: str, name: str) -> None:
        # optional dependency (tensorboard / wandb / mlflow), imported only when that tracker is chosen
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the file store: no server, no database; MLflow 3 wants it acknowledged
            uri = "file:" + os.path.join(os.path.abspath(output_dir), "mlruns")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = _saved_id(output_dir, "mlflow", resume_step is not None)
        if self.run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            if config_text:
                self.client.log_text(self.run_id, config_text, "config.resolved.yaml")
                # optional dependency (tensorboard / wandb / mlflow), imported only when that tracker is chosen
                from mlflow.entities import Param

                params = [Param(k, str(v)[:500]) for k, v in _flatten(yaml.safe_load(config_text)).items()]
                for i in range(0, len(params), 100):  # MLflow takes at most 100 per batch
                    self.client.log_batch(self.run_id, params=params[i:i + 100])
        _save_id(output_dir, "mlflow", self.run_id)

    def log(self, step: int, row: Mapping[str, float]) -> None:
        # optional dependency (tensorboard / wandb / mlflow), imported only when that tracker is chosen
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow's names take no '@' (val-core/<source>/reward/mean@4): verl's spelling, '_at_'
        metrics = [Metric(mlflow_name(k), v, now, step) for k, v in row.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(loggers: Sequence[str], output_dir: str, resume_step: Optional[int] = None,
                  config_text: Optional[str] = None, project: str = "hyflow",
                  name: Optional[str] = None) -> list[Any]:
    """The trackers ``loggers`` names. TensorBoard without its package degrades to a warning
    (metrics.jsonl is still written); W&B and MLflow must be installed."""
    name = name or os.path.basename(os.path.abspath(output_dir))
    out: list[Any] = []
    for logger in loggers:
        if logger == "tensorboard":
            try:
                out.append(TensorBoardTracker(output_dir, resume_step, config_text))
            except Exception as exc:  # noqa: BLE001 - ImportError, or a broken tensorboard install
                _LOG.warning("TensorBoard logging off (%s): `pip install tensorboard` to enable it; "
                             "metrics.jsonl is still written", str(exc).splitlines()[0] if str(exc) else exc)
        elif logger == "wandb":
            out.append(WandbTracker(output_dir, resume_step, config_text, project, name))
        elif logger == "mlflow":
            out.append(MlflowTracker(output_dir, resume_step, config_text, project, name))
    return out
