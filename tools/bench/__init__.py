"""``hyflow bench NAME``: benchmarks of hyflow's components.

Each benchmark is a module with light top-level imports that defines
``add_arguments(parser)`` and ``run(args) -> int``; list it in :data:`BENCHMARKS`
(name -> (module, help)) to make it a ``hyflow bench`` subcommand. Every
benchmark prints a human-readable table and, last, one JSON line with its numbers.
"""

from __future__ import annotations

import argparse
import importlib

from hyflow.cli_support import make_intermixed

#: name -> (module, one-line help). Add an entry to register a new benchmark.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "rollout": ("hyflow.tools.bench.rollout",
                "generation tokens/s of the rollout engine vs transformers generate"),
    "reshard": ("hyflow.tools.bench.reshard",
                "hybrid engine train<->generation transition vs swap_model_weights, ckpt, all-gather"),
    "micro-batches": ("hyflow.tools.bench.micro_batches",
                      "padding and update time of a mixed-length batch: step-max, fixed, token budget, packed"),
    "rl": ("hyflow.tools.bench.rl",
           "an RL job's step: seconds and share per phase, tokens/s, MFU, communication, peak memory"),
    "head": ("hyflow.tools.bench.head",
             "output layer + log-prob/entropy of an update micro-batch: fused response-only head vs full logits"),
    "scaling": ("hyflow.tools.bench.scaling",
                "strong or weak scaling efficiency of an RL job over several world sizes"),
    "manifest": ("hyflow.tools.bench.manifest",
                 "cost of checkpoint checksums: writing and verifying manifest.json"),
    "exact-logprobs": ("hyflow.tools.bench.exact_logprobs",
                       "exact mode: generation tokens/s with and without the re-score, log-prob gap reached"),
    "moe-replay": ("hyflow.tools.bench.moe_replay",
                   "routing replay: the trainer's log-probs against the sampler's with and without it (MoE)"),
    "longctx": ("hyflow.tools.bench.longctx",
                "long context: chunked prefill memory, recompute plan vs measured, CP=2 vs CP=1"),
    "async": ("hyflow.tools.bench.async_modes",
              "samples/s and pool utilisation of trainer.mode sync vs one_step_off vs async on long-tail lengths"),
}


def _run(module: str, args: argparse.Namespace) -> int:
    return importlib.import_module(module).run(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` and one sub-subcommand per entry of :data:`BENCHMARKS`."""
    parser = subparsers.add_parser("bench", help="benchmarks (" + ", ".join(BENCHMARKS) + ")")
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        module_doc = importlib.import_module(module).__doc__ or help_text
        bench = sub.add_parser(name, help=help_text, description=module_doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        importlib.import_module(module).add_arguments(bench)
        if getattr(importlib.import_module(module), "INTERMIXED", False):  # overrides after options
            make_intermixed(bench)
        bench.set_defaults(func=lambda args, _m=module: _run(_m, args))
    parser.set_defaults(func=lambda args: (parser.print_help(), 0)[1])
