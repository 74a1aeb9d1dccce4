"""Samples/s and pool utilisation of the pooled trainer modes on a long-tail length task.

Runs ``hyflow train`` on the quickstart model (4 ranks: 2 train at TP=2 + 2 generate as 2 replicas)
once per mode: pooled ``sync``, ``one_step_off`` and ``async`` (``--staleness``, new weights after
``--update-after`` tokens). No SFT warm-up and a wide response budget: the random model rarely
samples EOS, so response lengths are geometric (the longest of a batch is ~10x the shortest: the
long tail the async modes are for). Reports per mode, over the steps after the first (start-up
excluded; medians of ``--repeats`` interleaved rounds): samples per second of step time, the generation and training pools' utilisation
(``perf/gen_pool_utilization``, ``perf/train_pool_utilization``), the mean staleness and the
response length spread. A table, then one JSON line.

    hyflow bench async --steps 6
    hyflow bench async --config configs/async_length_tail.yaml --sft-warmup 30 --max-new 60

The second runs the ``length_tail`` task ("write N", N long-tailed in 3..48) after a short SFT
warm-up, so the lengths follow the prompts rather than chance.

On a machine with fewer cores than ranks the pools share the cores: overlap then buys little, and
the numbers measure the schedule's waits rather than the speed-up on separate devices.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from hyflow.monitor.metrics import read_metrics

# The path, not hyflow.testing.rl's constant: that module loads Megatron, and `hyflow --help`
# imports every bench.
QUICKSTART = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.yaml"))

MODES = {
    "sync": ["trainer.mode=sync", "placement.pools={train: [0, 2], gen: [2, 4]}", "placement.actor=train",
             "placement.rollout=gen"],
    "one_step_off": ["trainer.mode=one_step_off"],
    "async": ["trainer.mode=async"],
}


def _overrides(args, out: str) -> list[str]:
    return ["trainer.nproc=4", f"trainer.total_steps={args.steps}", f"data.train_batch_size={args.batch}",
            f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new}", "rollout.max_prompt_length=16",
            "model.max_position_embeddings=160", f"actor.sft_warmup_steps={args.sft_warmup}", "actor.ppo_epochs=1",
            f"actor.mini_batch_size={args.batch * args.n}", f"actor.micro_batch_size={args.batch * args.n // 2}",
            f"trainer.max_staleness={args.staleness}", f"trainer.update_after_tokens={args.update_after}",
            "trainer.loggers=[]", "trainer.save_every=0", "trainer.resume=never", f"trainer.output_dir={out}"]


def _measure(mode: str, args, root: str) -> dict:
    out = os.path.join(root, mode)
    cmd = [sys.executable, "-m", "hyflow.cli", "train", args.config, *_overrides(args, out), *MODES[mode]]
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stdout[-3000:]}")
    rows = read_metrics(out)[1:]  # the first step pays the start-up
    seconds = sum(r["timing_s/step"] for r in rows)
    samples = len(rows) * args.batch * args.n
    return {"mode": mode, "samples_per_s": samples / seconds, "wall_s": wall,
            "gen_util": statistics.mean(r["perf/gen_pool_utilization"] for r in rows),
            "train_util": statistics.mean(r["perf/train_pool_utilization"] for r in rows),
            "staleness": statistics.mean(r["staleness"] for r in rows),
            "len_min": min(r.get("response_length/min", 0.0) for r in rows),
            "len_max": max(r.get("response_length/max", 0.0) for r in rows),
            "score": statistics.mean(r["critic/score/mean"] for r in rows),
            # async: generated samples dropped as more than max_staleness versions old (not in samples/s)
            "dropped": sum(r.get("fully_async/count/dropped_stale_samples", 0.0) for r in rows)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=QUICKSTART, help="the RL config whose model, task and reward are run "
                        "(default: the quickstart; configs/async_length_tail.yaml: lengths 3..48 asked, long-tailed)")
    parser.add_argument("--sft-warmup", type=int, default=0, help="actor.sft_warmup_steps (default: %(default)s: the "
                        "random model's lengths are geometric)")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per mode (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per step (default: %(default)s)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (default: %(default)s)")
    parser.add_argument("--max-new", type=int, default=96, help="response budget (default: %(default)s)")
    parser.add_argument("--staleness", type=int, default=2, help="async trainer.max_staleness (default: %(default)s)")
    parser.add_argument("--update-after", type=int, default=8, help="async trainer.update_after_tokens (default: "
                        "%(default)s)")
    parser.add_argument("--modes", default="sync,one_step_off,async", help="comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the modes, interleaved; medians are "
                        "reported (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            root = tempfile.mkdtemp(prefix="hyflow-bench-async-")
            try:
                runs[mode].append(_measure(mode, args, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    results = [{"mode": m, "repeats": len(rs), **{k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"},
                "samples_per_s_all": [round(r["samples_per_s"], 2) for r in rs]} for m, rs in runs.items()]
    print(f"{'mode':<14}{'samples/s':>10}{'gen util':>10}{'train util':>11}{'staleness':>10}{'len min-max':>13}"
          f"{'score':>8}{'dropped':>9}")
    for r in results:
        print(f"{r['mode']:<14}{r['samples_per_s']:>10.2f}{r['gen_util']:>10.2f}{r['train_util']:>11.2f}"
              f"{r['staleness']:>10.2f}{r['len_min']:>6.0f}-{r['len_max']:<6.0f}{r['score']:>8.3f}{r['dropped']:>9.0f}")
    base = results[0]["samples_per_s"]
    for r in results[1:]:
        print(f"{r['mode']} / {results[0]['mode']}: {r['samples_per_s'] / base:.2f}x samples/s (medians)")
    print(json.dumps({"bench": "async_modes", "results": results}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyflow.tools.bench.async_modes", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
