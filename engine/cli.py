"""The ``hyflow`` command line.

``hyflow train CONFIG [key=value ...]`` validates the config (before any process
is started), then either runs as one rank (when already launched by torchrun or
srun) or starts ``trainer.nproc`` ranks on this machine through torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

#: job name -> (config schema, run function). Schemas are light modules, so a config
#: validates before torch or Megatron is imported.
JOBS = {
    "lm": ("hyflow.jobs.lm_config:LMJobConfig", "hyflow.jobs.lm:run"),
    "rl": ("hyflow.jobs.rl_config:RLJobConfig", "hyflow.jobs.rl:run"),
    "dpo": ("hyflow.jobs.preference_config:DPOJobConfig", "hyflow.jobs.dpo:run"),
    "kto": ("hyflow.jobs.preference_config:KTOJobConfig", "hyflow.jobs.dpo:run"),
}

#: Modules that add subcommands: each defines ``register(subparsers)`` and sets
#: ``func`` on its parsers. Imported lazily only to build the parser (keep their
#: top-level imports light: no torch / Megatron at import time).
COMMAND_MODULES: tuple[str, ...] = ("hyflow.launch.cli", "hyflow.plan.cli", "hyflow.doctor.cli", "hyflow.tools.convert.cli",
                                     "hyflow.tools.convert.export", "hyflow.rollout.cli", "hyflow.data.cli", "hyflow.tools.bench")


def _job_schema(yaml_path: Optional[str], overrides: Sequence[str]):
    """Pick the schema class from the config's ``job`` key (default ``lm``)."""
    from hyflow.config import ConfigError
    from hyflow.config.core import _yaml_load

    job = "lm"
    if yaml_path:
        if not os.path.isfile(yaml_path):
            raise ConfigError(f"config file {yaml_path!r} does not exist")
        try:
            with open(yaml_path) as f:
                data = _yaml_load(f.read()) or {}
        except Exception:  # load_config reports the file's problem with its line number
            data = {}
        job = data.get("job", job) if isinstance(data, dict) else job
    for item in overrides:
        if item.startswith("job="):
            job = item.split("=", 1)[1]
    if job not in JOBS:
        raise ConfigError(f"unknown job {job!r}; one of {sorted(JOBS)}", key="job")
    return _resolve(JOBS[job][0]), job


def _resolve(path: str):
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def load_job_config(yaml_path: Optional[str], overrides: Sequence[str]):
    """Parse and validate a job config; raises ConfigError with a clear message."""
    from hyflow.config import load_config

    schema, _ = _job_schema(yaml_path, overrides)
    return load_config(schema, yaml_path, list(overrides))


def cmd_train(args: argparse.Namespace) -> int:
    from hyflow.config import ConfigError

    try:
        cfg = load_job_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"hyflow: config error: {e}", file=sys.stderr)
        return 2
    from hyflow.parallel.distributed import launched_by_torchrun

    if not launched_by_torchrun() and cfg.trainer.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={cfg.trainer.nproc}", "-m", "hyflow.cli", "train",
               args.config, *args.overrides]
        print(f"[hyflow] launching {cfg.trainer.nproc} ranks: {' '.join(cmd[2:])}", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        from hyflow.launch.local import run_forwarding_signals

        return run_forwarding_signals(cmd, env)
    from hyflow.parallel.distributed import init_distributed, shutdown

    init_distributed()
    try:
        _resolve(JOBS[cfg.job][1])(cfg)
    finally:
        shutdown()
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from hyflow.config import ConfigError, describe, format_config

    try:
        if args.describe:
            schema, _ = _job_schema(args.config, args.overrides)
            print(describe(schema))
            return 0
        cfg = load_job_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"hyflow: config error: {e}", file=sys.stderr)
        return 2
    print(format_config(cfg))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    import torch

    for pkg in ("hyflow", "torch", "megatron-core", "transformer-engine", "triton"):
        try:
            version = md.version(pkg)
        except md.PackageNotFoundError:
            version = "not installed"
        print(f"{pkg:20s} {version}")
    print(f"{'cuda':20s} {torch.version.cuda if torch.cuda.is_available() else 'not available'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyflow", description="RL post-training engine on Megatron-Core.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="run a training job from a YAML config")
    train.add_argument("config", help="YAML config file (see configs/)")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    train.set_defaults(func=cmd_train)
    config = sub.add_parser("config", help="print the resolved config, or --describe its keys")
    config.add_argument("config", nargs="?", help="YAML config file")
    config.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    config.add_argument("--describe", action="store_true", help="list every key with type and help")
    config.set_defaults(func=cmd_config)
    info = sub.add_parser("info", help="versions of hyflow and its dependencies")
    info.set_defaults(func=cmd_info)
    import importlib

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


# Set by a launcher that starts ranks through torchrun: the ranks' hyflow arguments as a JSON
# list. torchrun's own parser would otherwise read options after ``-m hyflow.cli`` as its own
# (``--n`` is an ambiguous prefix of ``--nnodes`` / ``--nproc-per-node``) and stop with an error.
RANK_ARGV_ENV = "HYFLOW_RANK_ARGV"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    if argv is None and len(sys.argv) == 1 and os.environ.get(RANK_ARGV_ENV):
        argv = json.loads(os.environ.pop(RANK_ARGV_ENV))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
