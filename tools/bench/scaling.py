"""``hyflow bench scaling CONFIG [overrides] --ranks 1,2,4 [--weak]``: scaling efficiency.

Runs the same RL config at each world size (``hyflow bench rl``'s measurement: warm-up steps
left out, the job's own step times) and reports, against the first point ``R0``:

* strong scaling (default): the global batch is fixed; efficiency = actual speedup / ideal
  speedup = ``(t(R0) * R0) / (t(R) * R)``;
* weak scaling (``--weak``): ``data.train_batch_size`` and ``actor.mini_batch_size`` grow with
  the ranks (the batch per rank is fixed); efficiency = ``t(R0) / t(R)``;

where ``t`` is the mean step time. The config must divide at every point (e.g. the quickstart
needs ``actor.layout.tp=1`` to run on one rank).

``--launcher local`` (default) runs every point here through ``hyflow launch local``.
``--launcher slurm`` submits one job per point through ``hyflow launch slurm`` (each point
``R / --gpus-per-node`` nodes; extra options in ``--slurm='...'``) into ``--output-dir/ranks-R``
and returns; once they finished, ``--collect`` reads those run directories and prints the
table. A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from typing import Any, Sequence

from hyflow.config import ConfigError
from hyflow.jobs.registry import load_job_config
from hyflow.tools.bench.rl import analyse, machine, measure


#: ``key=value`` overrides may come before or after the options
INTERMIXED = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="RL job config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    parser.add_argument("--ranks", default="1,2", help="comma-separated world sizes (default: %(default)s)")
    parser.add_argument("--weak", action="store_true",
                        help="weak scaling: batch per rank fixed (default: strong, global batch fixed)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per point (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out per point (default: %(default)s)")
    parser.add_argument("--launcher", choices=("local", "slurm"), default="local",
                        help="run the points here, or submit them to Slurm (default: %(default)s)")
    parser.add_argument("--output-dir", default=None,
                        help="parent of the points' run directories ranks-R (needed with slurm and "
                             "--collect; default for local: temporary directories)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="slurm: ranks per node (default: %(default)s)")
    parser.add_argument("--slurm", default="", metavar="OPTIONS",
                        help="slurm: further `hyflow launch slurm` options in one string, "
                             "e.g. --slurm='--partition batch --time 01:00:00'")
    parser.add_argument("--collect", action="store_true",
                        help="report on the run directories of an earlier --launcher slurm submission")
    parser.add_argument("--quiet", action="store_true", help="do not echo the jobs' output")


def point_overrides(cfg: Any, overrides: Sequence[str], ranks: int, base: int, weak: bool) -> list[str]:
    """The overrides of the point with ``ranks`` ranks (weak scaling grows the batch)."""
    out = list(overrides)
    if weak:
        factor = ranks / base
        for key, value in (("data.train_batch_size", cfg.data.train_batch_size),
                           ("actor.mini_batch_size", cfg.actor.mini_batch_size)):
            scaled = value * factor
            if scaled != int(scaled):
                raise ValueError(f"--weak: {key}={value} x {ranks}/{base} is not a whole number")
            out.append(f"{key}={int(scaled)}")
    return out


def efficiencies(points: list[dict[str, Any]], weak: bool) -> list[dict[str, Any]]:
    """Add ``speedup`` and ``efficiency`` to each point (against the first)."""
    r0, t0 = points[0]["ranks"], points[0]["step_s"]
    for p in points:
        if weak:
            p["efficiency"] = t0 / p["step_s"]
            p["speedup"] = p["efficiency"] * p["ranks"] / r0  # work per second, relative
        else:
            p["speedup"] = t0 / p["step_s"]
            p["efficiency"] = p["speedup"] / (p["ranks"] / r0)
    return points


def format_table(points: list[dict[str, Any]], weak: bool) -> str:
    lines = [f"bench scaling ({'weak: batch per rank fixed' if weak else 'strong: global batch fixed'})",
             f"  {'ranks':>5s} {'batch':>6s} {'step s':>9s} {'tokens/s':>10s} {'tok/s/rank':>10s} "
             f"{'speedup':>8s} {'efficiency':>10s}"]
    for p in points:
        lines.append(f"  {p['ranks']:5d} {p['batch']:6d} {p['step_s']:9.3f} {p['tokens_per_s']:10.1f} "
                     f"{p['tokens_per_s_per_rank']:10.1f} {p['speedup']:8.3f} {100 * p['efficiency']:9.1f}%")
    return "\n".join(lines)


def _submit(config: str, overrides: list[str], ranks: int, total: int, run_dir: str, args) -> None:
    if ranks % args.gpus_per_node and ranks > args.gpus_per_node:
        raise ValueError(f"{ranks} ranks are not whole nodes of --gpus-per-node {args.gpus_per_node}")
    nodes, per_node = max(1, ranks // args.gpus_per_node), min(ranks, args.gpus_per_node)
    cmd = [sys.executable, "-m", "hyflow.cli", "launch", "slurm", config, "--nodes", str(nodes),
           "--gpus-per-node", str(per_node), *overrides, f"trainer.total_steps={total}",
           f"trainer.output_dir={run_dir}", "trainer.resume=never", *shlex.split(args.slurm)]
    print(f"[bench] {' '.join(cmd[2:])}", flush=True)
    code = subprocess.call(cmd)
    if code:
        raise RuntimeError(f"`hyflow launch slurm` failed for {ranks} ranks (exit {code})")


def run(args: argparse.Namespace) -> int:
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        if not ranks or min(ranks) < 1:
            raise ValueError(f"--ranks {args.ranks!r}: give world sizes like 1,2,4")
        if args.launcher == "slurm" or args.collect:
            if not args.output_dir:
                raise ValueError("--launcher slurm and --collect need --output-dir")
        cfg = load_job_config(args.config, [o for o in args.overrides if not o.startswith("trainer.nproc=")]
                              + [f"trainer.nproc={ranks[0]}"])
        points = []
        for r in ranks:
            overrides = point_overrides(cfg, args.overrides, r, ranks[0], args.weak)
            run_dir = os.path.join(os.path.abspath(args.output_dir), f"ranks-{r}") if args.output_dir else None
            if args.collect:
                result = analyse(run_dir, args.warmup)
            elif args.launcher == "slurm":
                load_job_config(args.config, overrides + [f"trainer.nproc={r}"])  # divides at this size
                _submit(args.config, overrides, r, args.steps + args.warmup, run_dir, args)
                continue
            else:
                result = measure(args.config, overrides, r, args.steps, args.warmup, run_dir, quiet=args.quiet)
            batch = int(next((o.split("=", 1)[1] for o in reversed(overrides)
                              if o.startswith("data.train_batch_size=")), cfg.data.train_batch_size))
            points.append(dict(ranks=r, batch=batch, step_s=result["step_s"], step_s_median=result["step_s_median"],
                               tokens_per_s=result["tokens_per_s"],
                               tokens_per_s_per_rank=result["tokens_per_s_per_rank"],
                               transition_share=result["transition_share"],
                               comm_share=(result.get("comm") or {}).get("share"), run_dir=result["run_dir"]))
    except (ConfigError, ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"hyflow bench scaling: {e}", file=sys.stderr)
        return 2
    if args.launcher == "slurm" and not args.collect:
        print(f"[bench] submitted {len(ranks)} job(s); when they finished: hyflow bench scaling {args.config} "
              f"{' '.join(args.overrides)} --ranks {args.ranks}{' --weak' if args.weak else ''} "
              f"--output-dir {args.output_dir} --collect")
        return 0
    efficiencies(points, args.weak)
    print(format_table(points, args.weak))
    print(json.dumps({"mode": "weak" if args.weak else "strong", "points": points, "config": args.config,
                      "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
                      "date": datetime.date.today().isoformat(), "machine": machine()}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    _parser = argparse.ArgumentParser(prog="hyflow bench scaling")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
