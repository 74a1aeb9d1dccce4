"""``hyflow bench micro-batches``: padding and update time of a mixed-length RL batch, cut four ways.

One rank, one model, one batch of rows whose prompt and response lengths are drawn uniformly
(default prompts 10-200 tokens, responses 1-128, the RL job's shape), one actor update
(forward + backward of the PPO loss over every row, no optimizer step) per method:

* ``step-max`` (before): fixed micro-batches, every row padded to the step's longest row (hyflow
  before token budgets: one ``[b, s]`` shape for the whole step);
* ``in-order``: fixed micro-batches of rows in batch order, each padded to its own longest row;
* ``fixed``: fixed micro-batches of rows of similar length (what ``actor.micro_batch_size`` does),
  each padded to its own longest row;
* ``token-budget``: rows grouped by length under ``--max-tokens`` (``actor.max_tokens_per_micro_batch``);
* ``packed``: sequences concatenated up to ``--max-tokens`` per row (``actor.pack_sequences``).

Reports the padding ratio (padding / processed tokens) and the median update time over
``--repeats`` runs; prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from hyflow.models.description import tiny_llama
from hyflow.parallel.layout import Layout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=64, help="rows in the batch (default 64)")
    parser.add_argument("--prompt", default="10-200", help="prompt length range MIN-MAX (default 10-200)")
    parser.add_argument("--response", default="1-128", help="response length range MIN-MAX (default 1-128)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per fixed micro-batch (default 8)")
    parser.add_argument("--max-tokens", type=int, default=2048,
                        help="token budget of a micro-batch for token-budget and packed (default 2048)")
    parser.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="model hidden size (default 256)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per method (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and tokens (default 0)")


def _range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split("-"))
    return low, high


def run(args: argparse.Namespace) -> int:
    # torch and Megatron load only when the bench runs: `hyflow --help` imports this module
    import torch

    from hyflow.models.builder import build_gpt_model
    from hyflow.models.weights import load_full_state_dict, random_full_state_dict
    from hyflow.parallel.distributed import init_distributed, shutdown
    from hyflow.parallel.groups import init_training_groups
    from hyflow.rl.batch import MicroBatching, make_micro_batches, plan_fixed
    from hyflow.rl.step_losses import PolicyLoss, loss_weights
    from hyflow.training.optimizer import wrap_ddp
    from hyflow.training.step import forward_backward

    if args.threads:
        torch.set_num_threads(args.threads)
    init_distributed()
    groups = init_training_groups(Layout(), seed=1)
    gen = torch.Generator().manual_seed(args.seed)
    (p_lo, p_hi), (r_lo, r_hi) = _range(args.prompt), _range(args.response)
    prompts = torch.randint(p_lo, p_hi + 1, (args.rows,), generator=gen).tolist()
    responses = torch.randint(r_lo, r_hi + 1, (args.rows,), generator=gen).tolist()
    lengths = [p + r for p, r in zip(prompts, responses)]
    S = max(lengths)
    desc = tiny_llama(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_attention_heads=max(4, args.hidden // 64), num_query_groups=max(2, args.hidden // 128),
                      ffn_hidden_size=4 * args.hidden, max_position_embeddings=max(512, S))
    model = build_gpt_model(desc, groups, config_overrides={"perform_initialization": False})
    load_full_state_dict(model, random_full_state_dict(desc, seed=1), desc, groups)
    chunks = wrap_ddp([model], groups, distributed_optimizer=False)
    tokens = torch.randint(0, args.vocab, (args.rows, S), generator=gen)
    mask = torch.zeros(args.rows, S)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        mask[i, p:n] = 1.0
        tokens[i, n:] = 0
    cols = {"tokens": tokens, "response_mask": mask, "old_logp": -torch.rand(args.rows, S, generator=gen),
            "advantages": torch.randn(args.rows, S, generator=gen)}
    cols["loss_weight"] = cols["token_weight"] = loss_weights(mask, "token-mean", mask.sum(), (mask.sum(-1) > 0).sum())
    cfg = argparse.Namespace(policy_loss="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None, entropy_coeff=0.0,
                             use_kl_loss=False)
    loss_fn = PolicyLoss(cfg, args.vocab, groups.pgs.tp)
    methods = {
        "step-max": (plan_fixed(args.rows, args.micro_batch_size), False, [S] * args.rows),
        "in-order": (plan_fixed(args.rows, args.micro_batch_size), False, lengths),
        "fixed": (MicroBatching(args.micro_batch_size).plan(lengths), False, lengths),
        "token-budget": (MicroBatching(args.micro_batch_size, args.max_tokens).plan(lengths), False, lengths),
        "packed": (MicroBatching(args.micro_batch_size, args.max_tokens, True).plan(lengths), True, lengths),
    }
    real = sum(lengths)
    result: dict = {"rows": args.rows, "real_tokens": real, "max_tokens": args.max_tokens,
                    "micro_batch_size": args.micro_batch_size, "threads": torch.get_num_threads()}
    table = []
    for name, (plan, packed, widths) in methods.items():
        micro = make_micro_batches(cols, widths, plan, packed=packed)
        processed = sum(mb["tokens"].numel() for mb in micro)
        times = []
        for _ in range(args.repeats + 1):  # the first run warms up
            chunks[0].zero_grad_buffer()
            start = time.perf_counter()
            forward_backward(chunks, micro, loss_fn=loss_fn, with_labels=False)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        ratio = (processed - real) / processed
        result[name] = {"micro_batches": len(micro), "processed_tokens": processed, "padding_ratio": ratio,
                        "update_s": seconds}
        table.append((name, len(micro), processed, ratio, seconds))
    base = result["step-max"]
    for name in ("in-order", "fixed", "token-budget", "packed"):
        padding = result[name]["padding_ratio"]  # no padding left: the drop is unbounded (null)
        result[name]["padding_drop"] = base["padding_ratio"] / padding if padding else None
        result[name]["speedup"] = base["update_s"] / result[name]["update_s"]
    print(f"micro-batches: {args.rows} rows, prompts {args.prompt} + responses {args.response} tokens "
          f"({real} real tokens), model {args.layers}x{args.hidden}, vocab {args.vocab}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'method':14s} {'micro-batches':>13s} {'processed':>10s} {'padding':>8s} {'update s':>9s} {'speedup':>8s}")
    for name, count, processed, ratio, seconds in table:
        print(f"{name:14s} {count:13d} {processed:10d} {ratio:8.1%} {seconds:9.3f} "
              f"{base['update_s'] / seconds:7.2f}x")
    print(json.dumps(result))
    shutdown()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="hyflow bench micro-batches")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
