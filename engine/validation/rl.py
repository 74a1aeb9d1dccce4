"""Validation of a policy on held-out prompts (``data.val_files``): generate, score, reduce.

Each data-parallel rank generates its contiguous share of the validation prompts (sizes within
one; samples are seeded by the global prompt index, so they do not depend on the layout) with the
generate path the run uses, scores them with the run's reward (rules, a ``compute_score`` file or
a reward model) and adds every prompt's metrics (:mod:`hyflow.validation.metrics`); one
all-reduce over the data-parallel group gives the whole set's ``val-core/...`` numbers.

Two generate paths plug in (a callable ``generate(records, request_offset) -> SampleTensors`` in
(prompt, sample) order on every rank of the model-parallel group that shares the prompts):

* in training, :func:`actor_generate`: the run's weight path and rollouts (:mod:`hyflow.roles`), the
  calls the RL step makes;
* stand-alone (``hyflow eval``), a model loaded in the generation layout and its engine.

A multi-turn run (``rollout.multi_turn``) validates multi-turn trajectories with its tools and
environments (the agent's loop, :mod:`hyflow.agent`), scored as in training (the final turn, the
environment's rewards or both), with the share of trajectories that called a tool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hyflow.agent.trajectory import STATS
from hyflow.data.dataset import PromptDataset
from hyflow.rl.metrics import all_gather_strings
from hyflow.rollout.config import SamplingConfig
from hyflow.rollout.dp import SampleTensors, split_evenly
from hyflow.validation.metrics import ValidationStats, core_keys

#: ``generate(records, request_offset)``: the samples of the prompt records (global indices from the offset).
Generate = Callable[[list, int], SampleTensors]


def val_sampling(base: SamplingConfig, val_kwargs: Any) -> SamplingConfig:
    """``base`` (the rollout's stop tokens and length) with ``rollout.val_kwargs``'s sampling."""
    return base.replace(n=val_kwargs.n, seed=val_kwargs.seed,
                        temperature=0.0 if val_kwargs.greedy else val_kwargs.temperature,
                        top_k=max(val_kwargs.top_k, 0), top_p=val_kwargs.top_p)


def load_validation_set(data: Any, rollout: Any, tokenizer: Any, require_ground_truth: bool = True):
    """The validation prompts of ``data.val_files``, tokenized and length-filtered as the training set."""
    return PromptDataset.from_files(list(data.val_files), tokenizer, max_prompt_length=rollout.max_prompt_length,
                                    truncate=rollout.truncate_long_prompts, prompt_key=data.prompt_key,
                                    require_ground_truth=require_ground_truth)


@dataclass
class Validation:
    """A validation set with its scorer and sampling settings.

    Attributes:
        dataset: the prompts (:class:`~hyflow.data.dataset.PromptDataset`), the same on every rank.
        tokenizer: decodes responses for the reward.
        reward: the run's :class:`~hyflow.rewards.manager.RewardManager`.
        sampling: validation sampling (:func:`val_sampling`).
        agent: a multi-turn run's :class:`~hyflow.agent.agent.MultiTurnAgent` (None: single responses).
        every: validate every this many steps (0: only after the last step).
        before_train: validate the starting weights (step 0).
    """

    dataset: Any
    tokenizer: Any
    reward: Any
    sampling: SamplingConfig
    every: int = 0
    before_train: bool = True
    agent: Any = None

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, reward: Any, base: SamplingConfig,
                    agent: Any = None) -> Optional["Validation"]:
        """From an RL job config; None without ``data.val_files``. ``agent``: the run's multi-turn agent."""
        if not cfg.data.val_files:
            return None
        dataset = load_validation_set(cfg.data, cfg.rollout, tokenizer, require_ground_truth=reward.kind != "model")
        reward.check_records(list(dataset))
        return cls(dataset, tokenizer, reward, val_sampling(base, cfg.rollout.val_kwargs), cfg.trainer.val_every,
                   cfg.trainer.val_before_train, agent)

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def sources(self) -> list[str]:
        return sorted({r.data_source for r in self.dataset})

    def due(self, step: int, total_steps: int) -> bool:
        """After step ``step``: every ``every`` steps and after the last."""
        return step == total_steps or bool(self.every and step % self.every == 0)

    def run(self, generate: Generate, dp_rank: int, dp: int, group, device: torch.device) -> dict[str, float]:
        """Generate and score this DP rank's share, return the whole set's metrics (collective over
        ``group``, the data-parallel group, and over the generate path's groups)."""
        start = time.perf_counter()
        first, stop = split_evenly(len(self.dataset), dp)[dp_rank]
        mine = [self.dataset[i] for i in range(first, stop)]
        scores: list[float] = []
        extras: dict[str, list[float]] = {}
        tool_use = torch.zeros(2, dtype=torch.float64, device=device)  # trajectories with a tool call, all
        if mine:
            samples = generate(mine, first)
            outputs = samples.to_outputs()
            if len(outputs) != len(mine) * self.n:
                raise RuntimeError(f"validation: {len(outputs)} samples for {len(mine)} prompts x n={self.n}")
            if self.agent is not None:  # trajectories: scored as in training (hyflow.agent)
                scored = self.agent.score(self.reward, mine, first, samples)[1]
                calls = samples.stats[:, STATS.index("tool_calls")]
                tool_use += torch.tensor([float((calls > 0).sum()), float(len(calls))], dtype=torch.float64,
                                         device=device)
            else:
                texts = self.tokenizer.batch_decode([s.token_ids for s in outputs])
                scored = self.reward.score_records(
                    mine, texts, sequences=[list(s.prompt_ids) + list(s.token_ids) for s in outputs])
            scores, extras = scored.scores, scored.extras
        variables = ["reward"] + [k for k in all_gather_strings(extras, group, device) if k != "reward"]
        stats = ValidationStats(self.sources, variables, self.n, device)
        n = self.n
        for i, record in enumerate(mine):
            stats.add_prompt(record.data_source, "reward", scores[i * n:(i + 1) * n])
            for key, values in extras.items():
                stats.add_prompt(record.data_source, key, values[i * n:(i + 1) * n])
        out = stats.reduce(group)
        if self.agent is not None:
            if group is not None:
                dist.all_reduce(tool_use, group=group)
            out["val-aux/multi_turn/tool_call_rate"] = float(tool_use[0] / tool_use[1].clamp(min=1))
        out["timing_s/testing"] = time.perf_counter() - start
        return out


def actor_generate(weights: Any, rollouts: Any, sampling: SamplingConfig,
                   agent: Any = None) -> tuple[Generate, Callable[[], None]]:
    """The RL step's generate path for validation, through the declared roles (:mod:`hyflow.roles`):
    ``(generate, done)``. The first call moves the weights to generation and prepares the rollouts;
    ``done()`` gives the rollouts' memory back and the weights back to training. With a multi-turn
    ``agent`` it generates trajectories (:meth:`~hyflow.roles.Rollouts.generate_trajectories`)."""
    state = {"generating": False}

    def generate(records: list, offset: int) -> SampleTensors:
        if not state["generating"]:
            weights.to_generation()
            rollouts.prepare_for_generation()
            state["generating"] = True
        if agent is not None:
            return rollouts.generate_trajectories(agent, records, sampling.n, seed=sampling.seed, request_offset=offset,
                                                  sampling=sampling)
        return rollouts.generate([r.prompt_ids for r in records], sampling.n, seed=sampling.seed,
                                 request_offset=offset, sampling=sampling).samples

    def done() -> None:
        if state["generating"]:
            rollouts.finish_generation()
            weights.to_training()
            state["generating"] = False

    return generate, done


def validate_actor(validation: Validation, models: Any) -> dict[str, float]:
    """Validate the RL actor (every rank of the run calls it at the same step)."""
    groups = models.groups
    generate, done = actor_generate(models.weights, models.rollouts, validation.sampling, validation.agent)
    try:
        return validation.run(generate, groups.dp_rank, groups.layout.dp, groups.pgs.dp, groups.device)
    finally:
        done()


def summary_line(step: int, metrics: dict, n: int) -> str:
    """``[hyflow] validation after step N: val-core/<source>/reward/mean@1 0.625 | ...``."""
    parts = [f"{k} {metrics[k]:.4g}" for k in core_keys(metrics, n)]
    when = "before training" if step == 0 else f"after step {step}"
    return f"[hyflow] validation {when}: " + " | ".join(parts) + f" ({metrics.get('timing_s/testing', 0):.1f}s)"

