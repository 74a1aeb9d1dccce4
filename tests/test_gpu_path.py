"""The RL job on real GPUs (skipped without CUDA; ``make gpu-check`` runs them first).

On CPU the device-discipline tests (``test_device_discipline.py``) hold the GPU path; here the same
steps run on CUDA with NCCL: a GRPO quickstart with the hybrid engine in bf16 on one GPU and, where
there are two, at TP=2 over NCCL.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp_path, gpus, *overrides):
    out = tmp_path / f"gpus{gpus}"
    proc = subprocess.run([sys.executable, "-m", "hyflow.cli", "train", "configs/quickstart.yaml",
                           f"trainer.nproc={gpus}", "trainer.total_steps=2", "actor.sft_warmup_steps=3",
                           "actor.dtype=bf16", f"trainer.output_dir={out}", "trainer.resume=never", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    assert len(rows) == 2
    for row in rows:
        assert row["actor/grad_norm"] is not None and row["actor/grad_norm"] > 0
        assert row["reshard/bytes_received"] >= 0 and row["timing_s/gen"] > 0
    return rows


def test_quickstart_steps_on_one_gpu(tmp_path):
    _train(tmp_path, 1, "actor.layout.tp=1")


def test_quickstart_steps_on_two_gpus_with_nccl(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    rows = _train(tmp_path, 2, "actor.layout.tp=2")
    assert rows[0]["reshard/bytes_received"] > 0  # TP=2 -> TP_g=1 moved weights over NCCL
