"""What an RL run holds for multi-turn rollouts: the chat pieces, tools and environments, and the
three things the step asks of them: trajectories for a shard of prompts (spread over the micro-DP
replicas and gathered back as tensors), their scores, and multi-turn SFT demonstrations."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from hyflow.agent.builder import build_toolbox, environment_factory
from hyflow.agent.channel import ReplicaChannel
from hyflow.agent.chat import ChatFormat
from hyflow.agent.config import MultiTurnConfig
from hyflow.agent.rollout import EngineTurns, MultiTurnRollout
from hyflow.agent.trajectory import STATS, final_turns, to_sample_tensors
from hyflow.rewards.manager import RewardBatch
from hyflow.rollout.config import SamplingConfig
from hyflow.rollout.dp import SampleTensors, all_gather_samples, split_evenly


class DemonstrationError(ValueError):
    """A malformed multi-turn demonstration (``extra_info.demonstration``)."""


class MultiTurnAgent:
    """Built once per rank from ``rollout.multi_turn`` and the run's tokenizer."""

    def __init__(self, cfg: MultiTurnConfig, tokenizer) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.toolbox = build_toolbox(cfg)
        schemas = self.toolbox.runner.schemas if self.toolbox is not None else []
        self.chat = ChatFormat(tokenizer, schemas, cfg.tool_prompt, cfg.observation_role)
        self.make_env = environment_factory(cfg, self.toolbox)

    def rollout(self, engine, records: Sequence[Any], n: int, *, seed: int, request_offset: int,
                sampling: SamplingConfig, max_seq_len: int, device: torch.device, dp_group=None,
                replica_groups: Sequence = (), pad_id: int = 0) -> SampleTensors:
        """``n`` trajectories of each of ``records`` (global indices from ``request_offset``) with
        this rank's replica ``engine`` (``generate(requests, on_finish=...)``, as
        :class:`~hyflow.rollout.engine.GenerationEngine`): the replicas of ``dp_group`` (one rank per
        replica) each run a contiguous share of the prompts, the leader of each replica (rank 0 of
        every group of ``replica_groups``: its TP, then PP group) runs the tools and environments,
        and every rank gets all trajectories in (prompt, sample) order, with masks and counters."""
        size = dp_group.size() if dp_group is not None else 1
        rank = dp_group.rank() if dp_group is not None else 0
        start, stop = split_evenly(len(records), size)[rank]
        driver = MultiTurnRollout(self.cfg, self.chat, self.tokenizer, EngineTurns(engine), sampling, max_seq_len,
                                  self.make_env, ReplicaChannel(replica_groups, device))
        trajectories = driver.run(records[start:stop], n, seed, request_offset + start) if stop > start else []
        local = to_sample_tensors(trajectories, device, pad_id)
        return all_gather_samples(local, dp_group).sorted()

    def score(self, reward, records: Sequence[Any], first: int, samples: SampleTensors):
        """Scores of this rank's trajectories to its ``records`` (global indices from ``first``):
        ``(scores [N] float32, RewardBatch)``. ``rollout.multi_turn.reward`` picks the reward
        section's score of the final assistant turn, the environment's rewards, or their sum; a
        dropped trajectory scores 0."""
        meta = samples.meta.tolist()
        recs = [records[row[0] - first] for row in meta]
        env = samples.stats[:, STATS.index("env_reward")].float()
        dropped = samples.stats[:, STATS.index("dropped")] > 0
        if self.cfg.reward == "environment":
            batch = RewardBatch(env.tolist(), [r.data_source for r in recs])
            scores = env
        else:
            texts = self.tokenizer.batch_decode(final_turns(samples))
            groups = [records[row[0] - first] for row in meta if row[1] == 0]
            lengths = (samples.column("prompt_len") + samples.column("response_len")).tolist()
            flat, pos, sequences = samples.tokens.tolist(), 0, []
            for length in lengths:
                sequences.append(flat[pos:pos + length])
                pos += length
            batch = reward.score_records(groups, texts, sequences=sequences)
            scores = torch.tensor(batch.scores, dtype=torch.float32, device=samples.meta.device)
            if self.cfg.reward == "sum":
                scores = scores + env
        scores = torch.where(dropped, torch.zeros_like(scores), scores)
        batch.scores = scores.tolist()
        return scores, batch

    def demonstration(self, record: Any) -> tuple[list[int], list[int]]:
        """``(ids, loss mask)`` of the record's multi-turn demonstration for the SFT warm-up:
        ``extra_info.demonstration`` is the list of messages after the prompt (assistant turns,
        tool results, ...), ending with an assistant turn. Assistant tokens carry the loss, the
        rest is context, exactly as in a rollout."""
        demo = record.extra_info.get("demonstration")
        where = f"{record.where}: extra_info.demonstration"
        if not isinstance(demo, list) or not demo or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                            and isinstance(m.get("role"), str) for m in demo):
            raise DemonstrationError(f"{where} must be a non-empty list of {{role, content}} messages")
        if demo[-1]["role"] != "assistant":
            raise DemonstrationError(f"{where} must end with an assistant message")
        ids = self.chat.prompt_ids(record.messages)
        mask = [0] * len(ids)
        pending: list[dict] = []
        last: Optional[int] = None
        for message in demo:
            if message["role"] != "assistant":
                pending.append(message)
                continue
            if pending:
                if last is None:
                    raise DemonstrationError(f"{where} must start with an assistant message")
                obs = self.chat.observation_ids(pending, last)
                ids += obs
                mask += [0] * len(obs)
                pending = []
            turn = self.chat.assistant_ids(message["content"])
            ids += turn
            mask += [1] * len(turn)
            last = turn[-1]
        return ids, mask
