"""``hyflow export``: a training checkpoint's actor -> a Hugging Face model directory.

    hyflow export --ckpt DIR --out HF_DIR [--dtype auto|fp32|bf16] [--force] [--max-shard-size GB]

``DIR`` is a run directory (its newest complete checkpoint is used), its ``checkpoints``
directory, one ``step_*`` checkpoint, or a model checkpoint directory itself. The export is
the converter's ``mcore2hf`` (any training layout; written on one process). This module
imports nothing heavy until the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys

ROLE = "actor"


def find_model_checkpoint(path: str, role: str = ROLE) -> str:
    """The model checkpoint directory of ``role`` that ``path`` points at (see the module
    docstring); incomplete step checkpoints are skipped with a warning on stderr.

    Raises :class:`~hyflow.checkpoint.model.CheckpointError` when there is none.
    """
    from hyflow.checkpoint.model import CHECKPOINT_INFO_FILE, CheckpointError
    from hyflow.checkpoint.checkpointer import resolve_checkpoint

    if os.path.exists(os.path.join(path, CHECKPOINT_INFO_FILE)):
        return path

    def warn(message: str) -> None:
        print(f"hyflow export: warning: {message}", file=sys.stderr, flush=True)

    step_dir = resolve_checkpoint(path, warn)
    model_dir = os.path.join(step_dir, role)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint {step_dir} has no {role} model")
    return model_dir


def cmd_export(args: argparse.Namespace) -> int:
    """Run the export; returns the process exit status."""
    from hyflow.checkpoint.model import CheckpointError
    from hyflow.tools.convert.errors import ConversionError
    from hyflow.tools.convert.launch import RankFailure
    from hyflow.tools.convert.mcore2hf import mcore2hf

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        model_dir = find_model_checkpoint(args.ckpt)
        log(f"hyflow export: {model_dir} -> {args.out}")
        report = mcore2hf(model_dir, args.out, dtype=args.dtype, force=args.force,
                          max_shard_bytes=int(args.max_shard_size * 1024**3), log=log)
    except (CheckpointError, ConversionError) as e:
        print(f"hyflow export: error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"hyflow export: failed: {e}", file=sys.stderr)
        return 1
    if args.report:
        print(report.format())
    log(f"hyflow export: wrote {args.out}")
    return 0


def register(subparsers) -> None:
    """Add the ``export`` subcommand."""
    export = subparsers.add_parser("export", help="export a training checkpoint's actor as a HF model directory")
    export.add_argument("--ckpt", required=True, metavar="DIR",
                        help="run directory, its checkpoints/ directory, a step_* checkpoint or a model checkpoint")
    export.add_argument("--out", required=True, metavar="HF_DIR", help="HF directory to write")
    export.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                        help="tensor dtype (default: the checkpoint's)")
    export.add_argument("--force", action="store_true", help="replace the contents of a non-empty output directory")
    export.add_argument("--max-shard-size", type=float, default=2.0, metavar="GB",
                        help="split safetensors files at about this many GiB (default 2)")
    export.add_argument("--report", action="store_true", help="print time and peak host memory")
    export.set_defaults(func=cmd_export)
