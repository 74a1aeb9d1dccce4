"""``hyflow bench rl CONFIG [overrides] --steps N``: how fast an RL run is and where the time goes.

Runs ``--warmup + --steps`` steps of the real job (``hyflow launch local``, the same ranks
``hyflow train`` starts) into a scratch run directory, then reads the job's own
``metrics.jsonl`` -- nothing is re-implemented -- and reports over the measured steps:

* seconds per phase and its share of the step (reshard, generate, reward, old/reference
  log-probs, critic values, advantages, updates) and what no phase covers; the transition share is the
  reshard's;
* throughput: prompt + response tokens per second of step time, and per rank (verl's
  ``perf/throughput``: tokens / (step seconds x ranks)); generation tokens per second;
* MFU: model FLOPs (:mod:`hyflow.plan.flops`) / (step seconds x ranks x peak per rank),
  for the whole step and for the updates alone; peak = datasheet on GPU, measured on CPU;
* communication (:mod:`hyflow.monitor.comm`): seconds, share and bytes per step by group kind,
  and the monitor's own overhead (calls x measured cost of one wrapped call);
* peak memory of the largest rank.

``--collect RUN_DIR`` reads an existing run directory instead (a run submitted with ``hyflow
launch slurm``, or any training run). A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

from hyflow.config import ConfigError
from hyflow.jobs.registry import load_job_config
from hyflow.monitor import comm
from hyflow.monitor.metrics import read_metrics
from hyflow.plan.flops import device_peak, step_flops

#: phase -> alternatives, each a tuple of metric keys summed (today's names, then verl's).
PHASES: dict[str, tuple[tuple[str, ...], ...]] = {
    "reshard": (("time/reshard",), ("timing_s/reshard",)),
    "generate": (("time/generate",), ("timing_s/gen",)),
    "reward": (("time/reward",), ("timing_s/reward",)),
    "ref": (("time/ref",), ("timing_s/old_log_prob", "timing_s/ref")),
    "critic": (("time/critic",), ("timing_s/values",)),
    "adv": (("time/adv",), ("timing_s/adv",)),
    "update": (("time/update",), ("timing_s/update_actor", "timing_s/update_critic")),
}
STEP_KEYS = (("time/step",), ("timing_s/step",))
UPDATE_CPU_KEYS = (("cpu_s/update_actor", "cpu_s/update_critic"),)
UPDATE_CPU_MAX_KEYS = (("cpu_s_max/update_actor", "cpu_s_max/update_critic"),)
TOKEN_KEYS = (("perf/total_num_tokens",),)
GEN_RATE_KEYS = (("tokens_per_s",), ("rollout/tokens_per_s",))
RESPONSE_KEYS = (("response_length/mean",),)


#: ``key=value`` overrides may come before or after the options
INTERMIXED = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="RL job config (YAML); not needed with --collect")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps run first and left out of the figures (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: the config's trainer.nproc)")
    parser.add_argument("--output-dir", default=None,
                        help="run directory (default: a temporary one, removed afterwards)")
    parser.add_argument("--collect", metavar="RUN_DIR", default=None,
                        help="report on an existing run directory instead of running the job")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s per rank for the MFU (default: datasheet on GPU, measured on CPU)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the job's output")


# ------------------------------------------------------------------------------ running

def run_job(config: str, overrides: Sequence[str], nproc: int, total_steps: int, run_dir: str,
            quiet: bool = False) -> None:
    """``hyflow launch local CONFIG --nproc N`` for ``total_steps`` steps into ``run_dir``."""
    extra = [f"trainer.total_steps={total_steps}", f"trainer.output_dir={run_dir}", "trainer.resume=never",
             "trainer.save_every=0"]
    cmd = [sys.executable, "-m", "hyflow.cli", "launch", "local", config, "--nproc", str(nproc),
           *[o for o in overrides if not o.startswith(("trainer.total_steps=", "trainer.output_dir="))], *extra]
    os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(run_dir, "bench.log")
    print(f"[bench] {total_steps} steps on {nproc} rank(s); log {log_path}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()  # the log is worth reading while a long run goes on
            if not quiet:
                sys.stdout.write(line)
        code = proc.wait()
    if code != 0:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-30:])
        raise RuntimeError(f"the job failed (exit {code}); last lines of {log_path}:\n{tail}")


# ------------------------------------------------------------------------------ analysis

def _value(row: dict, alternatives: tuple[tuple[str, ...], ...]) -> Optional[float]:
    for keys in alternatives:
        if any(k in row for k in keys):
            return sum(float(row.get(k) or 0.0) for k in keys)
    return None


def _sum(rows: list[dict], alternatives) -> float:
    return sum(_value(r, alternatives) or 0.0 for r in rows)


def machine() -> str:
    """One line naming this machine's accelerator or CPU."""
    try:
        # torch and Megatron load only when the bench runs: `hyflow --help` imports this module
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover
        pass
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()}-core {model}"


def analyse(run_dir: str, warmup: int, peak_per_rank: Optional[float] = None, peak_source: str = "",
            overhead_per_call: Optional[float] = None) -> dict[str, Any]:
    """The figures of ``run_dir``'s steps after the first ``warmup``."""
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) > warmup]
    if not rows:
        raise RuntimeError(f"{run_dir} has no steps after the {warmup} warm-up step(s)")
    cfg = load_job_config(os.path.join(run_dir, "config.resolved.yaml"), [])
    ranks = cfg.trainer.nproc
    step_s = [_value(r, STEP_KEYS) or 0.0 for r in rows]
    total_s = sum(step_s)
    n = len(rows)
    phases = {name: _sum(rows, alts) / n for name, alts in PHASES.items()}
    mean_step = total_s / n
    other = mean_step - sum(phases.values())
    tokens = _sum(rows, TOKEN_KEYS)
    batch_rows = cfg.data.train_batch_size * cfg.rollout.n
    gen_s = _sum(rows, PHASES["generate"])
    gen_tokens = sum((_value(r, GEN_RATE_KEYS) or 0.0) * (_value(r, PHASES["generate"]) or 0.0) for r in rows)
    if not gen_tokens:
        gen_tokens = sum((_value(r, RESPONSE_KEYS) or 0.0) * batch_rows for r in rows)
    flops = [step_flops(cfg, _value(r, TOKEN_KEYS) or 0.0, batch_rows,
                        None if _value(r, RESPONSE_KEYS) is None else _value(r, RESPONSE_KEYS) * batch_rows)
             for r in rows]
    step_flops_mean = sum(f["step"] for f in flops) / n
    update_flops = sum(f["update"] for f in flops)
    update_s = _sum(rows, PHASES["update"])
    result: dict[str, Any] = {
        "run_dir": run_dir, "steps": n, "warmup": warmup, "ranks": ranks,
        "step_s": mean_step, "step_s_median": statistics.median(step_s),
        "phases_s": phases, "phase_shares": {k: v / mean_step for k, v in phases.items()},
        "other_s": other, "phases_cover": sum(phases.values()) / mean_step,
        "transition_share": phases["reshard"] / mean_step,
        "tokens_per_step": tokens / n, "tokens_per_s": tokens / total_s,
        "tokens_per_s_per_rank": tokens / total_s / ranks,
        "gen_tokens_per_s": gen_tokens / gen_s if gen_s else None,
        "model_flops_per_step": step_flops_mean,
    }
    if peak_per_rank:
        result["peak_flops_per_rank"] = peak_per_rank
        result["peak_source"] = peak_source
        result["mfu"] = sum(f["step"] for f in flops) / (total_s * ranks * peak_per_rank)
        result["mfu_update"] = update_flops / (update_s * ranks * peak_per_rank) if update_s else None
        # the same FLOPs over the CPU seconds rank 0 spent updating (x ranks): what the update's code
        # achieves on the cores it got, whatever else shared the machine
        update_cpu = _sum(rows, UPDATE_CPU_KEYS)
        if update_cpu:
            result["update_cpu_s"] = update_cpu / n
            result["mfu_update_cpu"] = update_flops / (update_cpu * ranks * peak_per_rank)
    # the busiest rank's update CPU seconds: the slowest pipeline stage's work
    update_cpu_max = _sum(rows, UPDATE_CPU_MAX_KEYS)
    if update_cpu_max:
        result["update_cpu_s_max"] = update_cpu_max / n
    if any("comm/seconds" in r for r in rows):
        kinds = sorted({k.split("/")[1] for r in rows for k in r
                        if k.startswith("comm/") and k.endswith("/bytes") and k.count("/") == 2}
                       - {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all", "barrier"})
        comm_s = sum(r.get("comm/seconds") or 0.0 for r in rows) / n
        calls = sum(r.get("comm/calls") or 0.0 for r in rows) / n
        result["comm"] = {
            "seconds": comm_s, "share": comm_s / mean_step,
            "bytes": sum(r.get("comm/bytes") or 0.0 for r in rows) / n, "calls": calls,
            "timeouts": max(r.get("comm/timeouts") or 0.0 for r in rows),
            "by_kind": {k: {"seconds": sum(r.get(f"comm/{k}/seconds") or 0.0 for r in rows) / n,
                            "bytes": sum(r.get(f"comm/{k}/bytes") or 0.0 for r in rows) / n} for k in kinds},
        }
        if overhead_per_call is not None:
            result["comm"]["monitor_overhead_share"] = calls * overhead_per_call / mean_step
    for key in ("perf/max_rss_gb", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            result[key.split("/", 1)[1]] = max(values)
    return result


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return ""  # pragma: no cover


def format_table(r: dict[str, Any]) -> str:
    lines = [f"bench rl: {r['steps']} steps after {r['warmup']} warm-up, {r['ranks']} rank(s), "
             f"step {r['step_s']:.3f} s (median {r['step_s_median']:.3f} s)",
             f"  {'phase':10s} {'s/step':>9s} {'share':>7s}"]
    for name, seconds in r["phases_s"].items():
        lines.append(f"  {name:10s} {seconds:9.4f} {100 * r['phase_shares'][name]:6.1f}%")
    lines.append(f"  {'other':10s} {r['other_s']:9.4f} {100 * r['other_s'] / r['step_s']:6.1f}%"
                 f"   (phases cover {100 * r['phases_cover']:.1f}% of the step)")
    lines.append(f"transition (reshard) share: {100 * r['transition_share']:.2f}% of the step")
    lines.append(f"throughput: {r['tokens_per_s']:.1f} tokens/s, {r['tokens_per_s_per_rank']:.1f} tokens/s per "
                 f"rank ({r['tokens_per_step']:.0f} prompt+response tokens per step)")
    if r.get("gen_tokens_per_s"):
        lines.append(f"generation: {r['gen_tokens_per_s']:.1f} tokens/s")
    if r.get("mfu") is not None:
        upd = f", updates {100 * r['mfu_update']:.2f}%" if r.get("mfu_update") is not None else ""
        lines.append(f"MFU: {100 * r['mfu']:.2f}% of {r['peak_flops_per_rank'] / 1e9:.1f} GFLOP/s per rank{upd} "
                     f"({r['model_flops_per_step'] / 1e9:.2f} GFLOP per step; peak {r['peak_source']})")
        if r.get("mfu_update_cpu") is not None:
            lines.append(f"update MFU in CPU time: {100 * r['mfu_update_cpu']:.1f}% "
                         f"({r['update_cpu_s']:.2f} CPU s per rank per step in the update"
                         + (f", busiest rank {r['update_cpu_s_max']:.2f}" if r.get("update_cpu_s_max") else "") + ")")
    comm = r.get("comm")
    if comm:
        kinds = ", ".join(f"{k} {v['seconds']:.3f} s / {_fmt_bytes(v['bytes'])}" for k, v in comm["by_kind"].items())
        lines.append(f"communication: {comm['seconds']:.3f} s ({100 * comm['share']:.1f}% of the step), "
                     f"{_fmt_bytes(comm['bytes'])}, {comm['calls']:.0f} calls per step; {kinds}")
        if "monitor_overhead_share" in comm:
            lines.append(f"  monitor overhead: {100 * comm['monitor_overhead_share']:.3f}% of the step")
    mem = [f"host RSS {r['max_rss_gb']:.2f} GiB"] if r.get("max_rss_gb") is not None else []
    if r.get("max_memory_allocated_gb"):
        mem.insert(0, f"device {r['max_memory_allocated_gb']:.2f} GiB allocated "
                      f"({r.get('max_memory_reserved_gb', 0):.2f} reserved)")
    if mem:
        lines.append("peak memory of the largest rank: " + ", ".join(mem))
    return "\n".join(lines)


def measure(config: str, overrides: Sequence[str], nproc: Optional[int], steps: int, warmup: int,
            output_dir: Optional[str] = None, peak_tflops: Optional[float] = None,
            quiet: bool = False) -> dict[str, Any]:
    """Run the job and analyse it (what ``bench rl`` and ``bench scaling`` share)."""
    cfg = load_job_config(config, list(overrides) + ([f"trainer.nproc={nproc}"] if nproc else []))
    nproc = nproc or cfg.trainer.nproc
    if peak_tflops:
        peak, source = peak_tflops * 1e12, "given (--peak-tflops)"
    else:  # before the job starts, so the measurement has the cores to itself
        peak, source = device_peak(cfg.actor.dtype, threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    overhead = comm.wrapper_overhead()
    run_dir = os.path.abspath(output_dir) if output_dir else tempfile.mkdtemp(prefix="hyflow-bench-rl-")
    try:
        run_job(config, overrides, nproc, steps + warmup, run_dir, quiet=quiet)
        result = analyse(run_dir, warmup, peak, source, overhead)
    finally:
        if not output_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    result.update(config=config, overrides=list(overrides))
    return result


def run(args: argparse.Namespace) -> int:
    try:
        if args.collect:
            peak = args.peak_tflops * 1e12 if args.peak_tflops else None
            result = analyse(os.path.abspath(args.collect), args.warmup, peak, "given (--peak-tflops)" if peak else "")
        else:
            if not args.config:
                print("hyflow bench rl: give a config (or --collect RUN_DIR)", file=sys.stderr)
                return 2
            result = measure(args.config, args.overrides, args.nproc, args.steps, args.warmup, args.output_dir,
                             args.peak_tflops, args.quiet)
    except (ConfigError, RuntimeError, FileNotFoundError) as e:
        print(f"hyflow bench rl: {e}", file=sys.stderr)
        return 2
    result.update(date=datetime.date.today().isoformat(), machine=machine())
    print(format_table(result))
    print(json.dumps(result))
    return 0
