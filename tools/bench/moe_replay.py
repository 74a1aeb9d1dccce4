"""``hyflow bench moe-replay CONFIG [overrides]``: what routing replay does to the sampler / trainer gap.

Builds the RL job of CONFIG (a mixture-of-experts actor) on its ranks (``trainer.nproc``), runs its
SFT warm-up (``actor.sft_warmup_steps``), then, with the weights fixed, ``--repeats`` times on every
rank's DP shard of a fresh batch of prompts: generates with the experts of every fed token recorded,
and scores the samples in the training layout twice, on the same micro-batches:

* without replay (the trainer's routers choose for themselves), and
* with replay (the recorded experts, ``rollout.routing_replay``).

Reported per repeat and over all: ``rollout/logprob_diff_max`` and ``..._mean`` of each scoring
against the sampler's log-probs (the metric the RL job logs under ``actor.old_logprobs=recompute``)
and ``rollout/routing_mismatch`` (the share of token x layer decisions the trainer's routers make
differently). The two scorings see identical samples and weights, so the difference is the replay's
alone. Run it in bf16 (``actor.dtype=bf16``) to see routing flips on CPU. A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from typing import Sequence

import torch

from hyflow.algorithms.mismatch import mismatch_row_stats
from hyflow.config import ConfigError
from hyflow.jobs.registry import load_job_config
from hyflow.models.routing_replay import mismatch_counts, reset_mismatch
from hyflow.monitor.timers import PhaseTimers
from hyflow.testing import run_on_ranks
from hyflow.tools.bench.rl import machine

INTERMIXED = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="RL job config (YAML) of a mixture-of-experts actor")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    parser.add_argument("--repeats", type=int, default=5, help="batches measured (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds the ranks may take (default: %(default)s)")


def _measure(config: str, overrides: Sequence[str], repeats: int):
    # Megatron (seconds) only when the bench runs: `hyflow --help` imports this module for its arguments
    from hyflow.jobs.rl import _rollout_batch, generate_round, sft_warmup
    from hyflow.rl.batch import batching_for
    from hyflow.rl.step_losses import forward_score, logprob_scorer
    from hyflow.testing.rl import rl_setup

    cfg, state, job = rl_setup(list(overrides) + ["rollout.record_routing=true"], config=config)
    models, groups = state.models, state.models.groups
    if cfg.actor.sft_warmup_steps:
        sft_warmup(cfg, state, job.tokenizer)
    scorer = logprob_scorer(models.sample_vocab, groups.pgs.tp, cfg.rollout.temperature, cfg.actor.fused_output_layer)
    rows = []
    for r in range(repeats):
        records = state.loader.next_batch()
        first, stop = models.rollouts.shard(len(records))
        rnd = generate_round(cfg, state, job, records[first:stop], first, 7_000 + r, PhaseTimers())
        batch = _rollout_batch(rnd.samples, job.pad_id)
        lengths, shape = batch.row_lengths(), tuple(batch.tokens.shape)
        batching = batching_for(cfg, "reference", groups, job.pad_id)
        out = {}
        for name, key in (("without", "recorded_routing"), ("with", "routing")):
            columns = {"tokens": batch.tokens, "response_mask": batch.response_mask, key: batch.routing}
            reset_mismatch(models.actor.chunks)
            with torch.no_grad():
                logp = forward_score(models.actor.chunks, batching.cut(columns, lengths), scorer, groups, shape)
            stats = mismatch_row_stats(logp, batch.rollout_logprobs, batch.response_mask)
            differs, compared = mismatch_counts(models.actor.chunks, groups)
            out[name] = {"max": float(stats["abs_diff_max"].max()),
                         "sum": float(stats["abs_diff_sum"].sum()), "tokens": float(stats["tokens"].sum()),
                         "mismatch": differs / max(compared, 1.0)}
        rows.append(out)
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_job_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"hyflow bench moe-replay: {e}", file=sys.stderr)
        return 2
    if cfg.model.moe is None:
        print(f"hyflow bench moe-replay: {args.config} describes a dense model (model.moe is unset)", file=sys.stderr)
        return 2
    os.environ.setdefault("HYFLOW_TEST_STARTUP_TIMEOUT", str(args.timeout))
    per_rank = run_on_ranks(_measure, cfg.trainer.nproc, args.config, list(args.overrides), args.repeats,
                            timeout=args.timeout)
    table = []
    for r in range(args.repeats):
        reps = [ranks[r] for ranks in per_rank]  # each DP rank scored its own shard
        row = {}
        for name in ("without", "with"):
            row[name + "_max"] = max(x[name]["max"] for x in reps)
            row[name + "_mean"] = sum(x[name]["sum"] for x in reps) / max(sum(x[name]["tokens"] for x in reps), 1.0)
        row["routing_mismatch"] = reps[0]["without"]["mismatch"]  # reduced over the layout already
        table.append(row)
    result = {
        "benchmark": "moe-replay", "config": args.config, "overrides": list(args.overrides), "dtype": cfg.actor.dtype,
        "repeats": args.repeats,
        "logprob_diff_max_without_replay": max(t["without_max"] for t in table),
        "logprob_diff_max_with_replay": max(t["with_max"] for t in table),
        "logprob_diff_max_without_replay_median": statistics.median(t["without_max"] for t in table),
        "logprob_diff_max_with_replay_median": statistics.median(t["with_max"] for t in table),
        "logprob_diff_mean_without_replay": statistics.mean(t["without_mean"] for t in table),
        "logprob_diff_mean_with_replay": statistics.mean(t["with_mean"] for t in table),
        "routing_mismatch": statistics.mean(t["routing_mismatch"] for t in table),
        "per_repeat": table, "date": datetime.date.today().isoformat(), "machine": machine(),
    }
    print(f"routing replay on {args.config} ({cfg.actor.dtype}), {args.repeats} batches: |trainer - sampler| log-prob")
    print(f"  {'batch':>5s} {'max w/o replay':>15s} {'max with':>10s} {'mean w/o':>10s} {'mean with':>10s} "
          f"{'routing mismatch':>17s}")
    for i, t in enumerate(table):
        print(f"  {i:5d} {t['without_max']:15.4g} {t['with_max']:10.4g} {t['without_mean']:10.4g} "
              f"{t['with_mean']:10.4g} {t['routing_mismatch']:17.4%}")
    print(json.dumps(result))
    sys.stdout.flush()
    return 0
