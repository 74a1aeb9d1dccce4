"""DAPO dynamic sampling in the RL step (``algorithm.dynamic_sampling``), one DP shard per rank.

A group (the ``n`` responses to one prompt) whose rewards are all equal has zero group-relative
advantage: it adds no gradient and dilutes the batch. Dynamic sampling drops such groups
(:func:`hyflow.algorithms.dapo.groups_with_signal`) and refills the batch with more prompts:

1. every data-parallel rank generates and scores its own shard of the step's prompts (round 1,
   the ordinary step) and keeps its groups with signal;
2. one all-reduce (MIN over the DP group) of the kept-group count tells every rank whether all of
   them hold their share, ``data.train_batch_size / DP`` groups;
3. if not, every rank draws the loader's next batch (so the loader advances identically on every
   rank and a resumed run continues where it stopped) and a rank that still lacks groups
   generates and scores *its shard* of it (a rank with enough skips the work: generation and
   scoring are collective only inside its own model-parallel group). At most
   ``max_rounds`` rounds (verl's ``max_num_gen_batches``);
4. each rank keeps its first ``share`` groups with signal, in round order. When the rounds run
   out first, the share is completed with groups without signal (they train on nothing but the
   KL / entropy terms), a warning is printed and ``dynamic_sampling/gave_up`` is 1.

The kept groups are renumbered ``first, first + 1, ...`` (the rank's usual prompt indices), so the
rest of the step (advantages, mini-batches, metrics) sees an ordinary batch of the usual size.
Metrics: ``train/num_gen_batches`` (verl's name: generation rounds of the step) and
``dynamic_sampling/{kept_groups,generated_groups,gave_up}``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hyflow.algorithms.dapo import groups_with_signal
from hyflow.rewards.manager import RewardBatch
from hyflow.rollout.dp import SampleTensors


@dataclass
class Round:
    """One generation round of a rank's shard: its samples in (prompt, sample) order, their rewards."""

    samples: SampleTensors
    scored: RewardBatch
    scores: torch.Tensor  # [rows] float32, the shaped reward the advantages use
    n: int  # responses per prompt
    greedy_scores: Optional[torch.Tensor] = None  # ReMax baselines (never with dynamic sampling)

    @property
    def groups(self) -> int:
        return len(self.samples) // self.n

    def signal(self) -> torch.Tensor:
        """[groups] bool: the group's rewards are not all equal."""
        rows = groups_with_signal(self.scores, self.samples.column("request"))
        return rows.view(self.groups, self.n)[:, 0]


def collect_groups(first_round: Round, next_round: Callable[[int, bool], Optional[Round]], *, share: int,
                   first: int, max_rounds: int, dp_group, device: torch.device) -> tuple[Round, dict]:
    """Rounds until every DP rank holds ``share`` groups with signal (see the module docstring).

    ``next_round(r, needed)``: round ``r`` (2, 3, ...) of this rank's shard: it draws the loader's next
    batch, and returns the round (or None when ``needed`` is False: the rank has enough). Returns
    the rank's kept groups as one :class:`Round` with requests renumbered from ``first``, and the
    metrics (identical on every rank)."""
    rounds = [first_round]
    kept: list[tuple[int, int]] = []  # (round, group) with signal, in order
    spare: list[tuple[int, int]] = []  # without signal, to complete a share when the rounds run out
    generated = 0

    def take(i: int, rnd: Round) -> None:
        nonlocal generated
        signal = rnd.signal().tolist()
        generated += len(signal)
        kept.extend((i, g) for g, s in enumerate(signal) if s)
        spare.extend((i, g) for g, s in enumerate(signal) if not s)

    take(0, first_round)
    while True:
        lowest = torch.tensor([min(len(kept), share)], dtype=torch.long, device=device)
        if dp_group is not None and dp_group.size() > 1:
            dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=dp_group)
        if int(lowest) >= share or len(rounds) >= max_rounds:
            break
        rnd = next_round(len(rounds) + 1, len(kept) < share)
        rounds.append(rnd)
        if rnd is not None:
            take(len(rounds) - 1, rnd)
    gave_up = len(kept) < share
    chosen = (kept + spare)[:share]
    if len(chosen) < share:  # cannot happen: round 1 alone has `share` groups
        raise RuntimeError(f"dynamic sampling holds {len(chosen)} groups, needs {share}")
    counts = torch.tensor([float(gave_up), float(min(len(kept), share)), float(generated)], dtype=torch.float64,
                          device=device)
    if dp_group is not None and dp_group.size() > 1:
        dist.all_reduce(counts, group=dp_group)
    if gave_up:
        print(f"[hyflow] warning: dynamic sampling gave up after {len(rounds)} rounds "
              f"(algorithm.dynamic_sampling.max_rounds): {len(kept)} of {share} groups on this rank have reward "
              "variance > 0; the rest of the batch are groups without signal. Raise max_rounds, or use "
              "prompts of a difficulty the policy sometimes solves", file=sys.stderr, flush=True)
    metrics = {"train/num_gen_batches": float(len(rounds)), "dynamic_sampling/gave_up": float(counts[0] > 0),
               "dynamic_sampling/kept_groups": float(counts[1]), "dynamic_sampling/generated_groups": float(counts[2])}
    return _assemble(rounds, chosen, first, first_round.n, device), metrics


def _assemble(rounds: list[Optional[Round]], chosen: list[tuple[int, int]], first: int, n: int,
              device: torch.device) -> Round:
    """One round of the ``chosen`` (round, group) pairs, requests renumbered ``first + k``."""
    parts, scores, values, sources = [], [], [], []
    extras: dict[str, list[float]] = {}
    for k, (i, g) in enumerate(chosen):
        rnd = rounds[i]
        rows = torch.arange(g * n, (g + 1) * n, device=device)
        part = rnd.samples.select(rows)
        part.meta[:, 0] = first + k  # the request column
        parts.append(part)
        values.append(rnd.scores[rows])
        scores.extend(rnd.scored.scores[g * n:(g + 1) * n])
        sources.extend(rnd.scored.data_sources[g * n:(g + 1) * n])
    for key in {key for rnd in rounds if rnd is not None for key in rnd.scored.extras}:
        extras[key] = [v for i, g in chosen
                       for v in (rounds[i].scored.extras.get(key) or [math.nan] * rounds[i].scores.shape[0])
                       [g * n:(g + 1) * n]]
    samples = SampleTensors.concat(parts)  # with multi-turn masks and counters when the rounds have them
    timeouts = sum(rnd.scored.timeouts for rnd in rounds if rnd is not None)  # every round's calls were made
    return Round(samples=samples, scored=RewardBatch(scores, sources, extras, timeouts=timeouts),
                 scores=torch.cat(values), n=n)

