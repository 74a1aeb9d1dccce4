"""``hyflow doctor``: one process (versions, environment) and under ``hyflow launch local``
(collective bandwidth over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hyflow.doctor import bandwidth as bw
from hyflow.doctor.env import relevant_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _json_tail(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_single_process_reports_versions_and_points_to_the_launcher():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    plain = subprocess.run([sys.executable, "-m", "hyflow.cli", "doctor"], capture_output=True,
                           text=True, timeout=120, cwd=REPO, env=env)
    assert plain.returncode == 0, plain.stderr
    assert "{" not in plain.stdout and "hyflow launch local doctor --nproc N" in plain.stdout  # a table only
    out = subprocess.run([sys.executable, "-m", "hyflow.cli", "doctor", "--json"], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 1
    report = _json_tail(out.stdout)
    assert report["world_size"] == 1 and report["bandwidth"] == [] and report["status"] == "pass"
    for key in ("torch", "megatron-core", "transformer-engine", "triton", "nccl", "cuda available"):
        assert key in report["versions"]
    assert "hyflow launch local doctor --nproc N" in out.stderr


@pytest.mark.multirank
def test_doctor_under_launch_local_measures_bandwidth_and_strict_fails_on_a_warning(tmp_path):
    # a CPU threshold far above anything gloo reaches: every check warns, --strict exits non-zero; run
    # from a directory of its own (its rank logs go to ./runs/doctor, never the tree's runs/)
    out = subprocess.run(
        [sys.executable, "-m", "hyflow.cli", "launch", "local", "doctor", "--nproc", "2", "--",
         os.path.join(REPO, "configs", "quickstart.yaml"), "--max-size", "4MB", "--iters", "2", "--warmup", "1",
         "--threshold", "cpu=1000", "--strict", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode != 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert report["world_size"] == 2 and report["backend"] == "gloo" and not report["errors"]
    rows = report["bandwidth"]
    assert {(r["op"], r["group"]) for r in rows} == {
        (op, g) for op in ("all_reduce", "all_gather") for g in ("world", "actor tp")}
    assert sorted({r["size"] for r in rows}) == [1 << 20, 4 << 20]
    assert all(r["busbw_gbps"] > 0 and r["seconds"] > 0 for r in rows)
    checked = [r for r in rows if r["status"] != "-"]
    assert len(checked) == 4 and all(r["size"] == 4 << 20 and r["status"] == "warn" for r in checked)
    assert report["status"] == "warn" and report["thresholds_gbps"]["cpu"] == 1000
    (pair,) = report["pairs"]
    assert pair["ranks"] == [0, 1] and pair["status"] == "warn" and pair["gbps"] > 0
    # the warnings name the rank pair and the measured figure
    measured = f"{pair['gbps']:.3g} GB/s"
    assert any(w.startswith("ranks 0<->1") and measured in w for w in report["warnings"])
    assert any("slowest rank pair 0<->1 at " + measured in w for w in report["warnings"])
    assert {v["name"] for v in report["nccl_env"]} >= {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_IB_DISABLE",
                                                         "NCCL_SOCKET_IFNAME"}
    for heading in ("Collective bandwidth", "busbw", "Rank pairs", "NCCL environment", "warning: ranks 0<->1"):
        assert heading in out.stderr


def test_nccl_environment_verdicts():
    from hyflow.doctor.env import nccl_env_verdicts

    def verdicts(env, **kw):
        return {v["name"]: v["status"] for v in nccl_env_verdicts(env, interfaces=["lo", "eth0", "ib0"], **kw)}

    assert verdicts({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "ok", "NCCL_IB_DISABLE": "ok",
                            "NCCL_SOCKET_IFNAME": "ok"}
    bad = {"NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "enp"}
    assert verdicts(bad, multi_node=True, on_gpu=True) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "warn", "NCCL_ASYNC_ERROR_HANDLING": "warn",
        "NCCL_IB_DISABLE": "warn", "NCCL_SOCKET_IFNAME": "warn"}
    assert verdicts({"NCCL_IB_DISABLE": "1"})["NCCL_IB_DISABLE"] == "info"  # one node: no effect
    assert verdicts({"NCCL_SOCKET_IFNAME": "eth"})["NCCL_SOCKET_IFNAME"] == "ok"
    assert verdicts({"NCCL_SOCKET_IFNAME": "^lo,eth"})["NCCL_SOCKET_IFNAME"] == "ok"  # ib0 is left
    assert verdicts({"NCCL_SOCKET_IFNAME": "=eth"})["NCCL_SOCKET_IFNAME"] == "warn"  # exact: no eth
    assert verdicts({}, multi_node=True)["NCCL_SOCKET_IFNAME"] == "info"


def test_ring_pairs_cover_every_neighbour_once_per_round():
    for world in range(2, 10):
        rounds = bw.ring_pairs(world)
        edges = {tuple(sorted(p)) for r in rounds for p in r}
        ring = {tuple(sorted((r, (r + 1) % world))) for r in range(world)}
        assert edges == ring, world
        for r in rounds:  # a rank is in at most one pair per round
            ranks = [x for p in r for x in p]
            assert len(ranks) == len(set(ranks))


def test_environment_filter_hides_secrets():
    env = {"NCCL_DEBUG": "INFO", "HF_TOKEN": "x", "NCCL_IB_KEY": "y", "RANK": "0", "HOME": "/root",
           "SLURM_JOB_ID": "7", "AWS_SECRET_ACCESS_KEY": "z", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert relevant_env(env) == {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO", "RANK": "0",
                                 "SLURM_JOB_ID": "7"}


def test_bandwidth_helpers():
    assert bw.default_sizes(on_gpu=True)[-1] == 1 << 30 and bw.default_sizes(on_gpu=True)[0] == 1 << 20
    assert bw.default_sizes(on_gpu=False)[-1] == 64 << 20
    assert bw.default_sizes(on_gpu=False, max_size=16 << 20) == [1 << 20, 4 << 20, 16 << 20]
    assert bw.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bw.bus_factor("all_gather", 8) == pytest.approx(0.875)
    intra, inter = bw.node_groups(["a", "a", "b", "b"])
    assert intra == [[0, 1], [2, 3]] and inter == [[0, 2], [1, 3]]
    assert bw.node_groups(["a", "a", "b"])[1] == []
