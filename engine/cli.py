"""The ``hyflow`` command line.

``hyflow train CONFIG [key=value ...]`` validates the config (before any process
is started), then either runs as one rank (when already launched by torchrun or
srun) or starts ``trainer.nproc`` ranks on this machine through torchrun.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hyflow.checkpoint.agree import any_rank
from hyflow.checkpoint.manifest import NO_VERIFY_ENV, apply_verify_setting
from hyflow.checkpoint.run_lock import RunDirInUse, RunLock
from hyflow.cli_support import RANK_ARGV_ENV, make_intermixed
from hyflow.compat.warnings import quiet_known_warnings
from hyflow.config import ConfigError, describe, format_config, load_config
from hyflow.config.core import to_dict
from hyflow.config.describe import plain_text
from hyflow.jobs.registry import job_runner, job_schema, load_job_config
from hyflow.launch.local import LaunchError, Target, check_before_launch, launch_local, new_log_dir
from hyflow.launch.parent_watch import exit_with_parent
from hyflow.launch.rank_report import (LOG_DIR_ENV, make_fallback_dir, remove_fallback_dir, resume_hint, run_reporting,
                                       summarize_failure)
from hyflow.monitor.watchdog import Watchdog
from hyflow.parallel.distributed import DEFAULT_TIMEOUT_S, init_distributed, launched_by_torchrun, rank_device, shutdown

#: Modules that add subcommands: each defines ``register(subparsers)`` and sets
#: ``func`` on its parsers. Imported lazily only to build the parser (keep their
#: top-level imports light: no torch / Megatron at import time).
COMMAND_MODULES: tuple[str, ...] = ("hyflow.launch.cli", "hyflow.plan.cli", "hyflow.doctor.cli", "hyflow.tools.convert.cli",
                                     "hyflow.tools.convert.export", "hyflow.rollout.cli", "hyflow.validation.cli", "hyflow.data.cli",
                                     "hyflow.tools.bench")


def cmd_train(args: argparse.Namespace) -> int:
    """Validate and pre-flight check the config, then run: as one rank of a torchrun job, in
    this process (``trainer.nproc=1``), or by starting ``trainer.nproc`` ranks here."""
    # a rank of a torchrun / srun job (hyflow.parallel.distributed.launched_by_torchrun's test)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if "=" in args.config and not os.path.exists(args.config):  # no file: `hyflow train k=v ...` (verl's form)
        args.config, args.overrides = None, [args.config, *args.overrides]
        if not any(o.startswith("job=") for o in args.overrides):
            args.overrides.insert(0, "job=rl")
    if getattr(args, "no_verify", False):
        os.environ[NO_VERIFY_ENV] = "1"  # the ranks inherit it
    try:
        cfg = load_job_config(args.config, args.overrides)
        apply_verify_setting(cfg)  # trainer.verify_checkpoints=false: as --no-verify
        if launched:  # a rank: the launcher checked everything already
            return _run_rank(cfg)
        target = Target(command="train", config=args.config and os.path.abspath(args.config),
                        args=list(args.overrides),
                        job=cfg.job, output_dir=os.path.abspath(cfg.trainer.output_dir), cfg=cfg)
        check_before_launch(target)  # files, reward function, checkpoints: before any rank starts
    except ConfigError as e:
        print(f"hyflow: config error: {e}", file=sys.stderr)
        return 2
    if cfg.trainer.nproc > 1:
        try:
            return launch_local(target, cfg.trainer.nproc)
        except LaunchError as e:
            print(f"hyflow: {e}", file=sys.stderr)
            return 2
    return _run_single(cfg)


def _run_rank(cfg) -> int:
    """This process is one rank: run the job; an error goes to the rank's log and record for
    the launcher (:mod:`hyflow.launch.rank_report`), the exit code says how it ended."""
    if launched_by_torchrun():
        exit_with_parent()  # the launcher killed (kill -9): this rank stops too, never runs on alone
    quiet_known_warnings()  # Megatron's and torch's messages that every run would print
    init_distributed(getattr(cfg.trainer, "collective_timeout_s", DEFAULT_TIMEOUT_S))
    try:
        return run_reporting(lambda: _locked_run(cfg), dist.get_rank())
    finally:
        shutdown()


def _locked_run(cfg):
    """The job, with rank 0 holding the run directory's lock (:mod:`hyflow.checkpoint.run_lock`);
    every rank stops with the one that could not take it."""
    lock, error = None, None
    if dist.get_rank() == 0:
        try:
            lock = RunLock(cfg.trainer.output_dir).acquire()
        except RunDirInUse as e:
            error = e
    if any_rank(error is not None, rank_device()):
        if error is None:
            error = RunDirInUse(f"rank 0 could not lock {cfg.trainer.output_dir} (see its error)")
            error.peer = True
        raise error
    seconds = getattr(cfg.trainer, "watchdog_s", 0)
    dog = Watchdog(seconds, dist.get_rank()).start() if seconds else None  # reports a rank making no progress
    try:
        return job_runner(cfg.job)(cfg)
    finally:
        if dog is not None:
            dog.stop()
        if lock is not None:
            lock.release()


def _run_single(cfg) -> int:
    """``trainer.nproc=1``: the one rank runs in this process and reports its own failure."""
    log_dir = new_log_dir(os.path.abspath(cfg.trainer.output_dir))
    os.environ[LOG_DIR_ENV] = log_dir
    fallback = make_fallback_dir()  # where the records go when the run directory is full
    try:
        code = _run_rank(cfg)
        if code:
            for line in summarize_failure(log_dir, (), resume_hint(cfg.trainer.output_dir, log_dir)):
                print(line, file=sys.stderr, flush=True)
    finally:
        remove_fallback_dir(fallback)
    return code


def cmd_config(args: argparse.Namespace) -> int:
    # Without a config file: the RL job (hyflow's main job) unless job=... says otherwise.
    if args.config and "=" in args.config and not os.path.exists(args.config):  # `hyflow config job=lm`
        args.overrides, args.config = [args.config, *args.overrides], None
    overrides = list(args.overrides)
    if not args.config and not any(o.startswith("job=") for o in overrides):
        overrides.insert(0, "job=rl")
    try:
        schema, job = job_schema(args.config, overrides)
        if args.describe:
            cfg = None
            if args.config or args.overrides:
                cfg = load_config(schema, args.config, [o for o in overrides if not o.startswith("job=")]
                                  + [f"job={job}"])
            where = f"; [config: ...] marks the values of {args.config or 'the overrides'} that differ" if cfg else ""
            print(f"# the {job} job's keys: type = effective default{where}\n" + describe(schema, cfg))
            return 0
        if not args.config:
            print(f"# no config file given: the {job} job's defaults (they need data.task or data.train_files "
                  f"to run); `hyflow config --describe` explains every key", file=sys.stderr)
            print(format_config(to_dict(schema())))
            return 0
        cfg = load_job_config(args.config, overrides)
    except ConfigError as e:
        print(f"hyflow: config error: {e}", file=sys.stderr)
        return 2
    checkpoint = getattr(getattr(cfg, "actor", None), "checkpoint", None)
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "model.json")):
        print(f"# model: read from {os.path.join(checkpoint, 'model.json')} (actor.checkpoint)")
    for note in getattr(cfg, "notes", []):
        print(f"[hyflow] note: {note}", file=sys.stderr)
    print(format_config(cfg))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    for pkg in ("hyflow", "torch", "megatron-core", "transformer-engine", "triton"):
        try:
            version = md.version(pkg)
        except md.PackageNotFoundError:
            version = "not installed"
        print(f"{pkg:20s} {version}")
    print(f"{'cuda':20s} {torch.version.cuda if torch.cuda.is_available() else 'not available'}")
    return 0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; an option's help ends with its default when it has
    one and does not mention it already; reStructuredText markup is dropped."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" not in text and "default" not in text.lower() and action.option_strings
                and default is not None and default is not argparse.SUPPRESS and not isinstance(default, bool)):
            text += " (default: %(default)s)"
        return text

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))


def _subparsers(parser: argparse.ArgumentParser):
    """``parser`` and every parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from _subparsers(child)


def version_text() -> str:
    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    return f"hyflow {version('hyflow')} (torch {version('torch')}, megatron-core {version('megatron-core')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyflow", description="RL post-training engine on Megatron-Core.")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = make_intermixed(sub.add_parser("train", help="run a training job from a YAML config"))
    train.add_argument("config", help="YAML config file (see configs/); without one, the RL job from the "
                                      "overrides alone (verl's keys work: docs/verl.md)")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    train.add_argument("--no-verify", action="store_true",
                       help="skip checkpoint checksums when resuming / loading (sizes and pickles are still checked)")
    train.set_defaults(func=cmd_train)
    config = sub.add_parser(
        "config", help="print the resolved config, or --describe its keys",
        description="Print the resolved config (the file plus overrides plus defaults, validated), or with "
                    "--describe every key with its type, effective default and help, marking the values a "
                    "given config changes. Without a file: the RL job's defaults (job=lm for the LM job).")
    config.add_argument("config", nargs="?", help="YAML config file (default: none, the job's defaults)")
    config.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    config.add_argument("--describe", action="store_true",
                        help="list every key: type, effective default, help, and the config's value where it differs")
    config.set_defaults(func=cmd_config)
    info = sub.add_parser("info", help="versions of hyflow and its dependencies")
    info.set_defaults(func=cmd_info)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    for p in _subparsers(parser):
        p.formatter_class = HelpFormatter
    return parser




def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    if argv is None and len(sys.argv) == 1 and os.environ.get(RANK_ARGV_ENV):
        argv = json.loads(os.environ.pop(RANK_ARGV_ENV))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except BrokenPipeError:  # `hyflow ... | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
