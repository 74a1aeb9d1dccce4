"""``hyflow doctor [CONFIG [overrides]] [--max-size S] [--iters N]``: check a machine (or a
launched job's machines) before a long run.

Reports versions (torch, megatron-core, transformer-engine, triton, CUDA, NCCL), the GPUs and
their topology, the communication-relevant environment, and, when started by a launcher
(``hyflow launch local doctor --nproc 8``, ``hyflow launch slurm doctor --nodes 2
--gpus-per-node 8``), all-reduce / all-gather bus bandwidth over the world, the ranks of each
node and across nodes (and the actor's tp / dp / pp groups when a config is given), 1 MiB to
1 GiB on GPU, capped at 64 MiB on CPU. The largest size is checked against pass/warn
thresholds (bus bandwidth, GB/s: NVLink 100 within a GPU node, InfiniBand 10 between nodes,
0.05 for CPU ranks; change them with --threshold or --warn-below). Every ring-neighbour rank
pair is also measured on its own, so a slow link is named by its two ranks. The NCCL variables
that decide how a large job fails or communicates get a one-line verdict each.

Rank 0 prints a table (with --json: the report as one JSON object on stdout, the table on stderr). Exit code 1 when a collective returned wrong
results, or with --strict when anything warns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from hyflow.cli_support import make_intermixed
from hyflow.config.units import format_bytes, parse_size
from hyflow.doctor import bandwidth as bw, env
from hyflow.jobs.registry import load_job_config
from hyflow.parallel.distributed import init_distributed, launched_by_torchrun


def _layout_groups(config: Optional[str], overrides: list[str], world: int) -> dict[str, list[list[int]]]:
    if not config:
        return {}

    cfg = load_job_config(config, [o for o in overrides if not o.startswith("trainer.nproc=")]
                          + [f"trainer.nproc={world}"])
    layout = cfg.actor.layout.with_dp_for(world)
    return {f"actor {kind}": layout.groups(kind) for kind in ("tp", "dp", "pp")}


_THRESHOLD_NAMES = {"intra": "gpu_intra_node", "inter": "gpu_inter_node", "cpu": "cpu"}


def thresholds_of(args: argparse.Namespace) -> dict[str, float]:
    """Pass/warn thresholds in GB/s by link kind, from the defaults and the options."""
    out = dict(bw.THRESHOLDS_GBPS)
    if getattr(args, "warn_below", None) is not None:
        out = {k: args.warn_below for k in out}
    items = [part for item in getattr(args, "threshold", None) or [] for part in item.split(",") if part]
    for item in items:
        name, _, value = item.partition("=")
        if name not in _THRESHOLD_NAMES:
            raise SystemExit(f"hyflow doctor: --threshold {item!r}: use intra=, inter= or cpu=GBPS")
        try:
            out[_THRESHOLD_NAMES[name]] = float(value)
        except ValueError:
            raise SystemExit(f"hyflow doctor: --threshold {item!r}: {value!r} is not a number") from None
    return out


def run_doctor(args: argparse.Namespace) -> dict[str, Any]:
    """Collect everything (collective when launched as ranks); returns the JSON object."""
    report: dict[str, Any] = {"versions": env.versions(), "cpu": env.cpu_info(), "gpus": env.gpus(),
                              "topology": env.topology(), "env": env.relevant_env()}
    thresholds = thresholds_of(args)
    if not launched_by_torchrun():
        report.update(world_size=1, nodes=1, backend=None, bandwidth=[], pairs=[], errors=[],
                      nccl_env=env.nccl_env_verdicts(on_gpu=bool(report["gpus"])),
                      note="one process: start with `hyflow launch local doctor --nproc N` to "
                           "measure collective bandwidth")
        return report
    init_distributed()
    world = dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    hosts = bw.host_of_ranks()
    intra, inter = bw.node_groups(hosts)
    named: dict[str, list[list[int]]] = {"world": [list(range(world))]}
    local = {"world": len(intra) == 1}
    if len(intra) > 1:
        named["intra-node"], local["intra-node"] = intra, True
        if inter:
            named["inter-node"], local["inter-node"] = inter, False
    node_of = {r: i for i, g in enumerate(intra) for r in g}
    for kind, groups in _layout_groups(args.config, args.overrides, world).items():
        named[kind] = groups
        local[kind] = all(len({node_of[r] for r in g}) == 1 for g in groups)
    sizes = bw.default_sizes(on_gpu, args.max_size)
    rows, errors = bw.measure_groups(named, sizes, iters=args.iters, warmup=args.warmup,
                                     local=local, on_gpu=on_gpu, thresholds=thresholds)
    pairs = bw.measure_pairs(min(sizes[-1], args.pair_size or sizes[-1]), iters=args.iters, warmup=args.warmup,
                             hosts=hosts, on_gpu=on_gpu, thresholds=thresholds)
    verdicts: list[Any] = [None] * world  # each host's own environment (a diagnostic, once)
    dist.all_gather_object(verdicts, env.nccl_env_verdicts(multi_node=len(intra) > 1, on_gpu=on_gpu))
    merged: dict[tuple, dict] = {}
    for host, items in zip(hosts, verdicts):
        for v in items:
            merged.setdefault((v["name"], v["status"], v["message"]), dict(v, hosts=[]))["hosts"].append(host)
    for v in merged.values():
        v["hosts"] = sorted(set(v["hosts"]))
    report.update(world_size=world, nodes=len(intra), backend=dist.get_backend(),
                  device="cuda" if on_gpu else "cpu", sizes=sizes,
                  size_note=None if on_gpu or args.max_size else
                  f"CPU run: sizes capped at {format_bytes(bw.CPU_MAX_SIZE)} (GPU runs go to 1 GiB)",
                  bandwidth=bw.rows_json(rows), pairs=pairs, errors=errors, nccl_env=list(merged.values()),
                  group_ranks={kind: groups for kind, groups in named.items()},
                  thresholds_gbps=thresholds,
                  torch_threads=torch.get_num_threads())
    return report


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table."""
    lines = [f"hyflow doctor: {report['world_size']} rank(s) on {report['nodes']} node(s)"
             + (f", backend {report['backend']}" if report.get("backend") else "")]
    lines += ["", "Versions"] + [f"  {k:20s} {v}" for k, v in report["versions"].items()]
    cpu = report["cpu"]
    lines.append(f"  {'cpus':20s} {cpu.get('cpus')} (affinity {cpu.get('affinity', '?')}), "
                 f"{cpu.get('memory_gib', '?')} GiB memory")
    lines += ["", "GPUs"]
    if report["gpus"]:
        lines += [f"  {g['index']}: {g['name']} {g['memory_gib']} GiB, sm {g['capability']}, "
                  f"{g['sms']} SMs" for g in report["gpus"]]
    else:
        lines.append("  none visible (CPU run: gloo instead of NCCL)")
    lines += ["", "Topology (nvidia-smi topo -m)"]
    lines += ["  " + ln for ln in report["topology"].splitlines()] if report["topology"] else \
        ["  not available (no NVIDIA driver)"]
    lines += ["", "Environment"] + ([f"  {k}={v}" for k, v in report["env"].items()] or ["  (none set)"])
    if report.get("note"):
        lines += ["", report["note"]]
    if report["bandwidth"]:
        lines += ["", "Collective bandwidth (time = slowest rank; GB/s = 1e9 B/s)"
                  + (f"; {report['size_note']}" if report.get("size_note") else ""),
                  f"  {'op':10s} {'group':14s} {'ranks':>5s} {'groups':>6s} {'size':>9s} "
                  f"{'time':>10s} {'algbw':>8s} {'busbw':>8s}  status"]
        for r in report["bandwidth"]:
            status = r["status"] if r["status"] == "-" else \
                f"{r['status']} (threshold {r['threshold_gbps']:g} GB/s)"
            lines.append(f"  {r['op']:10s} {r['group']:14s} {r['group_size']:5d} {r['groups']:6d} "
                         f"{format_bytes(r['size']):>9s} {r['seconds'] * 1e3:8.2f}ms "
                         f"{r['algbw_gbps']:8.3f} {r['busbw_gbps']:8.3f}  {status}")
        checked = [r for r in report["bandwidth"] if r["status"] != "-"]
        warns = [r for r in checked if r["status"] == "warn"]
        lines.append(f"  {len(checked) - len(warns)} pass, {len(warns)} warn")
    if report.get("pairs"):
        lines += ["", "Rank pairs (both directions at once; GB/s per direction)",
                  f"  {'ranks':>9s} {'link':15s} {'size':>9s} {'time':>10s} {'GB/s':>8s}  status"]
        for p in report["pairs"]:
            a, b = p["ranks"]
            lines.append(f"  {f'{a}<->{b}':>9s} {p['link']:15s} {format_bytes(p['size']):>9s} "
                         f"{p['seconds'] * 1e3:8.2f}ms {p['gbps']:8.3f}  {p['status']} "
                         f"(threshold {p['threshold_gbps']:g} GB/s)")
    if report.get("nccl_env"):
        lines += ["", "NCCL environment"]
        for v in report["nccl_env"]:
            where = f" [{', '.join(v['hosts'])}]" if report.get("nodes", 1) > 1 and v.get("hosts") else ""
            lines.append(f"  {v['status']:4s} {v['name']}: {v['message']}{where}")
    if report.get("warnings"):
        lines += [""] + [f"warning: {w}" for w in report["warnings"]]
    for e in report.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def warnings_of(report: dict[str, Any]) -> list[str]:
    """One line per warning: slow groups (with their slowest measured rank pair), slow rank
    pairs, NCCL variables."""
    out = []
    pairs = report.get("pairs", [])
    for r in report["bandwidth"]:
        if r["status"] != "warn":
            continue
        members = {x for g in report.get("group_ranks", {}).get(r["group"], []) for x in g}
        inside = [p for p in pairs if set(p["ranks"]) <= members]
        slowest = min(inside, key=lambda p: p["gbps"], default=None)
        pair = (f"; slowest rank pair {slowest['ranks'][0]}<->{slowest['ranks'][1]} at "
                f"{slowest['gbps']:.3g} GB/s" if slowest else "")
        out.append(f"{r['op']} over {r['group']} ({r['group_size']} ranks x {r['groups']}): bus bandwidth "
                   f"{r['busbw_gbps']:.3g} GB/s at {format_bytes(r['size'])} is below {r['threshold_gbps']:g} GB/s"
                   + pair)
    for p in pairs:
        if p["status"] == "warn":
            a, b = p["ranks"]
            where = "on " + p["hosts"][0] if p["hosts"][0] == p["hosts"][1] else f"{p['hosts'][0]} -> {p['hosts'][1]}"
            out.append(f"ranks {a}<->{b} ({where}, {p['link']}): {p['gbps']:.3g} GB/s per direction is below "
                       f"{p['threshold_gbps']:g} GB/s")
    for v in report.get("nccl_env", []):
        if v["status"] == "warn":
            out.append(f"{v['name']}: {v['message']}")
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    report = run_doctor(args)
    bad = bool(report.get("errors"))
    report["warnings"] = warnings_of(report)
    report["status"] = "error" if bad else ("warn" if report["warnings"] else "pass")
    if int(os.environ.get("RANK", "0")) == 0:
        if args.json:  # for scripts: the report as one JSON object on stdout, the table on stderr
            print(format_report(report), file=sys.stderr, flush=True)
            print(json.dumps(report, separators=(",", ":")), flush=True)
        else:
            print(format_report(report), flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 1 if bad or (args.strict and report["warnings"]) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hyflow doctor``."""
    p = make_intermixed(subparsers.add_parser(
        "doctor", help="versions, GPU topology, environment and collective bandwidth",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("config", nargs="?", help="job config: also measure the actor's tp/dp/pp groups")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    p.add_argument("--max-size", type=parse_size,
                   help="largest message (default 1GiB on GPU, 64MiB on CPU)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per size (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size (default: %(default)s)")
    p.add_argument("--warn-below", type=float, metavar="GBPS",
                   help="one bandwidth threshold for every group and rank pair (default: per link, see --threshold)")
    p.add_argument("--threshold", action="append", metavar="LINK=GBPS[,...]",
                   help="threshold of one link kind: intra=GBPS (GPUs of a node, default 100), inter=GBPS "
                        "(between nodes, default 10), cpu=GBPS (CPU ranks, default 0.05); repeatable")
    p.add_argument("--pair-size", type=parse_size, default=None,
                   help="message of the rank-pair measurement (default: the largest size)")
    p.add_argument("--strict", action="store_true", help="exit 1 when anything warns (default: warnings only print)")
    p.add_argument("--json", action="store_true",
                   help="print the report as one JSON object on stdout (the table goes to stderr)")
    p.set_defaults(func=cmd_doctor)
