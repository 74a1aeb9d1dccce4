"""``hyflow bench micro-batches`` prints a table then one JSON line whose numbers add up."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_micro_batches_reports_padding_and_time():
    proc = subprocess.run([sys.executable, "-m", "hyflow.cli", "bench", "micro-batches", "--rows", "12",
                           "--layers", "1", "--hidden", "64", "--vocab", "256", "--repeats", "1",
                           "--max-tokens", "512", "--threads", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[1].split()[:2] == ["method", "micro-batches"]
    result = json.loads(lines[-1])
    real = result["real_tokens"]
    for name in ("step-max", "in-order", "fixed", "token-budget", "packed"):
        row = result[name]
        assert row["processed_tokens"] >= real and row["update_s"] > 0
        assert abs(row["padding_ratio"] - (row["processed_tokens"] - real) / row["processed_tokens"]) < 1e-9
    # every cut pads less than padding the whole step to its longest row; packing pads least
    assert result["packed"]["padding_ratio"] < result["token-budget"]["padding_ratio"] \
        <= result["fixed"]["padding_ratio"] <= result["in-order"]["padding_ratio"] < result["step-max"]["padding_ratio"]
    # grouping rows of similar length keeps the micro-batch count of rows in order
    assert result["fixed"]["micro_batches"] == result["in-order"]["micro_batches"]
