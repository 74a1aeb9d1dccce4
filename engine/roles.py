"""The RL step's collaborators as declared interfaces: the weight path, the rollouts, the critic.

:func:`hyflow.jobs.rl.rl_step` holds one object of each role (:class:`hyflow.rl.models.RLModels`)
and calls only what is declared here, so it never branches on which implementation it holds::

    role          colocated (one set of ranks)            placement pools
    ------------  --------------------------------------  -----------------------------------------
    WeightPath    hyflow.hybrid.executor.HybridEngine     hyflow.placement.pool_models.WeightSender
    Rollouts      hyflow.rl.dispatch.RolloutDispatcher    hyflow.placement.pool_models.RemoteRollouts
    Critic        hyflow.rl.critic.LocalCritic            hyflow.placement.remote_critic.RemoteCritic

What an implementation cannot do is a declared capability (:class:`WeightPathCapabilities`,
:class:`RolloutCapabilities`), known from the config alone (each implementation's classmethod
``capabilities_for(cfg)``), so a config that needs one its roles lack is refused before any rank
starts (:func:`hyflow.jobs.rl_preflight.check_role_capabilities`), never at step 1.

One step's use of the weight path and the rollouts, in order::

    weights.to_generation()            # the actor's weights into the generation layout
    rollouts.prepare_for_generation()  # the backend takes them (wakes its KV cache)
    rollouts.generate(...)             # this DP shard's samples (and rollouts.rescore in exact mode)
    rollouts.finish_generation()       # the backend gives its memory back
    weights.to_training()              # the training layout, optimizer state and gradients back

This module imports nothing at run time (types only): every layer may depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # annotations only: the protocols stay import-free
    import torch

    from hyflow.checkpoint.trained_model import TrainedModel
    from hyflow.rl.batch import MicroBatching, RolloutBatch
    from hyflow.rl.update import UpdateStats
    from hyflow.agent.agent import MultiTurnAgent
    from hyflow.rollout.config import SamplingConfig
    from hyflow.rollout.dp import GatheredRollout, SampleTensors


# --------------------------------------------------------------------------- the weight path


@dataclass(frozen=True)
class WeightPathCapabilities:
    """What a weight path can do, declared by its class for a config."""

    generation_model: bool
    """This rank holds the actor in a generation layout after :meth:`WeightPath.to_generation`
    (colocated); False where generation runs on other ranks (pools)."""
    exact_in_generation_layout: bool
    """A forward of that generation-layout model reproduces the training forward bit for bit
    (same TP, no sequence parallelism; :mod:`hyflow.rl.exact_logprobs`)."""
    stale_weights: bool
    """:meth:`WeightPath.generation_weights` gives the flat generation weights, which
    ``rollout.force_staleness`` swaps for older ones (:mod:`hyflow.rl.staleness`)."""


@runtime_checkable
class TransitionStats(Protocol):
    """What the last transition did on this rank (the step's ``reshard/*`` metrics)."""

    bytes_received: int
    seconds: float


@runtime_checkable
class WeightPath(Protocol):
    """Moves the actor's weights from training to generation and back.

    Contract: :meth:`to_generation` and :meth:`to_training` are collective over the ranks that
    hold the actor (every rank of the training layout calls them, in the same order); after
    :meth:`to_training` the training weights are bit-identical to before :meth:`to_generation`
    and the optimizer state and gradient buffers are back. Both are idempotent.
    """

    capabilities: WeightPathCapabilities
    stats: TransitionStats

    def to_generation(self) -> object:
        """The actor's current weights into the generation layout (colocated: in memory on the
        same ranks; the return value is the implementation's, the step does not use it)."""
        ...

    def to_training(self) -> None:
        """Back to the training layout: training weights, gradient buffers and optimizer state."""
        ...

    def generation_weights(self) -> Optional[torch.Tensor]:
        """The flat tensor the generation model's parameters are views of, between
        :meth:`to_generation` and :meth:`to_training`; None where ``capabilities.stale_weights``
        is False."""
        ...

    def describe(self) -> str:
        """One line for the run's start: the layouts and what moves between them."""
        ...


# --------------------------------------------------------------------------- the rollouts


@dataclass(frozen=True)
class RolloutCapabilities:
    """What a rollouts backend can do, declared by its class for a config."""

    greedy: bool
    """Greedy (argmax) responses besides the sampled ones: ReMax's baselines."""
    exact_rescore: bool
    """:meth:`Rollouts.rescore` reproduces the training forward's log-probs bit for bit while in
    generation (the generation model is the training ``GPTModel`` in a layout that sums in the
    same order)."""
    current_weights: bool
    """It samples with the weights the update starts from (staleness 0), so re-scoring its samples
    in the training layout after :meth:`WeightPath.to_training` gives exactly the behaviour
    policy's log-probs (exact mode without :attr:`exact_rescore`)."""
    multi_turn: bool = False
    """:meth:`Rollouts.generate_trajectories`: multi-turn trajectories, its replicas' turns
    interleaved with tool calls and environment steps (``rollout.multi_turn``, :mod:`hyflow.agent`)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (``algorithm.dynamic_sampling``): more rounds generated on demand
    while a step's batch lacks groups with reward variance (:mod:`hyflow.rl.dynamic_sampling`), or
    groups without it filtered where they are generated (``trainer.mode=async``,
    :mod:`hyflow.jobs.async_filter`)."""

    @property
    def exact_logprobs(self) -> bool:
        """``rollout.exact_logprobs`` can be honoured, one way or the other."""
        return self.exact_rescore or self.current_weights


@runtime_checkable
class Rollouts(Protocol):
    """Generates (or receives) a training data-parallel rank's samples: the generation backend.

    Contract: every rank of one training DP rank's model-parallel group calls :meth:`generate`
    with the same prompts and gets the same samples; nothing crosses DP ranks. Sample ``j`` of
    global prompt ``i`` draws from a random stream keyed by ``(seed, i, j)``, so samples do not
    depend on the layouts. The backend holds what it generates with (the generation model of the
    weight path it was built on, or its own engine); the step never hands a model over.
    """

    capabilities: RolloutCapabilities

    def shard(self, count: int) -> tuple[int, int]:
        """``[first, stop)``: this rank's prompts of a step of ``count`` prompts (its training DP
        rank's contiguous share)."""
        ...

    def prepare_for_generation(self) -> None:
        """After :meth:`WeightPath.to_generation`: take the new weights (hyflow's engine reads the
        weight path's generation model in place; an external engine loads them and wakes its KV
        cache)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, seed: int, request_offset: int,
                 greedy: bool = False, max_new_tokens: Optional[int] = None,
                 sampling: Optional[SamplingConfig] = None) -> GatheredRollout:
        """``n`` samples of each of this DP shard's ``prompts`` (global prompt indices from
        ``request_offset``; ``seed``: the step's base seed), in (prompt, sample) order: token ids,
        sampled-token log-probs, finish reasons (:class:`~hyflow.rollout.dp.SampleTensors`).
        ``greedy``: argmax decoding (needs ``capabilities.greedy``); ``max_new_tokens``: overrides
        the configured length; ``sampling``: another phase's sampling (validation's
        ``rollout.val_kwargs``: temperature, top-k, top-p) instead of the rollout's."""
        ...

    def generate_trajectories(self, agent: MultiTurnAgent, records: Sequence, n: int, *, seed: int,
                              request_offset: int, sampling: Optional[SamplingConfig] = None) -> SampleTensors:
        """``n`` multi-turn trajectories of each of this DP shard's ``records`` (prompt rows,
        global indices from ``request_offset``), in (prompt, sample) order: the ``agent``'s loop on
        each replica with its tools and environments, assistant turns masked in, observations
        masked out (``SampleTensors.mask``), with the trajectories' counters (``.stats``).
        ``sampling``: another phase's sampling (validation's), as in :meth:`generate`. Only with
        ``capabilities.multi_turn``."""
        ...

    def rescore(self, batch: RolloutBatch, batching: MicroBatching, *, temperature: float, fused: bool,
                train_mode: bool) -> torch.Tensor:
        """``[B, S]`` log-probs of ``batch``'s response tokens computed as the training forward
        computes them (its ``batching`` micro-batches, its scorer), while in generation; 0
        outside responses. Only with ``capabilities.exact_rescore``."""
        ...

    def finish_generation(self) -> None:
        """Before :meth:`WeightPath.to_training`: give back what generation holds (an external
        engine's KV cache and weights: sleep mode)."""
        ...


# --------------------------------------------------------------------------- the critic


@runtime_checkable
class Critic(Protocol):
    """The value model's two parts of a step: values (phase 3) and its update (phase 5).

    Contract: both are called by every rank of the training layout with this rank's rows (the
    batch's ``tokens`` and ``response_mask`` columns, ``[B, S]``) and return this rank's answer;
    a critic on a pool of its own exchanges the rows with its pool point to point.
    """

    @property
    def model(self) -> Optional[TrainedModel]:
        """The critic's model with its optimizer when this rank holds it (checkpointed with the
        actor); None when it lives on a pool of its own."""
        ...

    def values(self, columns: dict, lengths: Sequence[int], shape: tuple[int, int]) -> torch.Tensor:
        """``[B, S]`` float32 values of these rows (forward only)."""
        ...

    def update(self, columns: dict, lengths: Sequence[int], *, seed: int, step: int, row_offset: int,
               agg_mode: str, norm_length: float) -> UpdateStats:
        """One update over these rows (``columns`` adds ``old_values`` and ``returns``): the
        critic's mini-batches and epochs; returns its statistics."""
        ...


# --------------------------------------------------------------------------- a streaming generation run


@runtime_checkable
class GenerationRun(Protocol):
    """What a streaming generation run (``engine.stream(feed, ...)``, ``trainer.mode: async``)
    shows its ``feed(run)`` and token-boundary ``on_decode(run)`` callbacks, whichever backend runs
    it: :class:`hyflow.rollout.scheduler.Scheduler` (hyflow's engine) and
    :class:`hyflow.vllm_backend.stream.VLLMStream` (vLLM). :mod:`hyflow.jobs.fully_async` uses only
    these, so it never branches on the backend.

    Contract: a sequence holds a slot from its admission until it finishes; ``feed`` is asked
    whenever slots are free that the queue cannot fill and when nothing runs; ``on_decode`` runs
    after every step that drew tokens and returns the new weight version when it loaded new weights
    (the run then calls :meth:`new_weights` itself)."""

    @property
    def running(self) -> int:
        """Sequences holding a slot (decoding) now."""
        ...

    @property
    def queued(self) -> int:
        """Sequences given to the run and waiting for a slot."""
        ...

    @property
    def free_slots(self) -> int:
        """Slots no sequence holds."""
        ...

    def cancel(self, outs: list) -> None:
        """Stop the sequences whose ``out`` is in ``outs`` (running or queued) and free their slots;
        their outputs stay as they are (a feeder that no longer needs them)."""
        ...

    def new_weights(self, version: int) -> None:
        """The model holds weight version ``version`` from this token boundary on: every later
        token records it; the running samples continue with their state recomputed with the new
        weights, or restart (``trainer.partial_rollout``)."""
        ...
