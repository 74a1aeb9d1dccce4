"""``hyflow bench async`` is registered and runs the config and warm-up it is given (the runs
themselves are the benchmark, not a test)."""
from __future__ import annotations

from hyflow.cli import build_parser
from hyflow.testing.rl import QUICKSTART as TESTING_QUICKSTART
from hyflow.tools.bench import async_modes


def test_bench_async_parses_and_builds_its_overrides():
    args = build_parser().parse_args(["bench", "async", "--config", "configs/async_length_tail.yaml",
                                      "--sft-warmup", "30", "--max-new", "60", "--n", "8"])
    assert args.benchmark == "async" and args.config == "configs/async_length_tail.yaml"
    overrides = async_modes._overrides(args, "/tmp/out")
    assert "actor.sft_warmup_steps=30" in overrides and "rollout.max_new_tokens=60" in overrides
    assert "actor.mini_batch_size=64" in overrides and "trainer.output_dir=/tmp/out" in overrides
    default = build_parser().parse_args(["bench", "async"])
    assert default.config == TESTING_QUICKSTART and "actor.sft_warmup_steps=0" in async_modes._overrides(default, "o")
