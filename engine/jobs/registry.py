"""The jobs hyflow runs: name -> (config schema, run function), and loading a job's config.

``job: lm`` (the default), ``rl``, ``dpo`` or ``kto`` in a YAML config picks the schema that
validates it and the function that runs it. Schemas are light modules, so a config validates
before torch or Megatron is imported (``hyflow train``, ``hyflow plan`` and the launchers all do
that first). The command line (:mod:`hyflow.cli`) and the library both read jobs from here.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Optional, Sequence

from hyflow.config import ConfigError, load_config
from hyflow.config.core import has_key, yaml_load
from hyflow.jobs.verl_keys import translate

#: job name -> (config schema, run function), as ``"module:attribute"``.
JOBS = {
    "lm": ("hyflow.jobs.lm_config:LMJobConfig", "hyflow.jobs.lm:run"),
    "rl": ("hyflow.jobs.rl_config:RLJobConfig", "hyflow.jobs.registry:run_rl"),
    "dpo": ("hyflow.jobs.preference_config:DPOJobConfig", "hyflow.jobs.dpo:run"),
    "kto": ("hyflow.jobs.preference_config:KTOJobConfig", "hyflow.jobs.dpo:run"),
}


def resolve(path: str) -> Any:
    """The object a ``"module:attribute"`` path names (imports the module)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def job_schema(yaml_path: Optional[str], overrides: Sequence[str]) -> tuple[type, str]:
    """The schema class and job name of a config: its ``job`` key (default ``lm``), or a ``job=``
    override."""
    job = "lm"
    if yaml_path:
        if not os.path.exists(yaml_path):
            raise ConfigError(f"config file {yaml_path!r} does not exist")
        if os.path.isdir(yaml_path):
            raise ConfigError(f"config file {yaml_path!r} is a directory, not a YAML file")
        if not os.path.isfile(yaml_path):
            raise ConfigError(f"config file {yaml_path!r} is not a regular file (a device or a pipe?)")
        try:
            with open(yaml_path, encoding="utf-8") as f:
                data = yaml_load(f.read()) or {}
        except Exception:  # load_config reports the file's problem with its line number
            data = {}
        job = data.get("job", job) if isinstance(data, dict) else job
    for item in overrides:
        if item.startswith("job="):
            job = item.split("=", 1)[1]
    if job not in JOBS:
        raise ConfigError(f"unknown job {job!r}; one of {sorted(JOBS)}", key="job")
    return resolve(JOBS[job][0]), job


def load_job_config(yaml_path: Optional[str], overrides: Sequence[str]) -> Any:
    """Parse and validate a job config; raises one ConfigError listing every problem. The RL job
    also takes verl's keys (:mod:`hyflow.jobs.verl_keys`); the config's ``notes`` say what they became."""
    schema, job = job_schema(yaml_path, overrides)
    if job != "rl":
        return load_config(schema, yaml_path, list(overrides))
    verl = translate(overrides, lambda key: has_key(schema, key))
    cfg = load_config(schema, yaml_path, verl.overrides, finalize=verl.finalize, errors=verl.errors)
    cfg.notes.extend(note for note in verl.notes if note not in cfg.notes)
    return cfg


def job_runner(job: str) -> Callable[[Any], Any]:
    """The function that runs ``job`` on this rank (imports the job's heavy modules)."""
    return resolve(JOBS[job][1])


def run_rl(cfg: Any) -> Any:
    """The RL job: colocated ``sync`` (:mod:`hyflow.jobs.rl`), or on placement pools (``one_step_off``,
    or ``sync`` with ``placement.pools``: :mod:`hyflow.jobs.one_step_off`, whose loops reuse the sync
    job's step)."""
    pooled = cfg.trainer.mode != "sync" or bool(cfg.placement.pools)
    module = "hyflow.jobs.one_step_off" if pooled else "hyflow.jobs.rl"
    return importlib.import_module(module).run(cfg)
