"""``hyflow eval``: validate a checkpoint stand-alone, exactly as training validates it.

    hyflow eval --ckpt RUN_OR_CHECKPOINT --data VAL.parquet [--reward RULE|FILE.py[:FN]|model:CKPT]
                [--config CONFIG.yaml] [--tp N --pp N --dp N] [--output metrics.json] [key=value ...]

The settings are the run's: its checkpoint's saved ``config.resolved.yaml`` (or ``--config``, or the
RL job's defaults with the checkpoint's tokenizer), with ``data.val_files`` from ``--data``, the
reward from ``--reward`` (a rule, verl's ``compute_score`` file, or a reward model; default the
config's reward) and any ``key=value`` overrides (e.g. ``rollout.val_kwargs.n=8
rollout.val_kwargs.do_sample=true rollout.val_kwargs.temperature=0.6``). The checkpoint's model
is loaded in the generation layout ``--tp`` x ``--pp``, ``--dp`` replicas each take a share of the
prompts; the metrics (``val-core/<data_source>/reward/mean@N``, ...) equal those the run logged
when it validated that checkpoint's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from hyflow.checkpoint.discovery import CONFIG_FILE
from hyflow.checkpoint.errors import CheckpointError
from hyflow.cli_support import make_intermixed, run_ranks_here
from hyflow.config import ConfigError, load_config
from hyflow.jobs.rl_config import RLJobConfig
from hyflow.rewards.spec import reward_overrides
from hyflow.rewards.user_function import RewardError
from hyflow.rollout.cli import resolve_model_dir
from hyflow.checkpoint.manifest import NO_VERIFY_ENV
from hyflow.parallel.distributed import init_distributed, launched_by_torchrun, shutdown

PLACEHOLDER_NOTE = "data.train_files: the validation files stand in (hyflow eval reads no training data)"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = make_intermixed(subparsers.add_parser(
        "eval", help="validate a checkpoint on held-out data (training's val-core metrics)",
        description=__doc__.split("\n\n")[2] if __doc__ else None))
    p.add_argument("--ckpt", required=True, help="a run directory (its newest checkpoint), a step checkpoint, "
                                                 "or a model checkpoint (hyflow convert hf2mcore output)")
    p.add_argument("--data", action="append", required=True,
                   help="a validation .parquet / .jsonl file in verl's format (repeat for several)")
    p.add_argument("--reward", default=None, metavar="RULE|FILE.py[:FN]|model:CKPT",
                   help="the scorer (default: the config's reward section)")
    p.add_argument("--config", default=None, help="job config (default: the checkpoint's saved config)")
    p.add_argument("--tp", type=int, default=1, help="generation tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="generation pipeline stages")
    p.add_argument("--dp", type=int, default=1, help="generation replicas, each validating a share")
    p.add_argument("--output", default=None, help="write the metrics here as one JSON object")
    p.add_argument("--no-verify", action="store_true", help="skip the checksums of the checkpoint's files")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    p.set_defaults(func=cmd_eval)


def saved_config(model_dir: str) -> Optional[str]:
    """The ``config.resolved.yaml`` a checkpoint was saved with: its step directory's, else its run's."""
    step_dir = os.path.dirname(os.path.abspath(model_dir))
    for folder in (step_dir, os.path.dirname(os.path.dirname(step_dir))):
        path = os.path.join(folder, CONFIG_FILE)
        if os.path.isfile(path):
            return path
    return None


def eval_config(args: argparse.Namespace, model_dir: str) -> Any:
    """The RL job config ``hyflow eval`` validates with (see the module docstring)."""
    # torch loads only when the command runs: `hyflow --help` imports this module
    from hyflow.checkpoint.model import read_description

    path = args.config or saved_config(model_dir)
    overrides = [f"data.val_files={json.dumps(list(args.data))}"]
    if path is None:  # the RL job's defaults, the checkpoint's tokenizer
        tokenizer = read_description(model_dir).tokenizer
        overrides += [f"data.train_files={json.dumps(list(args.data))}", "actor.checkpoint=null"] + (
            [f"data.tokenizer={json.dumps(tokenizer)}"] if tokenizer else [])
    if args.reward:
        overrides += reward_overrides(args.reward)
    return load_config(RLJobConfig, path, overrides + list(args.overrides))


def cmd_eval(args: argparse.Namespace) -> int:
    if min(args.tp, args.pp, args.dp) < 1:
        print("hyflow eval: --tp, --pp and --dp must be >= 1", file=sys.stderr)
        return 2
    if args.no_verify:
        os.environ[NO_VERIFY_ENV] = "1"  # the ranks inherit it
    world = args.tp * args.pp * args.dp
    try:
        missing = [path for path in args.data if not os.path.isfile(path)]
        if missing:
            raise ValueError(f"--data: no such file: {', '.join(missing)}")
        model_dir = resolve_model_dir(args.ckpt, verify=world == 1 and not launched_by_torchrun())
        cfg = eval_config(args, model_dir)
    except (CheckpointError, ValueError) as e:  # ConfigError is a ValueError
        prefix = "config error: " if isinstance(e, ConfigError) else ""
        print(f"hyflow eval: {prefix}{e}", file=sys.stderr)
        return 2
    if world > 1 and not launched_by_torchrun():
        return run_ranks_here("eval", world)
    # torch loads only when the command runs: `hyflow --help` imports this module
    from hyflow.validation.standalone import evaluate

    init_distributed()
    try:
        metrics = evaluate(cfg, model_dir, args.tp, args.pp, args.dp)
    except (ValueError, RewardError) as e:  # a bad row, reward function or reward model, named
        print(f"hyflow eval: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    if metrics is not None:
        for key in sorted(metrics):
            print(f"{key} {metrics[key]:.6g}")
        if args.output:
            with open(args.output, "w") as f:
                json.dump(metrics, f, indent=1, sort_keys=True)
    return 0
