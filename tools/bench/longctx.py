"""``hyflow bench longctx``: long-context memory and time on a tiny model, CPU ranks.

Four measurements (``--only`` picks some):

* ``prefill``: greedy generation after a ``--prompt``-token prompt (default 4096) with chunked
  prefill at several chunk sizes: the extra memory of ``generate`` (peak tensor bytes it
  allocates, less the KV cache), the plan's transient for the chunk, wall time (median of
  ``--repeats``) and whether the tokens equal the unchunked ones;
* ``recompute``: ``lm_tiny`` at 256-token sequences x 4 (activation-dominated), bf16, TP=2 on 2
  ranks, recompute none / selective / full: the plan's step transient and whole-step peak vs
  the measured ones;
* ``cp``: one forward/backward (Megatron's schedule, DDP) of ``--cp-tokens`` tokens (default
  4096) of a tiny Llama with memory-efficient attention, CP=1 on one rank vs CP=2 on two
  ranks (all-to-all attention; the same 2 cores in both): median step wall time, median CPU
  time summed over the ranks (robust to other load on a shared machine) and peak tensor bytes
  per rank, also with selective and full recompute at CP=2;
* ``rl``: RL steps of the real job (``hyflow.jobs.rl.rl_step``: generation through the hybrid
  engine, old / reference log-probs, the GRPO update with a KL loss) on the quickstart's tiny
  Llama with ``--rl-prompt``-token prompts (default 4000, chunked prefill) and 8-token responses,
  2 prompts x 2 samples, packed two sequences a micro-batch, SDPA attention: CP=1 on one rank vs
  CP=2 on two (the same cores), without and with full recompute: median seconds per step, CPU
  seconds summed over the ranks, each phase's median, and per rank the peak tensor bytes a step
  allocates above what was live before it (weights, gradients, Adam state).

Memory is tensor bytes tracked by :class:`hyflow.plan.measure.TensorMemoryTracker` (what the
planner counts); times come from separate, untracked runs. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from hyflow.algorithms.kl import make_kl_controller
from hyflow.data.dataset import build_dataset
from hyflow.data.loader import PromptLoader
from hyflow.data.tasks import load_data_tokenizer
from hyflow.jobs.registry import load_job_config
from hyflow.models.context_parallel import cp_token_mean, next_token_labels, split_for_cp
from hyflow.models.description import tiny_llama
from hyflow.monitor.timers import PhaseTimers
from hyflow.parallel.layout import Layout
from hyflow.plan.memory_estimate import generation_transient, kv_cache_bytes
from hyflow.rewards.manager import RewardManager
from hyflow.tools.convert.launch import run_ranks
from hyflow.training.supervisor import StepSupervisor

MIB = 2 ** 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default="prefill,recompute,cp,rl",
                   help="comma-separated subset of prefill,recompute,cp,rl")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens of the prefill measurement")
    p.add_argument("--chunks", default="0,256,1024,2048", help="prefill chunk sizes (0 = whole prompt)")
    p.add_argument("--cp-tokens", type=int, default=4096, help="sequence length of the CP measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median kept)")
    p.add_argument("--rl-prompt", type=int, default=4000, help="prompt tokens of the rl measurement")
    p.add_argument("--rl-layouts", default="1:none,2:none,2:full",
                   help="layouts of the rl measurement, cp:recompute, comma-separated")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank in the cp measurement (0: cores / ranks; 1 makes CPU "
                        "seconds count work only, without OpenMP spin-waits)")


def _tiny(num_layers: int = 4, max_pos: int = 8192):
    return tiny_llama(num_layers=num_layers, vocab_size=256, max_position_embeddings=max_pos)


# ----------------------------------------------------------------------------- prefill


def _prefill_rank(prompt_len: int, chunks: list[int], repeats: int) -> dict:
    # torch and Megatron load only when the bench runs: `hyflow --help` imports this module
    from hyflow.models.builder import build_gpt_model
    from hyflow.parallel.groups import init_training_groups
    from hyflow.plan.measure import TensorMemoryTracker
    from hyflow.rollout import GenerationConfig, GenerationEngine, SamplingConfig

    groups = init_training_groups(Layout())
    desc = _tiny()
    model = build_gpt_model(desc, groups, spec="local", seed=0)
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for chunk in chunks:
        engine = GenerationEngine.from_description(model, desc, GenerationConfig(
            sampling=SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True), max_concurrent=1,
            prefill_chunk_size=chunk, cpu_weight_packing=False))
        tracker = TensorMemoryTracker()
        with tracker:
            tokens = engine.generate([prompt]).samples[0].token_ids
        times, cpu = [], []
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            engine.generate([prompt])
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        out[chunk] = {"peak": tracker.peak, "seconds": statistics.median(times),
                      "cpu_seconds": statistics.median(cpu), "tokens": tokens}
    return out


def _prefill(args: argparse.Namespace) -> dict:
    chunks = [int(c) for c in args.chunks.split(",")]
    res = run_ranks(_prefill_rank, 1, args.prompt, chunks, args.repeats)[0]
    desc = _tiny()
    cache = kv_cache_bytes(desc, 1, 1, slots=1, capacity=args.prompt + 7, dtype="fp32")
    rows = {}
    print(f"chunked prefill: {args.prompt}-token prompt + 8 greedy tokens, tiny Llama "
          f"({desc.num_layers} layers, hidden {desc.hidden_size}), fp32, 1 rank; KV cache {cache / MIB:.2f} MiB")
    print(f"{'chunk':>8s} {'extra MiB':>10s} {'plan MiB':>9s} {'seconds':>8s} {'CPU s':>7s} {'same tokens':>12s}")
    for chunk, r in res.items():
        planned = generation_transient(desc, 1, prefill_tokens=chunk or args.prompt, rows=1, dtype="fp32",
                                       chunked=bool(chunk), context=args.prompt + 8)
        rows[str(chunk)] = {"extra_mib": (r["peak"] - cache) / MIB, "plan_mib": planned / MIB,
                            "seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"],
                            "same_tokens": r["tokens"] == res[chunks[0]]["tokens"]}
        v = rows[str(chunk)]
        print(f"{chunk or 'whole':>8} {v['extra_mib']:10.2f} {v['plan_mib']:9.2f} {v['seconds']:8.2f} "
              f"{v['cpu_seconds']:7.2f} {str(v['same_tokens']):>12s}")
    return {"prompt": args.prompt, "kv_cache_mib": cache / MIB, "chunks": rows}


# ----------------------------------------------------------------------------- recompute


def _recompute_rank(recompute: str) -> dict:
    # torch and Megatron load only when the bench runs: `hyflow --help` imports this module
    from hyflow.plan.measure import measure_lm

    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "lm_tiny.yaml")
    return measure_lm(os.path.abspath(config), [
        "actor.dtype=bf16", f"actor.recompute={recompute}", "data.seq_length=256", "data.micro_batch_size=4",
        "data.global_batch_size=8", "model.max_position_embeddings=256"], steps=2)


def _recompute(args: argparse.Namespace) -> dict:
    out = {}
    print("recompute: lm_tiny, 256-token sequences x 4 per micro-batch, bf16, TP=2 on 2 ranks (rank 0)")
    print(f"{'recompute':>10s} {'step transient MiB':>19s} {'plan MiB':>9s} {'ratio':>6s} "
          f"{'step peak MiB':>14s} {'plan MiB':>9s} {'ratio':>6s}")
    for recompute in ("none", "selective", "full"):
        r = run_ranks(_recompute_rank, 2, recompute)[0]
        row = {"transient_mib": r["tensor_step_transient_bytes"] / MIB,
               "plan_transient_mib": r["estimate_transient_bytes"] / MIB,
               "peak_mib": r["tensor_peak_bytes"] / MIB, "plan_peak_mib": r["estimate_bytes"] / MIB}
        out[recompute] = row
        print(f"{recompute:>10s} {row['transient_mib']:19.2f} {row['plan_transient_mib']:9.2f} "
              f"{row['plan_transient_mib'] / row['transient_mib']:6.3f} {row['peak_mib']:14.2f} "
              f"{row['plan_peak_mib']:9.2f} {row['plan_peak_mib'] / row['peak_mib']:6.3f}")
    return out


# ----------------------------------------------------------------------------- context parallelism


def _cp_rank(cp: int, seq: int, recompute: str, repeats: int, threads: int) -> dict:
    # torch and Megatron load only when the bench runs: `hyflow --help` imports this module
    from hyflow.models.builder import build_gpt_model, recompute_overrides
    from hyflow.parallel.groups import init_training_groups
    from hyflow.plan.measure import TensorMemoryTracker
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    if threads:
        torch.set_num_threads(threads)
    groups = init_training_groups(Layout(cp=cp))
    desc = _tiny(max_pos=seq)
    model = build_gpt_model(desc, groups, spec="sdpa", seed=0, config_overrides=recompute_overrides(recompute))
    (ddp,) = wrap_ddp([model], groups, distributed_optimizer=False)
    tokens = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = split_for_cp({"tokens": tokens, "labels": next_token_labels(tokens),
                          "loss_mask": torch.ones(1, seq), "position_ids": torch.arange(seq).unsqueeze(0)},
                         groups.pgs.cp)

    def loss_fn(output, b):
        loss = cp_token_mean(output, b["loss_mask"], groups.pgs.cp)
        return loss, {"loss": loss.detach()}

    def step() -> None:
        ddp.zero_grad_buffer()
        forward_backward([ddp], [batch], loss_fn=loss_fn)

    step()  # warm-up (allocates the grad buffers' first use, caches)
    tracker = TensorMemoryTracker()
    with tracker:
        before = tracker.current
        step()
    times, cpu = [], []
    for _ in range(repeats):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        cpu.append(time.process_time() - start_cpu)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return {"peak": tracker.peak - before, "seconds": statistics.median(times),
            "cpu_seconds": statistics.median(cpu)}


def _cp(args: argparse.Namespace) -> dict:
    seq = args.cp_tokens
    cases = [(1, "none"), (2, "none"), (2, "selective"), (2, "full")]
    out = {}
    print(f"context parallelism: forward+backward of one {seq}-token sequence, tiny Llama "
          f"({_tiny().num_layers} layers, hidden {_tiny().hidden_size}), fp32, SDPA attention, "
          f"{args.threads or 'cores / ranks'} thread(s) per rank")
    print(f"{'layout':>26s} {'seconds':>8s} {'CPU s (all ranks)':>18s} {'step MiB/rank':>14s}")
    for cp, recompute in cases:
        r = run_ranks(_cp_rank, cp, cp, seq, recompute, args.repeats, args.threads)
        row = {"seconds": max(x["seconds"] for x in r), "cpu_seconds": sum(x["cpu_seconds"] for x in r),
               "peak_mib": max(x["peak"] for x in r) / MIB}
        name = f"cp={cp} ({cp} rank{'s' if cp > 1 else ''})" + (f" {recompute}" if recompute != "none" else "")
        out[name] = row
        print(f"{name:>26s} {row['seconds']:8.3f} {row['cpu_seconds']:18.3f} {row['peak_mib']:14.2f}")
    return {"tokens": seq, "threads_per_rank": args.threads or None, "layouts": out}


# ----------------------------------------------------------------------------- RL step at CP


RL_NEW_TOKENS = 8
RL_PHASES = ("gen", "old_log_prob", "ref", "update_actor")


def _rl_overrides(cp: int, recompute: str, prompt: int) -> list[str]:
    seq = prompt + 16 + RL_NEW_TOKENS  # the task's own prompt (< 16 tokens) after the filler
    return [
        "actor.spec=sdpa", "actor.layout.tp=1", f"actor.layout.cp={cp}", f"actor.recompute={recompute}", "actor.sft_warmup_steps=0",
        "actor.pack_sequences=true", f"actor.max_tokens_per_micro_batch={2 * seq}", "actor.micro_batch_size=2",
        "actor.mini_batch_size=4", "actor.ppo_epochs=1", "actor.old_logprobs=recompute", "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.01", f"model.max_position_embeddings={seq + 16}", f"rollout.max_prompt_length={prompt + 16}",
        f"rollout.max_new_tokens={RL_NEW_TOKENS}", "rollout.n=2", "rollout.prefill_chunk_size=1024",
        "data.task_size=64", "data.train_batch_size=2", "trainer.seed=1", f"trainer.nproc={cp}",
    ]


def _rl_rank(cp: int, recompute: str, prompt: int, repeats: int, threads: int) -> dict:
    # torch and Megatron load only when the bench runs: `hyflow --help` imports this module
    import hyflow.jobs.rl as rl
    from hyflow.plan.measure import TensorMemoryTracker
    from hyflow.rl.models import build_rl_models
    from hyflow.rl.state import RLState

    if threads:
        torch.set_num_threads(threads)
    config = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.yaml"))
    cfg = load_job_config(config, _rl_overrides(cp, recompute, prompt))
    tok = load_data_tokenizer(cfg.data)
    dataset = build_dataset(cfg.data, cfg.rollout, tok)
    # a long context before each task prompt: digits and letters of the character tokenizer
    alphabet = tok.encode("0123456789abcdefghijklmnopqrstuvwxyz ")
    filler = torch.randint(0, len(alphabet), (prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    for record in dataset:
        record.prompt_ids = [alphabet[i] for i in filler] + list(record.prompt_ids)
    loader = PromptLoader(dataset, cfg.data.train_batch_size, seed=3)
    models = build_rl_models(cfg, tok)
    state = RLState(models, loader, make_kl_controller(cfg.algorithm), StepSupervisor(3))
    job = rl.StepJob(tok, RewardManager.from_config(cfg.reward), sorted({r.data_source for r in dataset}))

    def step(timers) -> dict:
        metrics, _ = rl.rl_step(cfg, state, loader.next_batch(), job, timers)
        state.step += 1
        return metrics

    step(PhaseTimers())  # warm-up: caches, the generation buffer, Adam state
    tracker = TensorMemoryTracker()
    with tracker:
        before = tracker.current
        metrics = step(PhaseTimers())
    times, cpu, phases = [], [], {p: [] for p in RL_PHASES}
    for _ in range(repeats):
        dist.barrier()
        timers = PhaseTimers()
        start, start_cpu = time.perf_counter(), time.process_time()
        step(timers)
        cpu.append(time.process_time() - start_cpu)
        dist.barrier()
        times.append(time.perf_counter() - start)
        for p in RL_PHASES:
            phases[p].append(timers.step_times.get(p, 0.0))
    return {"peak": tracker.peak - before, "seconds": statistics.median(times), "cpu_seconds": statistics.median(cpu),
            "phases": {p: statistics.median(v) for p, v in phases.items()},
            "tokens": metrics["perf/total_num_tokens"], "pg_loss": metrics["actor/pg_loss"]}


def _rl(args: argparse.Namespace) -> dict:
    cases = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.rl_layouts.split(",")]
    out = {}
    print(f"RL step at context parallelism: GRPO, quickstart tiny Llama, {args.rl_prompt}-token prompts + "
          f"{RL_NEW_TOKENS} new tokens, 2 prompts x 2 samples, packed 2 a micro-batch, KL loss, SDPA attention, "
          f"{args.threads or 'cores / ranks'} thread(s) per rank")
    print(f"{'layout':>24s} {'s/step':>7s} {'CPU s':>7s} {'gen':>6s} {'old lp':>7s} {'ref':>6s} {'update':>7s} "
          f"{'step MiB/rank':>14s}")
    for cp, recompute in cases:
        r = run_ranks(_rl_rank, cp, cp, recompute, args.rl_prompt, args.repeats, args.threads)
        row = {"seconds": max(x["seconds"] for x in r), "cpu_seconds": sum(x["cpu_seconds"] for x in r),
               "phases": {p: max(x["phases"][p] for x in r) for p in RL_PHASES},
               "peak_mib": max(x["peak"] for x in r) / MIB,
               "tokens": r[0]["tokens"], "pg_loss": r[0]["pg_loss"]}
        name = f"cp={cp} ({cp} rank{'s' if cp > 1 else ''})" + (f" {recompute}" if recompute != "none" else "")
        out[name] = row
        ph = row["phases"]
        print(f"{name:>24s} {row['seconds']:7.2f} {row['cpu_seconds']:7.2f} {ph['gen']:6.2f} {ph['old_log_prob']:7.2f} "
              f"{ph['ref']:6.2f} {ph['update_actor']:7.2f} {row['peak_mib']:14.2f}")
    return {"prompt": args.rl_prompt, "threads_per_rank": args.threads or None, "layouts": out}


def run(args: argparse.Namespace) -> int:
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = parts - {"prefill", "recompute", "cp", "rl"}
    if unknown:
        raise SystemExit(f"--only: unknown part(s) {sorted(unknown)}; use prefill, recompute, cp, rl")
    result: dict[str, Any] = {"bench": "longctx"}
    if "prefill" in parts:
        result["prefill"] = _prefill(args)
    if "recompute" in parts:
        result["recompute"] = _recompute(args)
    if "cp" in parts:
        result["cp"] = _cp(args)
    if "rl" in parts:
        result["rl"] = _rl(args)
    print(json.dumps(result))
    return 0
