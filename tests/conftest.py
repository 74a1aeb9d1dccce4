"""Shared pytest setup: markers, the ``gpu`` auto-skip and multi-rank pool shutdown.

Markers: ``gpu`` (needs CUDA; skipped when ``torch.cuda.is_available()`` is False), ``slow`` and
``multirank`` (runs on several gloo ranks through :mod:`hyflow.testing.multirank`).
"""
from __future__ import annotations

from typing import Iterator, List

import pytest

_MARKERS = {
    "gpu": "needs CUDA (skipped without it)",
    "slow": "long-running test",
    "multirank": "runs on several gloo ranks",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only paid for when a gpu test was collected

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_multirank_pools() -> Iterator[None]:
    """Stop the pooled multi-rank workers when the session ends (atexit is the backstop)."""
    yield
    from hyflow.testing import shutdown_pools

    shutdown_pools()
