"""The RL step's data plane: which rank holds which prompts and samples.

Data moves only where the layout needs it (the data half of the hybrid engine):

1. **Prompts by training DP rank.** The step's prompts are split over the training data-parallel
   ranks, prompt-granular and contiguous: DP rank ``d`` of ``DP`` holds prompts
   ``[d * P/DP, (d + 1) * P/DP)``, all ``n`` samples of each (GRPO / RLOO group statistics stay
   local). Every rank of the model-parallel group of ``d`` (its TP x PP ranks) holds the same shard.
2. **Samples inside the micro-DP group.** In the generation layout those TP x PP ranks form
   ``TP*PP / (TP_g*PP_g)`` replicas (micro-DP). Each replica generates its share of the shard; the
   results are all-gathered, as tensors, over the micro-DP group only
   (:func:`hyflow.rollout.dp.generate_data_parallel`). Afterwards every rank holds exactly its DP
   shard's samples in (prompt, sample) order.

Nothing here crosses data-parallel ranks: at 1024 ranks (TP8 x PP4 x DP32) a rank receives only its
1/32 of the samples, from the 32 / (TP_g*PP_g) replicas that share its prompts. Seeds are keyed by
the global prompt index, so samples do not depend on DP, TP_g or PP_g. Only the update may trade
rows between DP ranks, inside a mini-batch, to even out their tokens (:mod:`hyflow.rl.balance`,
``actor.balance_batch``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hyflow.hybrid.executor import HybridEngine
from hyflow.hybrid.generation_groups import build_micro_dp_group
from hyflow.monitor import comm
from hyflow.rl.batch import MicroBatching, RolloutBatch
from hyflow.rl.exact_logprobs import rescore_in_generation_layout
from hyflow.roles import RolloutCapabilities
from hyflow.rollout.config import GenerationConfig, SamplingConfig
from hyflow.rollout.dp import GatheredRollout, SampleTensors, generate_data_parallel
from hyflow.rollout.engine import GenerationEngine


def sampling_seed(trainer_seed: int, step: int) -> int:
    """The base seed of RL step ``step``'s sampling: a fresh stream per step, and per
    ``trainer.seed`` (two runs that differ only in ``trainer.seed`` sample different responses)."""
    return trainer_seed + 1_000_003 * step


def shard_range(count: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the prompts DP rank ``dp_rank`` of ``dp`` holds (``dp`` divides ``count``)."""
    if count % dp:
        raise ValueError(f"{count} prompts do not split over {dp} data-parallel ranks "
                         f"(data.train_batch_size must be a multiple of the actor's dp)")
    per = count // dp
    return dp_rank * per, (dp_rank + 1) * per


class RolloutDispatcher:
    """Generates a DP shard's samples on the micro-DP replicas of the hybrid engine's layout, with
    hyflow's KV-cache engine over the engine's generation model: the colocated
    :class:`~hyflow.roles.Rollouts`.

    Built once by every rank (it creates the micro-DP process groups).
    """

    @classmethod
    def capabilities_for(cls, cfg) -> RolloutCapabilities:
        """What the dispatcher :func:`hyflow.rl.models.build_rl_models` builds for ``cfg`` can do."""
        return RolloutCapabilities(greedy=True,
                                   exact_rescore=HybridEngine.capabilities_for(cfg).exact_in_generation_layout,
                                   current_weights=not cfg.rollout.force_staleness, multi_turn=True,
                                   dynamic_sampling=True)

    def __init__(self, hybrid: HybridEngine, train_groups, rollout_config: GenerationConfig, desc, vocab_size: int,
                 eos_token_ids: Sequence[int], *, current_weights: bool = True):
        self.hybrid, self.groups = hybrid, train_groups
        self.rollout_config = rollout_config
        self.desc, self.vocab_size, self.eos = desc, vocab_size, list(eos_token_ids)
        # One group per (training dp, generation tp, generation pp); its order is the replica index.
        self.micro_dp_group = build_micro_dp_group(hybrid.plan, train_groups.layout.cp)
        comm.register_group(self.micro_dp_group, "data")  # the data plane's sample exchange
        self.capabilities = RolloutCapabilities(
            greedy=True, exact_rescore=hybrid.capabilities.exact_in_generation_layout,
            current_weights=current_weights, multi_turn=True)
        self._engine: Optional[GenerationEngine] = None

    @property
    def dp(self) -> int:
        return self.groups.layout.dp

    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    def shard(self, count: int) -> tuple[int, int]:
        """This rank's prompts of a step of ``count`` prompts."""
        return shard_range(count, self.dp, self.dp_rank)

    @property
    def engine(self) -> GenerationEngine:
        """The KV-cache engine over the hybrid engine's generation model (built at first use; its
        parameters are the generation buffer's views, refilled by every ``to_generation``)."""
        if self._engine is None:
            gen = self.hybrid.gen_groups
            self._engine = GenerationEngine(self.hybrid.gen_model, self.rollout_config, vocab_size=self.vocab_size,
                                            eos_token_ids=self.eos, tp_group=gen.pgs.tp, pp_group=gen.pgs.pp,
                                            max_position_embeddings=self.desc.max_position_embeddings)
        return self._engine

    def prepare_for_generation(self) -> None:
        """Nothing to load: the engine's model reads the hybrid engine's generation buffer."""

    def finish_generation(self) -> None:
        """Nothing to release: the hybrid engine's ``to_training`` gives the buffer back."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, seed: int, request_offset: int,
                 greedy: bool = False, max_new_tokens: Optional[int] = None,
                 sampling: Optional[SamplingConfig] = None) -> GatheredRollout:
        """``n`` samples of each of this DP shard's ``prompts`` (global indices from
        ``request_offset``), gathered on every rank of the shard's model-parallel group.
        ``greedy``: argmax decoding (ReMax's baselines); ``sampling``: settings other than the
        rollout's (validation's ``rollout.val_kwargs``)."""
        sampling = (sampling or self.rollout_config.sampling).replace(n=n, seed=seed)
        if greedy:
            sampling = sampling.replace(temperature=0.0)
        if max_new_tokens is not None:
            sampling = sampling.replace(max_new_tokens=max_new_tokens)
        return generate_data_parallel(self.engine, [list(p) for p in prompts], self.micro_dp_group,
                                      sampling, request_offset=request_offset, device=self.groups.device)

    def generate_trajectories(self, agent, records: Sequence, n: int, *, seed: int, request_offset: int,
                              sampling: Optional[SamplingConfig] = None) -> SampleTensors:
        """``n`` multi-turn trajectories of each of this DP shard's ``records``: the prompts are
        split over the micro-DP replicas, each runs the agent's loop with this replica's engine
        (its leader, generation TP rank 0 of stage 0, runs the tools and environments and shares
        their answers with the replica's other ranks), and the trajectories are gathered back over
        the micro-DP group (:meth:`hyflow.agent.agent.MultiTurnAgent.rollout`)."""
        gen = self.hybrid.gen_groups
        engine = self.engine
        return agent.rollout(engine, records, n, seed=seed, request_offset=request_offset,
                             sampling=(sampling or self.rollout_config.sampling).replace(n=1, seed=seed),
                             max_seq_len=getattr(engine, "max_seq_len", None) or self.desc.context_length,
                             device=self.groups.device, dp_group=self.micro_dp_group,
                             replica_groups=[gen.pgs.tp, gen.pgs.pp], pad_id=self.rollout_config.pad_token_id)

    def rescore(self, batch: RolloutBatch, batching: MicroBatching, *, temperature: float, fused: bool,
                train_mode: bool) -> torch.Tensor:
        """Exact mode's re-score by the generation-layout model, spread over the micro-DP replicas
        (:func:`hyflow.rl.exact_logprobs.rescore_in_generation_layout`)."""
        if not self.capabilities.exact_rescore:
            raise RuntimeError("the generation layout does not reproduce the training forward (another TP or "
                               "sequence parallelism): re-score in the training layout")
        return rescore_in_generation_layout(self.hybrid.gen_model, self.hybrid.gen_groups.pgs, self.micro_dp_group,
                                            batch, batching, self.vocab_size, temperature, train_mode=train_mode,
                                            fused=fused)
