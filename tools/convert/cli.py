"""``hyflow convert``: HF <-> Megatron checkpoint conversion from the command line.

    hyflow convert hf2mcore --hf PATH --out DIR [--tp N] [--pp N] [--ep N] [--etp N] [--stage-layers N,N]
                            [--dtype auto|fp32|bf16]
                            [--force] [--report] [--report-json FILE]
    hyflow convert mcore2hf --ckpt DIR --out DIR [--dtype auto|fp32|bf16] [--force]
                            [--max-shard-size GB] [--report] [--report-json FILE]

Input problems are reported as one ``hyflow convert: error: ...`` line and exit
status 2, before anything is written. This module imports nothing heavy until a
command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from hyflow.config import ConfigError
from hyflow.models.sources.errors import ConversionError
from hyflow.tools.convert.hf2mcore import hf2mcore
from hyflow.tools.convert.launch import RankFailure
from hyflow.tools.convert.mcore2hf import mcore2hf


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _stage_layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of layer counts, e.g. 13,17; got {text}") from None


def _add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="replace the contents of a non-empty output directory")
    parser.add_argument("--report", action="store_true",
                        help="print time and peak host memory (per process, and vs the model size)")
    parser.add_argument("--report-json", metavar="FILE", help="also write the report as JSON")


def register(subparsers) -> None:
    """Add ``convert`` with its ``hf2mcore`` and ``mcore2hf`` subcommands."""
    convert = subparsers.add_parser("convert", help="convert checkpoints between HF and Megatron")
    sub = convert.add_subparsers(dest="direction", metavar="DIRECTION")
    sub.required = True
    hf2 = sub.add_parser("hf2mcore", help="HF directory or .gguf file -> Megatron dist checkpoint")
    hf2.add_argument("--hf", required=True, metavar="PATH",
                     help="HF model directory (safetensors or pytorch_model.bin) or a .gguf file")
    hf2.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    hf2.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size to write (default 1)")
    hf2.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel size to write (default 1)")
    hf2.add_argument("--ep", type=_positive, default=1,
                     help="expert-parallel size to write (mixture-of-experts models; default 1)")
    hf2.add_argument("--etp", type=_positive, default=None,
                     help="expert tensor-parallel size to write (default: --tp)")
    hf2.add_argument("--stage-layers", type=_stage_layers, default=None, metavar="N,N,...",
                     help="decoder layers per pipeline stage, e.g. 13,17 (default: even)")
    hf2.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                     help="parameter dtype (default auto: bf16 for bf16 weights, else fp32)")
    _add_report_args(hf2)
    hf2.set_defaults(func=cmd_convert)
    back = sub.add_parser("mcore2hf", help="hyflow checkpoint (any layout) -> HF directory")
    back.add_argument("--ckpt", required=True, metavar="DIR", help="hyflow checkpoint directory")
    back.add_argument("--out", required=True, metavar="DIR", help="HF directory to write")
    back.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                      help="tensor dtype (default: the checkpoint's)")
    back.add_argument("--max-shard-size", type=float, default=2.0, metavar="GB",
                      help="split safetensors files at about this many GiB (default 2)")
    _add_report_args(back)
    back.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    """Run one conversion; returns the process exit status."""
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        if args.direction == "hf2mcore":
            report = hf2mcore(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                              force=args.force, log=log, stage_layers=args.stage_layers, ep=args.ep,
                              etp=args.etp)
        else:
            report = mcore2hf(args.ckpt, args.out, dtype=args.dtype, force=args.force,
                              max_shard_bytes=int(args.max_shard_size * 1024**3), log=log)
    except (ConversionError, ConfigError) as e:
        print(f"hyflow convert: error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"hyflow convert: failed: {e}\nhyflow convert: {args.out} is incomplete; remove it "
              "or rerun with --force", file=sys.stderr)
        return 1
    if args.report:
        print(report.format())
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    log(f"hyflow convert: wrote {args.out}")
    return 0
