"""``hyflow doctor [CONFIG [overrides]] [--max-size S] [--iters N]``: check a machine (or a
launched job's machines) before a long run.

Reports versions (torch, megatron-core, transformer-engine, triton, CUDA, NCCL), the GPUs and
their topology, the communication-relevant environment, and, when started by a launcher
(``hyflow launch local doctor --nproc 8``, ``hyflow launch slurm doctor --nodes 2
--gpus-per-node 8``), all-reduce / all-gather bus bandwidth over the world, the ranks of each
node and across nodes (and the actor's tp / dp / pp groups when a config is given), 1 MiB to
1 GiB on GPU, capped at 64 MiB on CPU. The largest size is checked against pass/warn
thresholds; warnings do not fail. Rank 0 prints a table, then one JSON line. Exit code 1 only
when a collective returned wrong results.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional

from hyflow.launch.args import format_bytes, make_intermixed, parse_size


def _layout_groups(config: Optional[str], overrides: list[str], world: int) -> dict[str, list[list[int]]]:
    if not config:
        return {}
    from hyflow.cli import load_job_config

    cfg = load_job_config(config, [o for o in overrides if not o.startswith("trainer.nproc=")]
                          + [f"trainer.nproc={world}"])
    layout = cfg.actor.layout.with_dp_for(world)
    return {f"actor {kind}": layout.groups(kind) for kind in ("tp", "dp", "pp")}


def run_doctor(args: argparse.Namespace) -> dict[str, Any]:
    """Collect everything (collective when launched as ranks); returns the JSON object."""
    from hyflow.doctor import bandwidth as bw
    from hyflow.doctor import env

    report: dict[str, Any] = {"versions": env.versions(), "cpu": env.cpu_info(), "gpus": env.gpus(),
                              "topology": env.topology(), "env": env.relevant_env()}
    from hyflow.parallel.distributed import launched_by_torchrun

    if not launched_by_torchrun():
        report.update(world_size=1, nodes=1, backend=None, bandwidth=[], errors=[],
                      note="one process: start with `hyflow launch local doctor --nproc N` to "
                           "measure collective bandwidth")
        return report
    import torch
    import torch.distributed as dist

    from hyflow.parallel.distributed import init_distributed

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
                                     local=local, on_gpu=on_gpu, warn_below=args.warn_below)
    report.update(world_size=world, nodes=len(intra), backend=dist.get_backend(),
                  device="cuda" if on_gpu else "cpu", sizes=sizes,
                  size_note=None if on_gpu or args.max_size else
                  f"CPU run: sizes capped at {format_bytes(bw.CPU_MAX_SIZE)} (GPU runs go to 1 GiB)",
                  bandwidth=bw.rows_json(rows), errors=errors,
                  thresholds_gbps=bw.THRESHOLDS_GBPS if args.warn_below is None
                  else {"all": args.warn_below},
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
    for e in report.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    report = run_doctor(args)
    bad = bool(report.get("errors"))
    checked = [r for r in report["bandwidth"] if r["status"] != "-"]
    report["status"] = "error" if bad else ("warn" if any(r["status"] == "warn" for r in checked)
                                            else "pass")
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_report(report) + "\n\n" + json.dumps(report, separators=(",", ":")), flush=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 1 if bad else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hyflow doctor``."""
    p = make_intermixed(subparsers.add_parser(
        "doctor", help="versions, GPU topology, environment and collective bandwidth",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("config", nargs="?", help="job config: also measure the actor's tp/dp/pp groups")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    p.add_argument("--max-size", type=parse_size,
                   help="largest message (default 1GiB on GPU, 64MiB on CPU)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size")
    p.add_argument("--warn-below", type=float, metavar="GBPS",
                   help="one bus-bandwidth threshold for every group (default: per device/locality)")
    p.set_defaults(func=cmd_doctor)
