"""Rollout engine: KV-cache batched generation on the actor's Megatron model.

* :mod:`~hyflow.rollout.config`: :class:`SamplingConfig`, :class:`GenerationConfig`;
* :mod:`~hyflow.rollout.engine`: :class:`GenerationEngine` (one replica);
* :mod:`~hyflow.rollout.dp`: :func:`generate_data_parallel` (micro-DP split / gather);
* :mod:`~hyflow.rollout.kv_cache`, :mod:`~hyflow.rollout.runner`,
  :mod:`~hyflow.rollout.sampler`, :mod:`~hyflow.rollout.scheduler`: the parts.

Only the config and request types are imported eagerly (no torch); the engine
classes load on first access.
"""

from hyflow.rollout.config import GenerationConfig, SamplingConfig

import importlib

_LAZY = {
    "GenerationEngine": "hyflow.rollout.engine",
    "PromptTooLongError": "hyflow.rollout.engine",
    "GenerationRequest": "hyflow.rollout.request",
    "SampleOutput": "hyflow.rollout.request",
    "RolloutResult": "hyflow.rollout.request",
    "RolloutStats": "hyflow.rollout.request",
    "generate_data_parallel": "hyflow.rollout.dp",
    "GenerationLayoutError": "hyflow.rollout.runner",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hyflow.rollout' has no attribute {name!r}")


__all__ = ["GenerationConfig", "SamplingConfig", *_LAZY]
