"""The RL step's multi-turn generation on the hybrid engine: the agent's rollout on this rank's
generation replica (hyflow's engine), spread over the micro-DP replicas of its training DP rank."""

from __future__ import annotations

from typing import Any, Sequence

from hyflow.agent.agent import MultiTurnAgent
from hyflow.agent.channel import ReplicaChannel
from hyflow.agent.rollout import EngineTurns
from hyflow.rollout.dp import SampleTensors


def generate_trajectories(agent: MultiTurnAgent, models, gen_model, shard: Sequence[Any], n: int, seed: int,
                          first: int, pad_id: int) -> SampleTensors:
    """``n`` trajectories of each prompt of this rank's ``shard`` (global indices from ``first``)
    with the generation-layout model ``gen_model``; every rank of the shard's model-parallel group
    gets all of them."""
    dispatcher = models.dispatcher
    engine = dispatcher.engine(gen_model)
    gen = models.hybrid.gen_groups
    channel = ReplicaChannel([gen.pgs.tp, gen.pgs.pp], device=models.groups.device)
    sampling = dispatcher.rollout_config.sampling.replace(n=1, seed=seed)
    return agent.rollout(EngineTurns(engine), shard, n, seed=seed, request_offset=first, sampling=sampling,
                         max_seq_len=engine.max_seq_len, device=models.groups.device,
                         dp_group=dispatcher.micro_dp_group, channel=channel, pad_id=pad_id)
