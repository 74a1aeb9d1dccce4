"""``hyflow export``: a training checkpoint's actor -> a Hugging Face model directory.

    hyflow export --ckpt DIR --out HF_DIR [--dtype auto|fp32|bf16] [--force] [--max-shard-size GB]
                  [--merge | --adapter]

``DIR`` is a run directory (its newest complete checkpoint is used), its ``checkpoints``
directory, one ``step_*`` checkpoint, or a model checkpoint directory itself. Its files are
checked against the checkpoint's manifest first (``--no-verify`` skips the checksums); a
damaged file is named and nothing is written. The export is the converter's ``mcore2hf``
(any training layout; written on one process). A LoRA checkpoint exports as its base with the
adapters merged (``--merge``, the default) or, with ``--adapter``, as a PEFT adapter directory
(:mod:`hyflow.tools.convert.peft_export`). This module imports nothing heavy until the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from hyflow.checkpoint.discovery import model_checkpoint_dir
from hyflow.checkpoint.manifest import NO_VERIFY_ENV

ROLE = "actor"


def find_model_checkpoint(path: str, role: str = ROLE) -> str:
    """The model checkpoint directory of ``role`` that ``path`` points at (see the module
    docstring); incomplete step checkpoints are skipped with a warning on stderr.

    Raises :class:`~hyflow.checkpoint.errors.CheckpointError` when there is none.
    """
    def warn(message: str) -> None:
        print(f"hyflow export: warning: {message}", file=sys.stderr, flush=True)

    return model_checkpoint_dir(path, role, warn)


def cmd_export(args: argparse.Namespace) -> int:
    """Run the export; returns the process exit status."""
    # Megatron (seconds) only when the command runs: `hyflow --help` imports this module
    from hyflow.checkpoint.adapters import adapter_settings
    from hyflow.checkpoint.model import CheckpointError, read_checkpoint_info
    from hyflow.models.sources.errors import ConversionError
    from hyflow.tools.convert.launch import RankFailure
    from hyflow.tools.convert.mcore2hf import mcore2hf
    from hyflow.tools.convert.peft_export import export_adapter

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.no_verify:
        os.environ[NO_VERIFY_ENV] = "1"
    try:
        model_dir = find_model_checkpoint(args.ckpt)
        log(f"hyflow export: {model_dir} -> {args.out}")
        if args.adapter:  # a LoRA checkpoint's adapters as a PEFT directory (hyflow.tools.convert.peft_export)
            export_adapter(model_dir, args.out, dtype=args.dtype, force=args.force, log=log)
            return 0
        if adapter_settings(read_checkpoint_info(model_dir).extra) is not None:
            log("hyflow export: LoRA checkpoint: writing the base with the adapters merged (--adapter writes the "
                "PEFT adapter directory instead)")
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
    lora = export.add_mutually_exclusive_group()
    lora.add_argument("--merge", action="store_true",
                      help="a LoRA checkpoint: the base with the adapters merged, as a HF model (the default)")
    lora.add_argument("--adapter", action="store_true",
                      help="a LoRA checkpoint: its adapters as a PEFT adapter directory (adapter_config.json + "
                           "adapter_model.safetensors) that peft loads onto the HF base model")
    export.add_argument("--no-verify", action="store_true",
                        help="skip the checksums of the checkpoint's files (sizes and pickles are still checked)")
    export.set_defaults(func=cmd_export)
