"""Test utilities: run functions on several CPU ranks (gloo) from pytest.

See :mod:`hyflow.testing.multirank` for the worker-pool design and what is reset between tasks.
"""
from hyflow.testing.multirank import (
    MultiRankError,
    default_timeout,
    run_on_ranks,
    run_on_ranks_fresh,
    shutdown_pools,
)

__all__ = ["MultiRankError", "default_timeout", "run_on_ranks", "run_on_ranks_fresh", "shutdown_pools"]
