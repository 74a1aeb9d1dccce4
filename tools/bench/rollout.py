"""``hyflow bench rollout``: generation tokens/s of hyflow's engine vs ``transformers`` (and vLLM).

Same weights (the HF model is converted into a Megatron ``GPTModel``; vLLM, with ``--backend``
naming it, is fed that model's weights in memory as the RL job feeds it), same prompts, same
batch, greedy, KV cache on for all, exactly ``--new-tokens`` new tokens per prompt (EOS disabled
everywhere, so the work is equal). Runs are interleaved (ours, HF, vLLM, ours, ...) and the best
of ``--repeats`` is kept, which makes the ratios robust on a shared machine (medians are printed
too). The last line of output is one JSON object with ``tokens_per_s``, ``hf_tokens_per_s``,
``speedup`` (hyflow over HF) and their ``*_median`` counterparts, plus ``vllm_tokens_per_s``,
``vllm_speedup`` (vLLM over hyflow) and ``vllm_load_s`` (median in-memory weight load) with vLLM.
vLLM is timed twice, one engine switched between its CPU GEMM modes (``rollout.vllm.cpu_gemm``):
``vllm`` packed, ``vllm_plain`` torch's linear on the live weights (its keys ``vllm_plain_*``);
each of its runs loads the weights in its mode first (``*_load_s``, untimed in the generate).
``--batch 16,64`` times each batch size in the same run (one table each; the JSON line is the
last batch's, with every batch's row under ``by_batch``).

``--compare-batching`` adds a second measurement: sampled responses with EOS on
(lengths vary), generated with continuous batching and with static batches, to
show what refilling freed slots saves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "List three prime numbers.",
    "How do I boil an egg?", "Translate 'good morning' into Spanish.",
    "What is 12 times 7?", "Name a famous painting.", "Why is the sky blue?",
    "Give me a tip for learning to code.", "What does a compiler do?",
    "Describe a cat in five words.", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?", "Suggest a name for a dog.",
    "What is machine learning?",
]


#: vLLM's rows: result-key prefix -> rollout.vllm.cpu_gemm.
VLLM_ROWS = {"vllm": "packed", "vllm_plain": "plain"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("smollm2", "tiny", "qwen2.5-0.5b"), default="smollm2",
                   help="smollm2: SmolLM2-135M-Instruct (GGUF, dequantised); tiny: a random 4-layer Llama; "
                        "qwen2.5-0.5b: Qwen2.5-0.5B's architecture with random weights (nothing downloaded)")
    p.add_argument("--no-hf", action="store_true", help="time hyflow's engine only (no transformers baseline)")
    p.add_argument("--batch", default="16",
                   help="prompts generated together; a comma list (16,64) times each batch in one run")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (best is kept)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="model dtype")
    p.add_argument("--profile", action="store_true",
                   help="print a torch profiler table of one decode-heavy run of each engine")
    p.add_argument("--backend", default="hyflow,hf",
                   help="engines to time, comma-separated: hyflow, hf (transformers generate), vllm "
                        "(needs vLLM installed; rollout.backend=vllm's engine); hyflow is always timed")
    p.add_argument("--compare-batching", action="store_true",
                   help="also time continuous vs static batching on sampled, variable-length responses")


def _tiny_hf(seed: int = 0) -> Any:
    # transformers (optional, seconds to import) only for the models and the HF reference it builds
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _qwen_hf(seed: int = 0) -> Any:
    """Qwen2.5-0.5B's architecture (its config.json's numbers), random weights."""
    # transformers (optional, seconds to import) only for the models and the HF reference it builds
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _batches(args: argparse.Namespace) -> list[int]:
    try:
        sizes = [int(b) for b in str(args.batch).split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--batch: positive integers, comma-separated (e.g. 16,64), got {args.batch!r}")
    return sizes


def _prompts(batch: int, tok: Any, vocab: int) -> list[list[int]]:
    """``batch`` distinct prompts (chat questions, numbered past the first 16, so that no prompt
    repeats: vLLM's prefix cache would otherwise skip the prefill of repeats)."""

    if tok is not None:
        out = []
        for i in range(batch):
            text = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
            if i >= len(CHAT_PROMPTS):
                text = f"Question {i + 1}: {text}"
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        return out
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (16 + (7 * i) % 33,), generator=g).tolist() for i in range(batch)]


def _hf_generate(hf: Any, prompts: list[list[int]], new_tokens: int,
                 pad_id: int) -> tuple[float, float, list[list[int]]]:
    """HF ``generate`` on left-padded prompts: (wall s, process CPU s, new tokens per prompt)."""

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          use_cache=True, pad_token_id=pad_id, eos_token_id=None)
    return time.perf_counter() - start, time.process_time() - cpu, out[:, width:].tolist()


def run(args: argparse.Namespace) -> int:
    # Megatron (seconds) only when the bench runs: `hyflow --help` imports this module for its arguments
    from hyflow.compat.cpu import maybe_activate
    from hyflow.parallel.distributed import init_distributed, shutdown
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.rollout import GenerationEngine, GenerationConfig, SamplingConfig
    from hyflow.rollout.loading import load_hf, megatron_from_hf, smollm2_gguf

    maybe_activate()
    if args.threads:
        torch.set_num_threads(args.threads)

    init_distributed()
    try:
        groups = init_training_groups(Layout())
        t0 = time.perf_counter()
        if args.model == "smollm2":
            hf, tok = load_hf(smollm2_gguf(), args.dtype)
        else:
            hf, tok = (_qwen_hf() if args.model == "qwen2.5-0.5b" else _tiny_hf()), None
            hf = hf.to(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
        hf.generation_config.eos_token_id = None
        model, desc = megatron_from_hf(hf, groups, dtype=args.dtype)
        load_s = time.perf_counter() - t0
        pad_id = (tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0)
        greedy = SamplingConfig(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True,
                                logprobs=True)
        backends = [b.strip() for b in args.backend.split(",") if b.strip()]
        unknown = sorted(set(backends) - {"hyflow", "hf", "vllm"})
        if unknown:
            raise SystemExit(f"--backend: unknown engine(s) {unknown}; choose from hyflow, hf, vllm")
        sizes = _batches(args)
        all_prompts = {b: _prompts(b, tok, desc.vocab_size) for b in sizes}
        vllm_engine = None
        if "vllm" in backends:
            longest = max(len(p) for ps in all_prompts.values() for p in ps)
            vllm_engine = _vllm_engine(model, desc, groups, max(sizes), longest, args)
        rows = []
        for batch in sizes:
            prompts = all_prompts[batch]
            engine = GenerationEngine.from_description(
                model, desc, GenerationConfig(max_concurrent=batch, sampling=greedy))
            rows.append(_measure(args, batch, prompts, engine, hf if "hf" in backends and not args.no_hf else None,
                                 vllm_engine, greedy, pad_id, model, load_s))
        row = dict(rows[-1])
        if len(rows) > 1:
            row["by_batch"] = rows
        if args.compare_batching:
            # The random tiny model almost never samples its EOS: give it 1 stop id in 40 so
            # response lengths vary as they do for a real model.
            stops = list(range(0, desc.vocab_size, 40)) if args.model == "tiny" else None
            row["batching"] = _compare_batching(engine, prompts, args, stops)
        if vllm_engine is not None:
            vllm_engine.close()
        print(json.dumps(row), flush=True)
    finally:
        shutdown()
    return 0


def _measure(args: argparse.Namespace, batch: int, prompts: list[list[int]], engine: Any, hf: Any, vllm_engine: Any,
             greedy: Any, pad_id: int, model: Any, load_s: float) -> dict:
    """One batch size: every engine's interleaved runs, the table, and the batch's JSON row."""

    runners = {"hyflow": lambda: _timed(lambda: _ours(engine, prompts))}
    if hf is not None:
        runners["hf"] = lambda: _hf_generate(hf, prompts, args.new_tokens, pad_id)
    loads: dict = {}
    if vllm_engine is not None:
        for name, gemm in VLLM_ROWS.items():
            loads[name] = []
            runners[name] = lambda gemm=gemm, name=name: _vllm_run(vllm_engine, model, gemm, prompts, greedy,
                                                                   loads[name])
    # Warm-up (allocator, first-call dispatch) on every side.
    engine.generate(prompts[:2], greedy.replace(max_new_tokens=4))
    if "hf" in runners:
        _hf_generate(hf, prompts[:2], 4, pad_id)
    for gemm in VLLM_ROWS.values() if vllm_engine is not None else ():
        _vllm_run(vllm_engine, model, gemm, prompts[:2], greedy.replace(max_new_tokens=4), [])
    if args.profile:
        _profile(engine, hf, prompts, pad_id, args)
    times = {k: [] for k in runners}
    cpus = {k: [] for k in runners}
    outs: dict = {}
    for _ in range(args.repeats):
        for name, fn in runners.items():
            seconds, cpu_s, outs[name] = fn()
            times[name].append(seconds)
            cpus[name].append(cpu_s)
    tokens = batch * args.new_tokens
    ours_t = times["hyflow"]
    best, med = min(ours_t), statistics.median(ours_t)
    row = {
        "bench": "rollout", "model": args.model, "batch": batch, "new_tokens": args.new_tokens,
        "dtype": args.dtype, "threads": torch.get_num_threads(),
        "prompt_tokens": sum(len(p) for p in prompts), "backends": list(runners),
        "tokens_per_s": round(tokens / best, 2), "seconds": round(best, 3),
        "tokens_per_s_median": round(tokens / med, 2), "load_s": round(load_s, 1),
        # what a decode step reads at least (every weight once), for the HBM roofline
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "runs_s": [round(t, 2) for t in ours_t], "cpu_runs_s": [round(t, 2) for t in cpus["hyflow"]],
    }
    for name in ("hf", *VLLM_ROWS):
        if name not in runners:
            continue
        b, m = min(times[name]), statistics.median(times[name])
        match = sum(a == b_ for a, b_ in zip(outs["hyflow"], outs[name]))
        row.update({f"{name}_tokens_per_s": round(tokens / b, 2), f"{name}_seconds": round(b, 3),
                    f"{name}_tokens_per_s_median": round(tokens / m, 2),
                    f"{name}_runs_s": [round(t, 2) for t in times[name]],
                    f"{name}_cpu_runs_s": [round(t, 2) for t in cpus[name]],
                    f"{name}_greedy_match": f"{match}/{batch}"})
    if "hf" in runners:  # hyflow over transformers (the historical keys)
        hf_best, hf_med = min(times["hf"]), statistics.median(times["hf"])
        row.update(speedup=round(hf_best / best, 3), speedup_median=round(hf_med / med, 3),
                   cpu_speedup=round(min(cpus["hf"]) / min(cpus["hyflow"]), 3),
                   greedy_match=row["hf_greedy_match"])
    for name in VLLM_ROWS if vllm_engine is not None else ():  # vLLM over hyflow
        v_best, v_med = min(times[name]), statistics.median(times[name])
        row.update({f"{name}_speedup": round(best / v_best, 3), f"{name}_speedup_median": round(med / v_med, 3),
                    f"{name}_load_s": round(statistics.median(loads[name]), 3)})
    print(f"rollout benchmark: {args.model}, batch {batch}, {args.new_tokens} new tokens, greedy, "
          f"{args.dtype}, {row['threads']} threads, {row['prompt_tokens']} prompt tokens")
    print(f"{'engine':<26}{'best s':>9}{'tokens/s':>11}{'median tok/s':>14}{'greedy = hyflow':>17}"
          f"{'runs (s)':>30}")
    labels = {"hyflow": "hyflow GenerationEngine", "hf": "transformers generate", "vllm": "vLLM, cpu_gemm=packed",
              "vllm_plain": "vLLM, cpu_gemm=plain"}
    for name in runners:
        b, m = min(times[name]), statistics.median(times[name])
        same = "-" if name == "hyflow" else row[f"{name}_greedy_match"]
        print(f"{labels[name]:<26}{b:>9.2f}{tokens / b:>11.1f}{tokens / m:>14.1f}{same:>17}"
              f"{str([round(t, 2) for t in times[name]]):>30}")
    if "hf" in runners:
        print(f"hyflow over transformers {row['speedup']:.2f}x (process CPU time: {row['cpu_speedup']:.2f}x)")
    for name in VLLM_ROWS if vllm_engine is not None else ():
        print(f"{labels[name]} over hyflow {row[f'{name}_speedup']:.2f}x; in-memory weight load into vLLM "
              f"(median) {row[f'{name}_load_s']:.3f} s")
    return row


def _compare_batching(engine: Any, prompts: list[list[int]], args: argparse.Namespace,
                      stop_ids: Any = None) -> dict:
    """Continuous vs static batching on sampled responses whose lengths vary (EOS on)."""
    # Megatron (seconds) only when the bench runs: `hyflow --help` imports this module for its arguments
    from hyflow.rollout import SamplingConfig

    params = SamplingConfig(temperature=1.0, n=4, max_new_tokens=args.new_tokens, seed=3, eos_token_ids=stop_ids)
    out = {}
    print(f"\nbatching comparison: {len(prompts)} prompts x n=4 sampled (T=1, EOS on), "
          f"{engine.config.max_concurrent} slots")
    print(f"{'policy':<12}{'seconds':>9}{'tokens':>8}{'tokens/s':>10}{'steps':>7}{'decode rows':>13}"
          f"{'padded rows*':>14}")
    for policy in ("continuous", "static"):
        engine.config.batching = policy
        res = engine.generate(prompts, params)
        s = res.stats
        lengths = [len(x.token_ids) for x in res.samples]
        # Rows a static batch computes when finished rows are not dropped (HF generate).
        slots = engine.config.max_concurrent
        padded = sum(max(lengths[i:i + slots]) * len(lengths[i:i + slots]) for i in range(0, len(lengths), slots))
        out[policy] = {"seconds": round(s.seconds, 3), "tokens": s.generated_tokens,
                       "tokens_per_s": round(s.tokens_per_s, 1), "decode_rows": s.decode_rows,
                       "decode_steps": s.decode_steps, "padded_rows": padded}
        print(f"{policy:<12}{s.seconds:>9.2f}{s.generated_tokens:>8}{s.tokens_per_s:>10.1f}{s.decode_steps:>7}"
              f"{s.decode_rows:>13}{padded:>14}")
    engine.config.batching = "continuous"
    print("* row-forwards a static batch needs if finished rows stay in the batch (as in HF generate)")
    return out


def _timed(fn) -> tuple[float, float, Any]:
    """(wall s, process CPU s, result) of ``fn()``."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - start, time.process_time() - cpu, out


def _ours(engine: Any, prompts: list[list[int]], sampling: Any = None) -> list[list[int]]:
    return [s.token_ids for s in engine.generate(prompts, sampling).samples]


def _vllm_run(vllm_engine: Any, model: Any, gemm: str, prompts: list[list[int]], sampling: Any,
              loads: list) -> tuple[float, float, list[list[int]]]:
    """vLLM in GEMM mode ``gemm``: switch (untimed), load ``model``'s weights in memory (its seconds
    appended to ``loads``), then the timed generate."""
    # vLLM (optional) and Megatron only when the vLLM backend is benched
    from hyflow.vllm_backend.weights import vllm_weights

    vllm_engine.options = dataclasses.replace(vllm_engine.options, cpu_gemm=gemm)
    vllm_engine.apply_cpu_gemm()
    loads.append(vllm_engine.load_weights(vllm_weights(model, vllm_engine.desc, vllm_engine.vocab_size)))
    return _timed(lambda: _ours(vllm_engine, prompts, sampling))


def _vllm_engine(model: Any, desc: Any, groups: Any, batch: int, longest_prompt: int,
                 args: argparse.Namespace) -> Any:
    """rollout.backend=vllm's engine on this one rank (weights loaded by each run, :func:`_vllm_run`)."""
    # vLLM (optional) and Megatron only when the vLLM backend is benched
    from hyflow.rollout import GenerationConfig, SamplingConfig
    from hyflow.vllm_backend.config import VLLMConfig, check_vllm_imports
    from hyflow.vllm_backend.engine import VLLMEngine

    check_vllm_imports()
    greedy = SamplingConfig(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    config = GenerationConfig(max_concurrent=batch, sampling=greedy)
    engine = VLLMEngine(desc, config, VLLMConfig(), vocab_size=desc.vocab_size, eos_token_ids=[],
                        tp_groups=[[0]], dtype=args.dtype, device=groups.device,
                        seq_budget=longest_prompt + args.new_tokens)
    return engine


def _profile(engine: Any, hf: Any, prompts: list[list[int]], pad_id: int, args: argparse.Namespace) -> None:
    """Operator tables (self CPU time) of 16 new tokens with each engine."""

    # Megatron (seconds) only when the bench runs: `hyflow --help` imports this module for its arguments
    from hyflow.rollout import SamplingConfig

    short = SamplingConfig(temperature=0, max_new_tokens=16, ignore_eos=True)
    runs = [("hyflow", lambda: engine.generate(prompts, short))]
    if hf is not None:
        runs.append(("transformers", lambda: _hf_generate(hf, prompts, 16, pad_id)))
    for name, fn in runs:
        with torch.profiler.profile() as prof:
            fn()
        print(f"\nprofile: {name}, batch {len(prompts)}, 16 new tokens")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
