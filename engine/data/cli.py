"""``hyflow make-task``: write a built-in synthetic task's rows to a data file.

    hyflow make-task arithmetic --size 200 --seed 7 --out eval.jsonl ops=+- max_operand=20

The rows are in the format the RL job reads (verl's: ``prompt`` chat messages,
``data_source``, ``reward_model.ground_truth``, ``extra_info``), as ``.jsonl`` or
``.parquet``: use them as ``data.train_files``, or to score a model with
``hyflow generate --prompts FILE --reward RULE``. Preference tasks (``pref_*``) add TRL's
keys for the DPO / KTO jobs: ``chosen`` / ``rejected``, or with ``format=kto`` two rows per
problem with ``completion`` / ``label``. Rows are a function of the task, ``--seed`` and the
options only (a job's ``data.task`` draws with ``data.seed``).
"""
from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any

from hyflow.cli_support import make_intermixed
from hyflow.data.dataset import DatasetError, write_rows
from hyflow.data.tasks import TASKS, make_task_rows


def register(subparsers: argparse._SubParsersAction) -> None:
    p = make_intermixed(subparsers.add_parser("make-task", help="write a synthetic task's rows (jsonl / parquet)",
                                              description=__doc__.split("\n\n")[2] if __doc__ else None))
    p.add_argument("task", help="task name (hyflow make-task --list)", nargs="?")
    p.add_argument("--size", type=int, default=100, help="number of rows")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated rows")
    p.add_argument("--out", help=".jsonl or .parquet file to write")
    p.add_argument("--list", action="store_true", help="list the tasks and their options")
    p.add_argument("options", nargs="*", metavar="KEY=VALUE", help="task options, e.g. ops=+- max_operand=20")
    p.set_defaults(func=cmd_make_task)


def _task_options(make: Any) -> list[str]:
    return [n for n in inspect.signature(make).parameters if n not in ("size", "seed")]


def _parse_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings; the values are converted (and checked) by the task's options."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"task option {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def cmd_make_task(args: argparse.Namespace) -> int:
    if args.list or not args.task:
        for info in TASKS.values():
            kind = " [preference: job dpo / kto]" if info.kind == "preference" else ""
            print(f"{info.name:16s} {info.description}{kind}; reward rule {info.reward_rule}; "
                  f"options: {', '.join(_task_options(info.make)) or '-'}")
        return 0 if args.list else 2
    info = TASKS.get(args.task)
    if info is None:
        print(f"hyflow make-task: unknown task {args.task!r}; tasks: {', '.join(sorted(TASKS))}", file=sys.stderr)
        return 2
    if not args.out or args.size < 1:
        print("hyflow make-task: give --out FILE (.jsonl or .parquet) and --size >= 1", file=sys.stderr)
        return 2
    try:
        rows = make_task_rows(info.name, args.size, args.seed, **_parse_options(args.options))
        write_rows(rows, args.out)
    except (ValueError, DatasetError) as e:
        print(f"hyflow make-task: {e}", file=sys.stderr)
        return 2
    use = "train a dpo / kto job on them (data.train_files) or score" if info.kind == "preference" else "score"
    print(f"hyflow make-task: wrote {len(rows)} {info.name} rows to {args.out} "
          f"({use} them with --reward {info.reward_rule})")
    return 0
