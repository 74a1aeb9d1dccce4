"""The colocated rollouts on vLLM (``rollout.backend: vllm``): :class:`hyflow.roles.Rollouts`.

The hybrid engine stays the weight path: every step it reshards the actor into the generation
layout (its Megatron generation model, views of the generation buffer), then
:meth:`VLLMRollouts.prepare_for_generation` writes those shards into vLLM's model in memory
(:mod:`hyflow.vllm_backend.weights`, vLLM's own loaders). The data plane is the dispatcher's: a
training DP rank's prompts are split over its micro-DP replicas, each replica (its TP_g ranks)
runs one vLLM instance, and the samples are gathered back over the micro-DP group. Exact mode
re-scores with the generation-layout Megatron model exactly as the hyflow backend does.
"""

from __future__ import annotations

import dataclasses

from typing import Sequence

from hyflow.hybrid.generation_groups import generation_enumerations
from hyflow.rl.dispatch import RolloutDispatcher
from hyflow.roles import RolloutCapabilities
from hyflow.rollout.config import GenerationConfig
from hyflow.vllm_backend.config import VLLMConfig
from hyflow.vllm_backend.engine import VLLMEngine
from hyflow.vllm_backend.weights import vllm_weights


class VLLMRollouts(RolloutDispatcher):
    """The dispatcher's data plane over vLLM engines, one per generation replica (built by every
    rank: vLLM creates its process groups)."""

    @classmethod
    def capabilities_for(cls, cfg) -> RolloutCapabilities:
        """As the hyflow backend: greedy baselines, exact re-scores through the same generation-layout
        model, current weights (a forced-stale sampler's older weights are what vLLM loads); not
        multi-turn trajectories yet (vLLM's batch call has no per-turn hook for tool calls, untested)."""
        return dataclasses.replace(RolloutDispatcher.capabilities_for(cfg), multi_turn=False)

    def __init__(self, hybrid, train_groups, rollout_config: GenerationConfig, desc, vocab_size: int,
                 eos_token_ids: Sequence[int], *, options: VLLMConfig, dtype: str, seed: int,
                 current_weights: bool = True) -> None:
        super().__init__(hybrid, train_groups, rollout_config, desc, vocab_size, eos_token_ids,
                         current_weights=current_weights)
        self.capabilities = dataclasses.replace(self.capabilities, multi_turn=False)
        budget = None
        if rollout_config.max_prompt_length:
            budget = rollout_config.max_prompt_length + rollout_config.sampling.max_new_tokens
        self._vllm = VLLMEngine(desc, rollout_config, options, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
                                tp_groups=generation_enumerations(hybrid.plan)["tp"],
                                dtype=dtype, seed=seed, device=train_groups.device,
                                seq_budget=budget)

    @classmethod
    def from_config(cls, cfg, hybrid, train_groups, rollout_config: GenerationConfig, desc, vocab_size: int,
                    eos_token_ids: Sequence[int]) -> "VLLMRollouts":
        return cls(hybrid, train_groups, rollout_config, desc, vocab_size, eos_token_ids, options=cfg.rollout.vllm,
                   dtype=cfg.actor.dtype, seed=cfg.trainer.seed, current_weights=not cfg.rollout.force_staleness)

    @property
    def engine(self):
        """This replica's vLLM engine (:func:`hyflow.rollout.dp.generate_data_parallel` calls it)."""
        return self._vllm

    @property
    def load_seconds(self) -> float:
        """Seconds the last weight load into vLLM took (the second half of a transition)."""
        return self._vllm.last_load_seconds

    def prepare_for_generation(self) -> None:
        """The weight path's generation-layout shards into vLLM (after ``to_generation``)."""
        self._vllm.load_weights(vllm_weights(self.hybrid.gen_model, self.desc, self.vocab_size,
                                             self.hybrid.gen_groups.pgs.tp))

    def finish_generation(self) -> None:
        """GPU: vLLM's sleep mode frees its KV cache and weights until the next generation."""
        self._vllm.sleep()
