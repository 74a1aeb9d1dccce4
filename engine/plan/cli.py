"""``hyflow plan CONFIG [--world-size N] [overrides]``: a job's layouts, process groups,
generation layout, reshard bytes and per-GPU memory, worked out offline in one CPU process.

Exit codes: 0 the job fits and divides; 1 it does not fit in GPU memory or a group check
failed; 2 the config or a layout is invalid. Output: a table, or with --json one JSON object.

    hyflow plan configs/qwen2_72b_1024gpu.yaml --world-size 1024
    hyflow plan configs/llama3_8b_8gpu.yaml rollout.max_concurrent=256 --gpu-memory 80
    hyflow plan configs/quickstart.yaml --device cpu
"""

from __future__ import annotations

import argparse
import json
import sys

from hyflow.cli_support import make_intermixed
from hyflow.plan.core import PlanOptions, build_plan
from hyflow.plan.report import format_table, to_json


def cmd_plan(args: argparse.Namespace) -> int:
    ranks = None
    if args.megatron_rank:
        ranks = tuple(args.megatron_rank)
    if args.all_ranks:
        ranks = "all"
    if args.no_megatron:
        ranks = ()
    opts = PlanOptions(world_size=args.world_size, gpu_memory_gib=args.gpu_memory,
                       device=args.device, reserve_gib=args.reserve,
                       fragmentation=args.fragmentation, megatron_ranks=ranks)
    result = build_plan(args.config, args.overrides, opts)
    if args.json:
        print(json.dumps(to_json(result), separators=(",", ":")), flush=True)
    else:
        print(format_table(result), flush=True)  # its "error:" lines say what failed
    if not result.errors:
        return 0
    config_error = any(e.startswith(("config:", "layout:")) for e in result.errors)
    if args.json:  # stdout is for the program that reads it; tell the person too
        print("hyflow plan: " + result.errors[0], file=sys.stderr)
    return 2 if config_error else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hyflow plan``."""
    p = make_intermixed(subparsers.add_parser(
        "plan", help="layouts, groups, reshard bytes and per-GPU memory of a job, offline",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("config", help="job config (YAML)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--world-size", type=int, help="ranks to plan for (default: trainer.nproc)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB",
                   help="memory of one GPU in GiB (default: cluster.gpu_memory_gib, else 80)")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                   help="gpu: TE/flash attention, reserve for CUDA/NCCL; cpu: Megatron's local "
                        "spec as the CPU runs use it, no reserve")
    p.add_argument("--reserve", type=float, metavar="GIB",
                   help="per-GPU reserve for CUDA context/NCCL/workspaces (default 2.5 on gpu)")
    p.add_argument("--fragmentation", type=float, metavar="FRACTION",
                   help="allocator fragmentation margin (default 0.05 on gpu)")
    p.add_argument("--megatron-rank", type=int, action="append", metavar="RANK",
                   help="rank whose groups are created in a fake world and checked "
                        "(repeatable; default: first and last)")
    p.add_argument("--all-ranks", action="store_true",
                   help="create and check the groups of every rank (slow: ~0.3 s per rank)")
    p.add_argument("--no-megatron", action="store_true",
                   help="skip creating real groups (no Megatron import; faster)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object instead of the table")
    p.set_defaults(func=cmd_plan)
