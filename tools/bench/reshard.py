"""``hyflow bench reshard``: the hybrid engine's train -> generation transition against
three alternatives on the same model and ranks, in one run:

* (a) Megatron-Core's ``swap_model_weights`` (gloo copy service on CPU, nccl on GPU) into
  a model built in the generation layout;
* (b) a dist-checkpoint round trip: save the training model, load into the generation
  layout;
* (c) a naive all-gather of every full parameter on every rank.

``--vllm`` adds ``rollout.backend: vllm``'s transition: the same train -> generation reshard, then
the generation shards written into a vLLM engine in memory (:mod:`hyflow.vllm_backend`), with its
CPU GEMMs packed and plain (``rollout.vllm.cpu_gemm``) and through vLLM's reload, against the
reshard alone timed in the same rounds (``vllm_transition_ratio``, ``vllm_plain_transition_ratio``).

Prints a table, then one JSON line. Launches its own ranks (``--nproc``) through torchrun
unless already launched.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import torch
import torch.distributed as dist

from hyflow.hybrid.generation_groups import generation_enumerations
from hyflow.models.description import ModelDescription
from hyflow.parallel.distributed import init_distributed
from hyflow.parallel.layout import Layout
from hyflow.rollout.config import GenerationConfig
from hyflow.vllm_backend.config import VLLMConfig, check_vllm_imports


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=24, help="transformer layers of the model")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size")
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (grouped-query attention)")
    parser.add_argument("--ffn", type=int, default=None, help="FFN size (default: 4 * hidden)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--tp", type=int, default=2, help="training tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="training pipeline stages")
    parser.add_argument("--tp-gen", type=int, default=1, help="generation tensor-parallel size")
    parser.add_argument("--pp-gen", type=int, default=1, help="generation pipeline stages")
    parser.add_argument("--nproc", type=int, default=None, help="default: tp * pp")
    parser.add_argument("--repeats", type=int, default=3, help="timed round trips per method (the median is reported)")
    parser.add_argument("--skip", default="",
                        help="comma list of rows to skip: swap,ckpt,naive,collective")
    parser.add_argument("--vllm", action="store_true",
                        help="also time rollout.backend=vllm's transition (reshard + in-memory load into vLLM)")
    parser.add_argument("--transport", default="auto", choices=("auto", "collective", "shared_memory"),
                        help="hybrid engine transport of the TP and PP merges (auto: shared memory for CPU ranks "
                             "on one host; collective: bucketed all-gathers and PP point-to-point, the GPU code path)")


def run(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ:
        nproc = args.nproc or args.tp * args.pp
        # `hyflow bench reshard ARGS` or `python -m hyflow.tools.bench.reshard ARGS`
        argv = sys.argv[sys.argv.index("reshard") + 1:] if "reshard" in sys.argv[1:] else sys.argv[1:]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "hyflow.tools.bench.reshard", *argv]
        return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    return _bench(args)


def _timed(fn, repeats: int, barrier) -> float:
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        fn()
        barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cycle(engine, repeats: int, barrier) -> tuple[float, float]:
    """Median seconds of train->gen and gen->train over ``repeats`` round trips."""
    to_gen, to_train = [], []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        engine.to_generation()
        barrier()
        t1 = time.perf_counter()
        engine.to_training()
        barrier()
        to_gen.append(t1 - t0)
        to_train.append(time.perf_counter() - t1)
    return statistics.median(to_gen), statistics.median(to_train)


def _bench(args: argparse.Namespace) -> int:
    # Megatron (seconds) only when the bench runs: `hyflow --help` imports this module for its arguments
    from hyflow.hybrid.executor import HybridEngine
    from hyflow.models.builder import build_gpt_model
    from hyflow.parallel.groups import init_training_groups

    rank, world = init_distributed()
    desc = ModelDescription(family="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                            num_layers=args.layers, num_attention_heads=args.heads,
                            num_query_groups=args.kv_heads, ffn_hidden_size=args.ffn or 4 * args.hidden,
                            max_position_embeddings=4096)
    desc.validate()
    layout = Layout(tp=args.tp, pp=args.pp).with_dp_for(world)
    groups = init_training_groups(layout)
    model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    barrier = dist.barrier
    proc = psutil.Process()
    engine = HybridEngine(model, desc, groups, (args.tp_gen, args.pp_gen), transport=args.transport)
    rss0 = proc.memory_info().rss
    engine.to_generation()
    rss1 = proc.memory_info().rss
    bytes_received = engine.stats.bytes_received
    engine.to_training()

    to_gen, to_train = _cycle(engine, args.repeats, barrier)
    result = {
        "train_to_gen_s": to_gen, "gen_to_train_s": to_train, "transport": engine.transport.name,
        "pp_transport": engine.pp_exchange.name if engine.pp_exchange is not None else "none",
        "staging_bytes": engine.transport.staging_bytes,
        "pp_staging_bytes": engine.pp_exchange.staging_bytes if engine.pp_exchange is not None else 0,
        "bytes_moved": bytes_received, "planned_bytes": engine.plan.bytes_recv[rank],
        "formula_bytes": float(engine.plan.formula_bytes),
        "peak_extra_bytes": engine.plan.peak_extra_bytes, "rss_growth_bytes": max(rss1 - rss0, 0),
    }
    skip = set(filter(None, args.skip.split(",")))
    if "collective" not in skip and (engine.transport.name != "collective"
                                     or getattr(engine.pp_exchange, "name", "p2p") != "p2p"):
        # The same engine with process-group collectives (the GPU path; gloo here), for reference.
        other = HybridEngine(model, desc, groups, (args.tp_gen, args.pp_gen), transport="collective")
        other.to_generation()
        other.to_training()
        result["collective_train_to_gen_s"], result["collective_gen_to_train_s"] = _cycle(
            other, args.repeats, barrier)
        del other
    gen_groups = engine.gen_groups
    target = None
    if "swap" not in skip or "ckpt" not in skip:
        target = build_gpt_model(desc, gen_groups, config_overrides={"perform_initialization": False},
                                 padded_vocab_size=engine.padded_vocab)
    if "swap" not in skip:
        try:
            # Megatron (seconds) only when the bench runs: `hyflow --help` imports this module for its arguments
            from megatron.core.resharding import swap_model_weights

            backend = "nccl" if torch.cuda.is_available() else "gloo"
            swap_model_weights([model], [target], backend)  # first call builds and caches its plan
            result["swap_model_weights_s"] = _timed(lambda: swap_model_weights([model], [target], backend),
                                                    args.repeats, barrier)
        except Exception as exc:  # report, do not hide: the baseline may not support a layout pair
            result["swap_model_weights_s"] = None
            result["swap_model_weights_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if "ckpt" not in skip:
        # Megatron (seconds) only when the bench runs: `hyflow --help` imports this module for its arguments
        from megatron.core import dist_checkpointing

        with tempfile.TemporaryDirectory() as tmp:
            holder = [tmp]
            dist.broadcast_object_list(holder, src=0)
            path = os.path.join(holder[0], "ckpt")

            def round_trip():
                if rank == 0 and os.path.isdir(path):
                    shutil.rmtree(path)
                barrier()
                os.makedirs(path, exist_ok=True)
                dist_checkpointing.save(model.sharded_state_dict(), path)
                # Generation replicas hold identical shards; Megatron's replica ids come from the
                # training layout's globals, so skip the (save-side) uniqueness validation.
                state = dist_checkpointing.load(target.sharded_state_dict(), path,
                                                validate_access_integrity=False)
                target.load_state_dict(state)

            result["ckpt_roundtrip_s"] = _timed(round_trip, args.repeats, barrier)
    if "naive" not in skip:
        # Every rank all-gathers every parameter of every rank; with PP the stages hold different
        # parameters, so the i-th parameters of all ranks travel together, padded to the largest.
        local = [p.detach().reshape(-1) for p in model.parameters()]
        sizes: list = [None] * world
        dist.all_gather_object(sizes, [t.numel() for t in local])
        widths = [max(s[i] if i < len(s) else 0 for s in sizes) for i in range(max(map(len, sizes)))]

        def naive():
            for i, width in enumerate(widths):
                mine = torch.zeros(width, dtype=local[0].dtype, device=local[0].device)  # NCCL on a GPU, as ours
                if i < len(local):
                    mine[:local[i].numel()] = local[i]
                out = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(out, mine)

        result["naive_allgather_s"] = _timed(naive, args.repeats, barrier)
    if args.vllm:
        result.update(_vllm_transition(engine, desc, gen_groups, args.repeats, barrier, result["train_to_gen_s"]))
    for key in ("swap_model_weights_s", "ckpt_roundtrip_s", "naive_allgather_s"):
        base = result.get(key)
        if base:
            result[f"speedup_vs_{key[:-2]}"] = base / result["train_to_gen_s"]
    if rank == 0:
        result.update(layers=args.layers, hidden=args.hidden, tp=args.tp, pp=args.pp, tp_gen=args.tp_gen,
                      pp_gen=args.pp_gen, world=world, params=desc.num_parameters())
        used = f"{result['transport']}, PP {result['pp_transport']}" if args.pp > args.pp_gen else result["transport"]
        rows = [(f"hybrid engine train->gen ({used})", result["train_to_gen_s"]),
                (f"hybrid engine gen->train ({used})", result["gen_to_train_s"]),
                ("hybrid engine train->gen (collective, PP p2p)", result.get("collective_train_to_gen_s")),
                ("hybrid engine gen->train (collective, PP p2p)", result.get("collective_gen_to_train_s")),
                ("(a) swap_model_weights", result.get("swap_model_weights_s")),
                ("(b) dist-ckpt round trip", result.get("ckpt_roundtrip_s")),
                ("(c) naive all-gather", result.get("naive_allgather_s")),
                ("vLLM: train->gen alone (interleaved with the rows below)", result.get("vllm_reshard_alone_s")),
                ("vLLM: train->gen + in-place load, cpu_gemm=packed", result.get("vllm_train_to_gen_s")),
                ("vLLM: of which the reshard", result.get("vllm_reshard_s")),
                ("vLLM: of which the load", result.get("vllm_load_s")),
                ("vLLM: of which its GEMM packing", result.get("vllm_pack_s")),
                ("vLLM: train->gen + in-place load, cpu_gemm=plain", result.get("vllm_plain_train_to_gen_s")),
                ("vLLM: of which the reshard", result.get("vllm_plain_reshard_s")),
                ("vLLM: of which the load", result.get("vllm_plain_load_s")),
                ("vLLM: train->gen + vLLM's reload_weights", result.get("vllm_reload_train_to_gen_s")),
                ("vLLM: of which the reshard", result.get("vllm_reload_reshard_s")),
                ("vLLM: of which the reload", result.get("vllm_reload_load_s")),
                ("hyflow engine: oneDNN packing at generate start", result.get("hyflow_pack_s"))]
        print(f"reshard {args.layers} layers x hidden {args.hidden} ({desc.num_parameters() / 1e6:.0f}M params), "
              f"tp={args.tp} pp={args.pp} -> tp={args.tp_gen} pp={args.pp_gen} on {world} ranks")
        print(f"{'method':56s} {'seconds':>10s}")
        for name, value in rows:
            print(f"{name:56s} {'-' if value is None else f'{value:10.4f}':>10}")
        print(f"bytes received by rank 0: {bytes_received} (plan {result['planned_bytes']}, "
              f"formula {result['formula_bytes']:.0f})")
        print(f"transport {result['transport']}: {result['staging_bytes']} staging bytes per rank (fixed); "
              f"planned peak extra {result['peak_extra_bytes']} bytes")
        if args.vllm:
            ratio, plain = result["vllm_transition_ratio"], result["vllm_plain_transition_ratio"]
            shown = "-" if ratio is None else (f"{ratio:.2f}x packed, {plain:.2f}x plain "
                                               f"({result['vllm_reload_transition_ratio']:.2f}x through vLLM's reload)")
            print(f"vLLM transition / hybrid engine train->gen: {shown}; packed / train->gen + hyflow's packing: "
                  f"{result['vllm_vs_hyflow_with_packing']:.2f}x; in place: {result['vllm_in_place']}")
            print(f"RSS of rank 0 in the generation layout after a load: packed {result['vllm_rss_bytes'] / 2**30:.2f}"
                  f" GiB, plain {result['vllm_plain_rss_bytes'] / 2**30:.2f} GiB")
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _vllm_transition(engine, desc, gen_groups, repeats: int, barrier, to_gen: float) -> dict:
    """Median seconds of train -> generation plus the load of the generation shards into vLLM (the
    vLLM backend's transition), of the load alone and of its packing, over ``repeats`` round trips
    after a warm-up round: the in-place writer with vLLM's CPU GEMMs packed (``cpu_gemm: packed``)
    and plain (``plain``), vLLM's own reload, and the reshard alone, interleaved in every round.
    Each timed transition follows an untimed one in the same mode (a GEMM-mode switch, then a
    step as a run makes it: to generation, load, back), so it sees a run's steady state, not the
    switch's fresh pages. Ratios are over the interleaved reshard alone."""
    # Megatron (seconds) only when the bench runs: `hyflow --help` imports this module for its arguments
    from hyflow.rollout.cpu_pack import PackedLinears
    from hyflow.vllm_backend.engine import VLLMEngine
    from hyflow.vllm_backend.weights import vllm_weights

    check_vllm_imports()
    options = VLLMConfig()
    vllm = VLLMEngine(desc, GenerationConfig(max_concurrent=8), options, vocab_size=desc.vocab_size,
                      eos_token_ids=[], tp_groups=generation_enumerations(engine.plan)["tp"],
                      device=torch.device("cpu"), seq_budget=256)
    # result-key prefix -> (cpu_gemm, load_in_place)
    modes = {"": ("packed", True), "plain_": ("plain", True), "reload_": ("packed", False)}
    runs: dict = {prefix: {"total": [], "reshard": [], "load": [], "pack": []} for prefix in modes}
    alone, packs, in_place = [], [], {}
    proc = psutil.Process()
    for i in range(repeats + 1):  # the first round is a warm-up
        barrier()
        start = time.perf_counter()
        engine.to_generation()
        barrier()
        if i:
            alone.append(time.perf_counter() - start)
        engine.to_training()
        for prefix, (gemm, load_in_place) in modes.items():
            vllm.options = dataclasses.replace(options, cpu_gemm=gemm, load_in_place=load_in_place)
            vllm.apply_cpu_gemm()
            engine.to_generation()  # the settling step in this mode (untimed)
            vllm.load_weights(vllm_weights(engine.gen_model, desc, desc.vocab_size, gen_groups.pgs.tp))
            engine.to_training()
            barrier()
            start = time.perf_counter()
            engine.to_generation()
            barrier()
            reshard = time.perf_counter() - start
            load = vllm.load_weights(vllm_weights(engine.gen_model, desc, desc.vocab_size, gen_groups.pgs.tp))
            barrier()
            total = time.perf_counter() - start
            in_place[prefix] = vllm._plan is not None
            engine.to_training()
            if i:
                runs[prefix]["total"].append(total)
                runs[prefix]["reshard"].append(reshard)
                runs[prefix]["load"].append(load)
                runs[prefix]["pack"].append(vllm.last_pack_seconds or 0.0)
        # what hyflow's engine does with the same weights at the start of a generate call (CPU, fp32):
        # the oneDNN packing vLLM's packed load includes
        engine.to_generation()
        start = time.perf_counter()
        with PackedLinears(engine.gen_model):
            pass
        pack = time.perf_counter() - start
        engine.to_training()
        if i:
            packs.append(pack)
    # what each mode holds: RSS in the generation layout after a load, freed heap handed back first
    rss = {}
    for gemm in ("packed", "plain", "packed"):
        vllm.options = dataclasses.replace(options, cpu_gemm=gemm)
        vllm.apply_cpu_gemm()
        engine.to_generation()
        vllm.load_weights(vllm_weights(engine.gen_model, desc, desc.vocab_size, gen_groups.pgs.tp))
        _trim_heap()
        rss[gemm] = proc.memory_info().rss  # packed: the second, after the round trip through plain
        engine.to_training()
    vllm.close()
    base = statistics.median(alone)
    out = {"hyflow_pack_s": statistics.median(packs), "vllm_in_place": in_place[""],
           "vllm_plain_in_place": in_place["plain_"], "vllm_reshard_alone_s": base}
    for prefix, run in runs.items():
        out[f"vllm_{prefix}train_to_gen_s"] = statistics.median(run["total"])
        out[f"vllm_{prefix}reshard_s"] = statistics.median(run["reshard"])
        out[f"vllm_{prefix}load_s"] = statistics.median(run["load"])
        out[f"vllm_{prefix}pack_s"] = statistics.median(run["pack"])
        out[f"vllm_{prefix}transition_ratio"] = out[f"vllm_{prefix}train_to_gen_s"] / base if base > 0 else None
    out["vllm_rss_bytes"], out["vllm_plain_rss_bytes"] = rss["packed"], rss["plain"]
    with_pack = base + out["hyflow_pack_s"]
    out["vllm_vs_hyflow_with_packing"] = out["vllm_train_to_gen_s"] / with_pack if with_pack > 0 else None
    return out


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere), so RSS
    shows what is held rather than what the allocator kept."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="hyflow bench reshard")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
