"""``make wheelhouse`` / ``make gpu-check`` (tools/gpu_check.py), the parts that need no GPU: the wheel
list, the download command, the check runner's per-check timeout, skips and JSON lines."""

import json
import os
import sys

import pytest

from hyflow.tools import gpu_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheelhouse_covers_what_hyflow_needs_beyond_a_pytorch_image():
    import importlib.metadata as md
    import re

    names = {re.split(r"[<>=!;\[ ]", w)[0].lower().replace("_", "-") for w in gpu_check.wheel_requirements("3.12")}
    setup = open(os.path.join(REPO, "setup.py")).read()
    required = re.search(r"install_requires=\[(.*?)\]", setup, re.S).group(1)
    image = {"torch", "numpy", "pyyaml", "safetensors"}  # a CUDA PyTorch image with transformers
    for req in re.findall(r'"([A-Za-z0-9_.-]+)', required):
        assert req.lower() in names | image | set(gpu_check.LAZY_REQUIREMENTS), req
    with open(os.path.join(REPO, gpu_check.QWEN_CONFIG)) as f:
        assert "${" not in f.read()  # so omegaconf is never imported on the node
    for dist in ("pytest", "megatron-core"):  # and their own requirements, but torch & numpy
        for req in md.requires(dist) or []:
            if "extra ==" in req or "sys_platform" in req or "python_version" in req:
                continue
            name = re.split(r"[<>=!~;\[ ]", req)[0].lower()
            assert name in names | image, (dist, req)
    assert "setuptools" in names  # the editable install without build isolation
    assert {"exceptiongroup", "tomli"} <= set(gpu_check.wheel_requirements("3.10"))
    assert "tomli" not in gpu_check.wheel_requirements("3.12")


def test_the_download_names_the_python_and_manylinux_2_28():
    cmd = gpu_check.download_command("3.12", "wh", python="py")
    assert cmd[:4] == ["py", "-m", "pip", "download"]
    for flag, value in (("--python-version", "3.12"), ("--platform", "manylinux_2_28_x86_64"), ("--dest", "wh")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd  # never torch, never a source build
    assert "megatron-core==0.16.1" in cmd


def test_a_wheelhouse_for_another_python_is_refused(tmp_path):
    assert "make wheelhouse" in gpu_check.check_wheelhouse(str(tmp_path))
    (tmp_path / "PYTHON_VERSION").write_text("2.7\n")
    assert "PYVER=" in gpu_check.check_wheelhouse(str(tmp_path))
    (tmp_path / "PYTHON_VERSION").write_text(f"{sys.version_info.major}.{sys.version_info.minor}\n")
    assert gpu_check.check_wheelhouse(str(tmp_path)) is None


def _py(code):
    return [sys.executable, "-c", code]


def test_checks_time_out_skip_and_write_one_json_line_each(tmp_path):
    log = tmp_path / "checks.jsonl"
    checks = [
        gpu_check.Check("quick", _py("import json; print(json.dumps({'tokens_per_s': 5.0}))"),
                        parse=lambda out: {"tok_s": gpu_check.last_json(out)["tokens_per_s"]}),
        gpu_check.Check("hangs", _py("import time; time.sleep(60)"), timeout=1.5),
        gpu_check.Check("fails", _py("import sys; print('boom'); sys.exit(3)")),
        gpu_check.Check("no figures", _py("print('no json')"), parse=gpu_check.last_json),
        gpu_check.Check("two gpus", _py("print(1)"), gpus=2),
    ]
    lines = []
    outcomes = gpu_check.run_checks(checks, gpus=1, log_path=str(log), echo=lines.append, logs_dir=str(tmp_path))
    assert [o.status for o in outcomes] == ["ok", "timeout", "failed", "failed", "skipped"]
    assert outcomes[0].figures == {"tok_s": 5.0}
    assert outcomes[1].seconds < 10  # killed at its own timeout, not the 60 s sleep
    assert "exit 3: boom" in outcomes[2].detail
    assert "needs 2 GPUs" in outcomes[4].detail
    assert len(lines) == 5 and lines[0].startswith("gpu-check: quick: ok")  # one line per check
    records = [json.loads(r) for r in log.read_text().splitlines()]
    assert [r["check"] for r in records] == [c.name for c in checks] and records[0]["tok_s"] == 5.0


def test_without_cuda_every_gpu_check_is_skipped(tmp_path):
    log = tmp_path / "checks.jsonl"
    outcomes = gpu_check.run_checks(gpu_check.checks(0), gpus=0, log_path=str(log), echo=lambda s: None)
    assert outcomes and all(o.status == "skipped" and o.detail.startswith("no CUDA device") for o in outcomes)
    names = [o.name for o in outcomes]
    assert "quickstart bf16 1 GPU" in names and "grpo qwen2.5-0.5b arch" in names
    pools = outcomes[names.index("one_step_off pools 2+2 (NCCL)")]  # what needs 4 GPUs: named, with its command
    assert "on 4+ GPUs: hyflow train configs/quickstart.yaml trainer.nproc=4 trainer.mode=one_step_off" in pools.detail
    quickstarts = [c for c in gpu_check.checks(1) if "configs/quickstart.yaml" in c.argv and c.gpus == 1]
    assert len(quickstarts) == 1  # one quickstart, not two (the GPU tests deselect theirs)
    assert "not quickstart_steps_on_one_gpu" in gpu_check.checks(1)[0].argv
    assert all(c.timeout <= gpu_check.CHECK_TIMEOUT_S for c in gpu_check.checks(8))


def test_the_budget_skips_what_no_longer_fits(tmp_path):
    checks = [gpu_check.Check("first", _py("import time; time.sleep(6)")), gpu_check.Check("second", _py("print(1)"))]
    outcomes = gpu_check.run_checks(checks, gpus=1, log_path=str(tmp_path / "l"), budget=15, echo=lambda s: None,
                                    logs_dir=str(tmp_path))
    assert [o.status for o in outcomes] == ["ok", "skipped"] and "budget" in outcomes[1].detail


def test_decode_roofline_from_the_rollout_bench_line():
    out = json.dumps({"tokens_per_s": 2000.0, "batch": 64, "param_bytes": 988e6})
    figures = gpu_check._rollout_figures("NVIDIA H100 80GB HBM3")(out)
    assert figures["roofline_tok_s"] == round(64 * 3.35e12 / 988e6)
    assert figures["of_roofline"] == pytest.approx(2000.0 / (64 * 3.35e12 / 988e6), abs=1e-4)
    assert gpu_check.hbm_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_check.hbm_bytes_per_s("NVIDIA H200") == 4.8e12
