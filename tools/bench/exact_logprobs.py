"""``hyflow bench exact-logprobs CONFIG [overrides]``: what exact mode costs and what it reaches.

Builds the RL job of CONFIG on its ranks (``trainer.nproc``, :func:`hyflow.testing.run_on_ranks`)
and, with the actor's weights fixed, repeats ``--repeats`` times on every rank's DP shard of one
batch of prompts (a fresh sampling seed each time):

1. reshard to the generation layout and generate (``rollout.n`` samples per prompt): time ``g``;
2. re-score the samples in the generation layout with the training scoring's micro-batches
   (:func:`hyflow.rl.exact_logprobs.rescore_in_generation_layout`, exact mode's extra work when
   the generation TP equals the training TP): time ``e``;
3. reshard back; the training-layout forward scores the same samples (the reference, and the
   old-log-prob forward that ``actor.old_logprobs=rollout`` saves in exact mode): time ``t``.

Reported, medians over the repeats: generation tokens/s without exact mode (``tokens / g``) and
with it (``tokens / (g + e)``), their ratio (both measured in the same run, interleaved), ``e``
against ``t``, and the
largest |log-prob difference| to the training forward of the sampler's log-probs and of the
re-scored ones (0.0 = bit-identical). A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from typing import Sequence
import os
import time

from hyflow.config import ConfigError
from hyflow.jobs.registry import load_job_config
from hyflow.testing import run_on_ranks
from hyflow.tools.bench.rl import machine

INTERMIXED = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="RL job config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="repeats left out first (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds the ranks may take (default: %(default)s)")


def _measure(config: str, overrides: Sequence[str], repeats: int):
    # torch and Megatron load only when the bench runs: `hyflow --help` imports this module
    import torch

    from hyflow.jobs.rl import _rollout_batch
    from hyflow.rl.batch import batching_for
    from hyflow.rl.exact_logprobs import rescore_in_training_layout
    from hyflow.testing.rl import rl_setup

    torch.set_num_threads(1)
    cfg, state, job = rl_setup(list(overrides), config=config)
    models = state.models
    records = state.loader.next_batch()
    first, stop = models.rollouts.shard(len(records))
    prompts = [r.prompt_ids for r in records[first:stop]]
    scoring = batching_for(cfg, "reference", models.groups, job.pad_id)
    vocab, temp = models.sample_vocab, cfg.rollout.temperature
    rows = []
    for r in range(repeats):
        models.weights.to_generation()
        t0 = time.perf_counter()
        rollout = models.rollouts.generate(prompts, cfg.rollout.n, seed=1000 + r, request_offset=first)
        t1 = time.perf_counter()
        batch = _rollout_batch(rollout.samples, job.pad_id)
        exact = models.rollouts.rescore(batch, scoring, temperature=temp, fused=True,
                                        train_mode=models.actor.chunks[0].training)
        t2 = time.perf_counter()
        models.weights.to_training()
        t3 = time.perf_counter()
        train = rescore_in_training_layout(models.actor.chunks, models.groups, batch, scoring, vocab, temp)
        t4 = time.perf_counter()
        mask = batch.response_mask > 0
        rows.append({"tokens": int(batch.response_lengths.sum()), "gen_s": t1 - t0, "rescore_s": t2 - t1, "train_s": t4 - t3,
                     "sampler_diff": float((train - batch.rollout_logprobs)[mask].abs().max()),
                     "exact_diff": float((train - exact)[mask].abs().max())})
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_job_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"hyflow bench exact-logprobs: {e}", file=sys.stderr)
        return 2
    total = args.warmup + args.repeats
    os.environ.setdefault("HYFLOW_TEST_STARTUP_TIMEOUT", str(args.timeout))  # importing Megatron on a busy box
    per_rank = run_on_ranks(_measure, cfg.trainer.nproc, args.config, list(args.overrides), total,
                            timeout=args.timeout)
    # DP ranks generate different shards: tokens add up, a repeat lasts as long as its slowest rank
    measured = []
    for r in range(args.warmup, total):
        reps = [ranks[r] for ranks in per_rank]
        dp = cfg.actor_layout(cfg.trainer.nproc).dp
        tokens = sum(x["tokens"] for x in reps) * dp / len(reps)  # every rank of a DP group holds its shard
        g, e = max(x["gen_s"] for x in reps), max(x["rescore_s"] for x in reps)
        measured.append({"off": tokens / g, "exact": tokens / (g + e), "ratio": g / (g + e), "rescore_s": e,
                         "train_s": max(x["train_s"] for x in reps),
                         "sampler_diff": max(x["sampler_diff"] for x in reps),
                         "exact_diff": max(x["exact_diff"] for x in reps)})
    med = {k: statistics.median(m[k] for m in measured) for k in ("off", "exact", "ratio", "rescore_s", "train_s")}
    result = {
        "benchmark": "exact-logprobs", "config": args.config, "overrides": list(args.overrides),
        "train_layout": f"tp={cfg.actor.layout.tp} pp={cfg.actor.layout.pp}",
        "gen_layout": f"tp={cfg.rollout.layout.tp} pp={cfg.rollout.layout.pp}", "dtype": cfg.actor.dtype,
        "repeats": args.repeats, "gen_tokens_per_s_off": med["off"], "gen_tokens_per_s_exact": med["exact"],
        "exact_over_off": med["ratio"], "rescore_s": med["rescore_s"], "training_forward_s": med["train_s"], "sampler_logprob_diff_max": max(m["sampler_diff"] for m in measured),
        "rescored_logprob_diff_max": max(m["exact_diff"] for m in measured),
        "date": datetime.date.today().isoformat(), "machine": machine(),
    }
    print(f"exact mode on {result['train_layout']} -> generation {result['gen_layout']} ({result['dtype']}), "
          f"{args.repeats} repeats, medians")
    print(f"  generation tokens/s, exact off   {med['off']:10.1f}")
    print(f"  generation tokens/s, exact on    {med['exact']:10.1f}   ({med['ratio']:.3f}x)")
    print(f"  re-score s / training-layout forward s   {med['rescore_s']:.2f} / {med['train_s']:.2f}")
    print(f"  |logp - training| max, sampler   {result['sampler_logprob_diff_max']:.3g}")
    print(f"  |logp - training| max, re-scored {result['rescored_logprob_diff_max']:.3g}")
    print(json.dumps(result))
    sys.stdout.flush()
    return 0
