"""``hyflow bench head``: the output layer + log-prob/entropy of an RL update, fused vs full logits.

One process, one thread (a rank's setting under ``hyflow launch``). A micro-batch of ``--rows``
sequences of ``--prompt`` + ``--response`` tokens with SmolLM2-135M's output layer (hidden 576,
vocabulary 49152, tied) by default; each repeat runs, back to back on the same tensors,

* **full**: ``logits = hidden @ W.T`` at every position, then the vocab-parallel log-softmax +
  gather and entropy of :mod:`hyflow.training.logprobs` (the path before the fused head);
* **fused**: :func:`hyflow.training.output_head.response_logprobs_entropy` (response positions
  only, chunked, recomputed in the backward),

forward + backward of ``sum(logp * w) + 0.01 * sum(entropy * w)``; reports the median CPU seconds
of each and the ratio over ``--repeats`` interleaved repeats, the largest single allocation
(the [rows, seq, vocab] float32 logits of the full path), and the largest difference of log-probs
and of the hidden-state gradient between the two. A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch (default: %(default)s)")
    parser.add_argument("--prompt", type=int, default=46, help="prompt tokens per row (default: %(default)s)")
    parser.add_argument("--response", type=int, default=33, help="response tokens per row (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu (CPU seconds) or cuda (wall seconds, synchronised; "
                        "bf16 weights and hidden states); default: %(default)s")


def run(args: argparse.Namespace) -> int:
    # torch and Megatron load only when the bench runs: `hyflow --help` imports this module
    import torch

    from hyflow.training.logprobs import block_shape, shifted_entropy, shifted_token_logprobs
    from hyflow.training.output_head import Hidden, response_logprobs_entropy

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    S = args.prompt + args.response
    hidden = torch.randn(args.rows, S, args.hidden, generator=g).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(device, dtype).requires_grad_(True)
    tokens = torch.randint(0, args.vocab, (args.rows, S), generator=g).to(device)
    mask = torch.zeros(args.rows, S, device=device)
    mask[:, args.prompt:] = 1.0
    w = mask / mask.sum()

    def full():
        h = hidden.clone().requires_grad_(True)
        logits = h @ weight.t()
        lp = shifted_token_logprobs(logits, tokens, args.vocab)
        ent = shifted_entropy(logits, args.vocab)
        ((lp * w).sum() + 0.01 * (ent * w).sum()).backward()
        return lp.detach(), h.grad

    def fused():
        h = hidden.clone().requires_grad_(True)
        lp, ent = response_logprobs_entropy(Hidden(h, weight), tokens, mask > 0, args.vocab)
        ((lp * w).sum() + 0.01 * (ent * w).sum()).backward()
        return lp.detach(), h.grad

    clock = time.perf_counter if cuda else time.process_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {"full": [], "fused": []}
    out = {}
    for repeat in range(args.repeats + cuda):  # on a GPU the first round (kernel loading) is not timed
        for name, fn in (("full", full), ("fused", fused)):
            weight.grad = None
            sync()
            start = clock()
            out[name] = fn()
            sync()
            if repeat or not cuda:
                times[name].append(clock() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    sel = mask > 0
    block = block_shape(weight.device, args.vocab)
    if not cuda:  # the keys of earlier CPU runs
        result_cpu = {"full_cpu_s": med["full"], "fused_cpu_s": med["fused"]}
    result = {
        "rows": args.rows, "prompt": args.prompt, "response": args.response, "hidden": args.hidden,
        "vocab": args.vocab, "threads": args.threads, "repeats": args.repeats,
        "device": device.type, "full_s": med["full"], "fused_s": med["fused"], "speedup": med["full"] / med["fused"],
        "full_logits_mib": args.rows * S * args.vocab * 4 / 2 ** 20,
        "fused_chunk_mib": min(args.rows * args.response, block[0]) * block[1] * 4 / 2 ** 20,
        "logp_max_diff": float((out["full"][0] - out["fused"][0])[sel].abs().max()),
        "grad_max_diff": float((out["full"][1] - out["fused"][1]).abs().max()),
    }
    if not cuda:
        result.update(result_cpu)
    print(f"bench head: {args.rows} rows x ({args.prompt} prompt + {args.response} response) tokens, "
          f"hidden {args.hidden}, vocab {args.vocab}, {args.threads} thread(s), median of {args.repeats}")
    unit = "s" if cuda else "CPU s"
    print(f"  full logits  {med['full']:8.3f} {unit}   [rows, seq, vocab] fp32 logits {result['full_logits_mib']:.0f} MiB")
    print(f"  fused head   {med['fused']:8.3f} {unit}   largest block of logits {result['fused_chunk_mib']:.1f} MiB")
    print(f"  speed-up x{result['speedup']:.2f}; max |diff| log-prob {result['logp_max_diff']:.1e}, "
          f"hidden grad {result['grad_max_diff']:.1e}")
    print(json.dumps(result))
    return 0
