"""``hyflow generate``: try a model by hand with the rollout engine.

    hyflow generate --ckpt DIR --prompts FILE [--tp N] [--pp N] [--temperature T --top-k K --top-p P --n N ...]
    hyflow generate --hf PATH  --prompts FILE ...     (HF directory or .gguf file)

``--prompts`` is a ``.jsonl`` file whose lines hold ``{"prompt": text}``,
``{"messages": [...]}`` (chat; formatted with the tokenizer's template) or
``{"prompt_ids": [ids]}``, or rows in the RL data format (``.jsonl`` or ``.parquet``,
``prompt`` holding chat messages; ``hyflow make-task`` writes them), or a text file with one
prompt per line. ``--reward RULE`` scores every response against its row's
``reward_model.ground_truth`` and prints the mean. With
``--chat`` plain-text prompts are wrapped as one user message. ``--tp``, ``--pp``
and ``--dp`` start ``tp x pp x dp`` ranks on this machine through torchrun. Rank 0 prints
each response and, with ``--output``, writes one JSON line per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace
from typing import Any, Optional

import torch.distributed as dist

from hyflow.checkpoint.discovery import model_checkpoint_dir
from hyflow.checkpoint.errors import CheckpointError
from hyflow.checkpoint.manifest import NO_VERIFY_ENV
from hyflow.cli_support import run_ranks_here
from hyflow.config import ConfigError
from hyflow.data.dataset import read_rows
from hyflow.data.tokenizer import TokenizerError, load_tokenizer
from hyflow.launch.rank_report import LOG_DIR_ENV, run_reporting
from hyflow.parallel.distributed import init_distributed, launched_by_torchrun, shutdown
from hyflow.parallel.layout import Layout
from hyflow.rewards.manager import RewardManager
from hyflow.rewards.rules import rule_names
from hyflow.rewards.spec import reward_spec
from hyflow.rewards.user_function import RewardError
from hyflow.rollout.config import GenerationConfig, SamplingConfig
from hyflow.rollout.dp import generate_data_parallel


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate responses with the rollout engine",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="hyflow model checkpoint (hyflow convert hf2mcore output), or a training run "
                                    "directory / its checkpoints/ / a step_* checkpoint (its actor, as hyflow export)")
    src.add_argument("--hf", help="Hugging Face model directory or .gguf file")
    p.add_argument("--prompts", required=True, help=".jsonl (prompt / messages / prompt_ids) or .txt file")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the checkpoint's / the HF model's)")
    p.add_argument("--chat", action="store_true", help="wrap plain-text prompts as a user chat message")
    p.add_argument("--tp", type=int, default=1, help="generation tensor parallel size")
    p.add_argument("--pp", type=int, default=1,
                   help="generation pipeline stages (run one after another: saves memory, not time)")
    p.add_argument("--dp", type=int, default=1, help="generation data parallel replicas")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p (1 = all)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest response in tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (same seed, same samples)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=[], help="extra stop ids")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--max-concurrent", type=int, default=64,
                   help="sequences decoded at once per replica (sizes the KV cache)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV-cache length per sequence (default: longest prompt + --max-new-tokens)")
    p.add_argument("--prefill-chunk-size", type=int, default=0,
                   help="prefill long prompts in chunks of this many tokens (0 = whole prompt at once)")
    p.add_argument("--truncate-long-prompts", action="store_true",
                   help="cut prompts that do not fit --max-seq-len from the left instead of failing")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="parameter dtype (default: the checkpoint's, fp32 for --hf)")
    p.add_argument("--output", help="write one JSON line per sample here")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the checksums of the checkpoint's files (sizes and pickles are still checked)")
    p.add_argument("--reward", default=None, metavar="RULE|FILE.py[:FUNCTION]",
                   help=f"score each response against its row's reward_model.ground_truth and report the mean "
                        f"(prompts in the RL data format, e.g. from hyflow make-task): a rule "
                        f"({', '.join(rule_names())}) or a Python file defining verl's compute_score")
    p.add_argument("--multi-turn", metavar="CONFIG", default=None,
                   help="run multi-turn, tool-using trajectories with the rollout.multi_turn section of this RL "
                        "config (tools, environment, budgets; --max-new-tokens per turn) on rows in the RL data "
                        "format; with --reward the final turns are scored (hyflow.agent)")
    p.set_defaults(func=cmd_generate)


def _configs(args: argparse.Namespace):
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, n=args.n,
                              max_new_tokens=args.max_new_tokens, seed=args.seed,
                              stop_token_ids=list(args.stop_token_ids), ignore_eos=args.ignore_eos)
    cfg = GenerationConfig(sampling=sampling, max_concurrent=args.max_concurrent, max_seq_len=args.max_seq_len,
                        prefill_chunk_size=args.prefill_chunk_size,
                        truncate_long_prompts=args.truncate_long_prompts)
    cfg.validate()
    return cfg


def read_prompt_rows(path: str) -> list[Any]:
    """The entries of a prompts file: JSON objects of a ``.jsonl`` / ``.parquet`` file, or the
    lines of a text file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompts file {path} does not exist")
    if path.endswith((".jsonl", ".parquet")):
        entries = read_rows(path)
    else:
        with open(path) as f:
            entries = [line.rstrip("\n") for line in f if line.strip()]
    if not entries:
        raise ValueError(f"no prompts in {path}")
    return entries


def read_prompts(path: str, tokenizer: Any, chat: bool) -> list[list[int]]:
    """Token ids of every prompt in ``path`` (see the module docstring for the formats)."""
    out = []
    for n, item in enumerate(read_prompt_rows(path)):
        if isinstance(item, dict) and "prompt_ids" in item:
            out.append([int(t) for t in item["prompt_ids"]])
            continue
        if tokenizer is None:
            raise ValueError(f"prompt {n} is text but no tokenizer is available; pass --tokenizer "
                             "or give prompt_ids")
        messages = item.get("messages", item.get("prompt")) if isinstance(item, dict) else None
        if isinstance(messages, list):  # chat messages ("prompt" holds them in verl's format)
            out.append(tokenizer.encode_chat(messages))
            continue
        text = item["prompt"] if isinstance(item, dict) and "prompt" in item else item
        if not isinstance(text, str):
            raise ValueError(f"prompt {n}: expected 'prompt', 'messages' or 'prompt_ids'")
        if chat:
            out.append(tokenizer.encode_chat([{"role": "user", "content": text}]))
        else:
            out.append(tokenizer.encode_prompt_texts([text])[0])
    return out


def read_ground_truths(path: str) -> list[tuple[Any, dict]]:
    """(ground truth, extra_info) of every row, for ``--reward``: ``reward_model.ground_truth``
    (verl's format) or a top-level ``ground_truth``."""
    out = []
    for n, item in enumerate(read_prompt_rows(path)):
        gt = None
        if isinstance(item, dict):
            gt = (item.get("reward_model") or {}).get("ground_truth", item.get("ground_truth"))
        if gt is None:
            raise ValueError(f"{path} row {n} has no reward_model.ground_truth (or ground_truth); --reward "
                             "scores every response against its row's ground truth")
        out.append((gt, item.get("extra_info") or {}))
    return out


def reward_scores(samples: Any, texts: list[str], truths: list[tuple[Any, dict]], reward: Any,
                  sources: Optional[list[str]] = None) -> list[float]:
    """The reward's (a :class:`~hyflow.rewards.manager.RewardManager`) score of each sample's decoded
    text against its prompt's ground truth; ``sources``: each prompt's data_source."""
    rows = [truths[s.request_index] for s in samples]
    return reward.score(texts, [sources[s.request_index] if sources else "unknown" for s in samples],
                        [gt for gt, _ in rows], [extra for _, extra in rows],
                        where=[f"prompt {s.request_index} sample {getattr(s, 'sample_index', 0)}"
                               for s in samples]).scores


def reward_manager(spec: str) -> Any:
    """The :class:`~hyflow.rewards.manager.RewardManager` of ``--reward`` (a rule or a function file)."""
    keys = reward_spec(spec)
    if keys["kind"] == "model":
        raise ValueError("--reward model:... needs the reward model's layout: score with `hyflow eval` instead")
    return RewardManager.from_config(SimpleNamespace(model_checkpoint=None, **keys))


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        _configs(args)
        if args.reward:
            reward_manager(args.reward)  # a bad rule or function file fails here, before any rank starts
    except ConfigError as e:
        print(f"hyflow: config error: {e}", file=sys.stderr)
        return 2
    except (ValueError, RewardError) as e:
        print(f"hyflow generate: --reward: {e}", file=sys.stderr)
        return 2
    if args.no_verify:
        os.environ[NO_VERIFY_ENV] = "1"  # the ranks inherit it
    world = args.tp * args.pp * args.dp
    if args.ckpt:
        try:  # one process verifies here, before anything starts; several ranks share the work later
            args.ckpt = resolve_model_dir(args.ckpt, verify=world == 1)
        except CheckpointError as e:
            print(f"hyflow generate: error: {e}", file=sys.stderr)
            return 2
    if min(args.tp, args.pp, args.dp) < 1:
        print("hyflow: --tp, --pp and --dp must be >= 1", file=sys.stderr)
        return 2
    if world > 1 and not launched_by_torchrun():
        return run_ranks_here("generate", world)
    init_distributed()
    try:
        if launched_by_torchrun() and os.environ.get(LOG_DIR_ENV):  # a rank: the launcher reports failures
            return run_reporting(lambda: _generate(args), dist.get_rank())
        return _generate(args)
    except (ValueError, OSError) as e:
        print(f"hyflow generate: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()


def resolve_model_dir(path: str, verify: bool = False) -> str:
    """``--ckpt``: a model checkpoint, or the actor of a run's newest complete step checkpoint
    (as ``hyflow export --ckpt``). Its files are present with their sizes; ``verify`` checks
    them against the manifest here (one process; with several ranks each checks a share
    before loading)."""
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from hyflow.checkpoint.model import read_checkpoint_info, verify_model_checkpoint

    def warn(message: str) -> None:
        print(f"hyflow generate: warning: {message}", file=sys.stderr, flush=True)

    model_dir = model_checkpoint_dir(path, warn=warn)
    read_checkpoint_info(model_dir)
    if verify:
        verify_model_checkpoint(model_dir, warn=warn)
        os.environ[NO_VERIFY_ENV] = "1"  # checked: the load below need not hash the files again
    return model_dir


def _generate(args: argparse.Namespace) -> int:
    # Megatron (seconds) only when this runs: `hyflow --help` imports this module
    from hyflow.parallel.groups import init_training_groups
    from hyflow.rollout.engine import GenerationEngine
    from hyflow.rollout.loading import load_checkpoint, load_hf, megatron_from_hf

    if dist.get_world_size() != args.tp * args.pp * args.dp:
        raise ValueError(f"{dist.get_world_size()} ranks running but --tp {args.tp} x --pp {args.pp} x "
                         f"--dp {args.dp} = {args.tp * args.pp * args.dp}")
    groups = init_training_groups(Layout(tp=args.tp, pp=args.pp, dp=args.dp))
    if args.ckpt:
        model, desc = load_checkpoint(args.ckpt, groups, dtype=args.dtype)
        spec = args.tokenizer or desc.tokenizer
    else:
        hf, _ = load_hf(args.hf, args.dtype or "fp32", tokenizer=False)
        model, desc = megatron_from_hf(hf, groups, dtype=args.dtype or "fp32")
        del hf
        spec = args.tokenizer or args.hf
    tokenizer = None
    if spec:
        try:
            tokenizer = load_tokenizer(spec)
        except TokenizerError as e:
            if args.tokenizer:  # asked for explicitly: a real error
                raise ValueError(str(e)) from None
            print(f"hyflow generate: no tokenizer ({e}); prompts must be token ids", file=sys.stderr)
    if args.multi_turn:
        if tokenizer is None:
            raise ValueError("--multi-turn renders chats and observations: it needs a tokenizer (--tokenizer)")
        # the agent's tools and environments (0.14 s): only with --multi-turn
        from hyflow.agent.cli import generate_multi_turn

        eos = list(dict.fromkeys(list(desc.eos_token_ids or []) + list(tokenizer.stop_token_ids())))
        engine = GenerationEngine(model, _configs(args), vocab_size=desc.vocab_size, eos_token_ids=eos,
                                  tp_group=groups.pgs.tp, max_position_embeddings=desc.context_length,
                                  pp_group=groups.pgs.pp)
        generate_multi_turn(args.multi_turn, args.prompts, engine, groups, tokenizer, args.n, args.seed,
                            reward_manager(args.reward) if args.reward else None, args.output, dist.get_rank())
        return 0
    prompts = read_prompts(args.prompts, tokenizer, args.chat)
    truths = read_ground_truths(args.prompts) if args.reward else None
    reward = reward_manager(args.reward) if args.reward else None
    if truths is not None and tokenizer is None:
        raise ValueError("--reward scores decoded text: it needs a tokenizer (--tokenizer)")
    eos = list(desc.eos_token_ids or [])
    if tokenizer is not None:
        eos = list(dict.fromkeys(eos + list(tokenizer.stop_token_ids())))
    engine = GenerationEngine(model, _configs(args), vocab_size=desc.vocab_size, eos_token_ids=eos,
                              tp_group=groups.pgs.tp, max_position_embeddings=desc.context_length,
                              pp_group=groups.pgs.pp)
    result = generate_data_parallel(engine, prompts, groups.pgs.dp, device=groups.device).to_result()
    if dist.get_rank() == 0:
        _report(result, prompts, tokenizer, args.output, truths, reward, _data_sources(args.prompts))
    return 0


def _data_sources(path: str) -> list[str]:
    return [str(r.get("data_source", "unknown")) if isinstance(r, dict) else "unknown"
            for r in read_prompt_rows(path)]


def _report(result: Any, prompts: list[list[int]], tokenizer: Any, output: Optional[str],
            truths: Optional[list[tuple[Any, dict]]] = None, reward: Any = None,
            sources: Optional[list[str]] = None) -> None:
    rows = []
    texts = [tokenizer.decode(s.token_ids) if tokenizer is not None else None for s in result.samples]
    scores = reward_scores(result.samples, texts, truths, reward, sources) if truths is not None else None
    for k, (s, text) in enumerate(zip(result.samples, texts)):
        prompt = tokenizer.decode(s.prompt_ids) if tokenizer is not None else None
        rows.append({"index": s.request_index, "sample": s.sample_index, "prompt": prompt, "response": text,
                     "token_ids": s.token_ids, "logprobs": [round(x, 6) for x in s.logprobs],
                     "finish_reason": s.finish_reason, "prompt_tokens": len(s.prompt_ids)})
        head = f"[{s.request_index}.{s.sample_index}] {s.finish_reason}, {len(s.token_ids)} tokens"
        if scores is not None:
            rows[-1]["score"] = scores[k]
            head += f", score {scores[k]:g}"
        print(head)
        print(text if text is not None else s.token_ids)
        print()
    st = result.stats
    print(f"{st.samples} samples, {st.generated_tokens} tokens in {st.seconds:.2f} s "
          f"({st.tokens_per_s:.1f} tokens/s)")
    if scores is not None:
        reasons = [s.finish_reason for s in result.samples]
        ended = ", ".join(f"{reasons.count(r)} {r}" for r in sorted(set(reasons)))
        print(f"{reward.name}: mean score {sum(scores) / len(scores):.4f} over {len(scores)} samples "
              f"of {len(prompts)} prompts (finish: {ended})")
    if output:
        with open(output, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
