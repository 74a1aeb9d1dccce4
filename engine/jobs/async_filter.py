"""DAPO dynamic sampling with ``trainer.mode: async``: the generation replicas filter whole groups.

The colocated job drops a group whose rewards are all equal (no group-relative signal) and refills
its step's batch in rounds (:mod:`hyflow.rl.dynamic_sampling`). Streaming batches
(:mod:`hyflow.jobs.fully_async`) make that a filter on the generation side: each replica scores every
group it completes with the run's reward (the same :func:`~hyflow.jobs.rl.score_samples` and
:func:`~hyflow.jobs.rl.shaped_scores` the training side uses, so the overlong punishment counts
too) and :meth:`GroupFilter.keep` decides whether the group enters the batch being formed:

* a group with signal (:func:`~hyflow.algorithms.dapo.groups_with_signal`) is kept;
* one without is *filtered*: it is in no batch, it is counted against the batch being formed (sent
  with the rows, logged by the training lead as ``dynamic_sampling/filtered_groups``), and the
  admission bound lets a new group start in its place (as for a stale group);
* the colocated cap on extra generation (``algorithm.dynamic_sampling.max_rounds`` rounds of a
  replica's ``B_r`` groups) in streaming form: once ``(max_rounds - 1) * B_r`` groups were filtered
  while forming one batch, the rest of that batch takes groups without signal (a warning is printed,
  ``dynamic_sampling/gave_up`` is 1), so a run on prompts that never give signal still progresses.

Which group is kept is a function of the samples' tokens, so the batches stay a function of decode
steps and a resumed run filters as the straight one did (the counts of batches not yet sent are in
the in-flight file). The training side scores the rows again for the loss: twice the reward calls,
the same result (rule rewards and user functions are plain CPU functions of the response; a user
function that times out gets ``reward.timeout_score`` on each side, which may then differ: the
training side's metrics count what it trains on). A reward *model* runs on the training (or reward)
pool, not here: ``trainer.mode=async`` refuses it with dynamic sampling before launch
(``RLJobConfig._check_async``).

Only the first rank of a replica scores (its worker processes, its CPU time); one small broadcast
over the replica's model-parallel group hands the decisions to the others, so every rank of the
replica forms the same batches even if a user function's timeout would not repeat.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

from hyflow.algorithms.dapo import groups_with_signal
from hyflow.jobs.rl import StepJob, score_samples, shaped_scores
from hyflow.rewards.manager import RewardManager
from hyflow.rl.dynamic_sampling import Round
from hyflow.rollout.dp import META, SampleTensors


class GroupFilter:
    """A generation replica's dynamic-sampling filter (see the module docstring). ``group``: the
    replica's model-parallel group (its first rank scores), None for a replica of one rank;
    ``share``: the replica's ``B_r``."""

    def __init__(self, cfg, tokenizer, dataset, share: int, group, device: torch.device) -> None:
        self.cfg, self.dataset, self.group, self.device = cfg, dataset, group, device
        self.src = dist.get_global_rank(group, 0) if group is not None else None
        here = group is None or dist.get_rank() == self.src
        self.job = StepJob(tokenizer, RewardManager.from_config(cfg.reward), (), refill=False) if here else None
        self.cap = (cfg.algorithm.dynamic_sampling.max_rounds - 1) * share  # filtered groups per batch at most
        self.filtered: dict[int, int] = {}  # batch -> groups filtered while forming it (not sent yet)
        self.signal: dict[tuple[int, int], bool] = {}  # the groups of the last score(): key -> signal
        self.warned: set[int] = set()

    def __enter__(self) -> "GroupFilter":
        return self

    def __exit__(self, *exc) -> None:
        if self.job is not None:
            self.job.reward.close()  # the reward function's worker processes

    def score(self, groups: list) -> None:
        """Score the completed ``groups`` (:class:`~hyflow.jobs.fully_async.Group`, the same list on
        every rank of the replica) and remember which have signal until :meth:`keep` asks."""
        self.signal = {}
        if not groups:
            return
        n = len(groups[0].outs)
        bits = torch.zeros(len(groups), dtype=torch.long, device=self.device)
        if self.job is not None:  # host work: the reward is a CPU function of the decoded text
            cpu = torch.device("cpu")
            samples = SampleTensors.from_samples([o for g in groups for o in g.outs], cpu)
            samples.meta[:, META.index("request")] = torch.arange(len(groups), device=cpu).repeat_interleave(n)
            scored = score_samples(self.job, [self.dataset[g.uid] for g in groups], 0, samples)
            rnd = Round(samples, scored, shaped_scores(self.cfg, scored, samples, cpu), n)
            bits.copy_(rnd.signal().to(torch.long))
        if self.group is not None:
            dist.broadcast(bits, src=self.src, group=self.group)
        for g, bit in zip(groups, bits.tolist()):
            self.signal[g.key] = bool(bit)

    def keep(self, group, t: int) -> bool:
        """Whether the scored ``group`` enters batch ``t``; False counts it as filtered there."""
        if self.signal.pop(group.key):
            return True
        if self.filtered.get(t, 0) < self.cap:
            self.filtered[t] = self.filtered.get(t, 0) + 1
            return False
        if self.job is not None and t not in self.warned:
            self.warned.add(t)
            print(f"[hyflow] warning: dynamic sampling gave up on batch {t} of this generation replica: "
                  f"{self.cap} groups without reward variance were filtered while forming it "
                  "(algorithm.dynamic_sampling.max_rounds - 1 times its share); the batch is completed with groups "
                  "without signal. Raise max_rounds, or use prompts of a difficulty the policy sometimes solves",
                  file=sys.stderr, flush=True)
        return True

    def pop(self, t: int) -> int:
        """Groups filtered while forming batch ``t`` (sent with it)."""
        return self.filtered.pop(t, 0)

    def state(self) -> list[list[int]]:
        return [[int(t), int(c)] for t, c in sorted(self.filtered.items())]

    def load(self, state: list) -> None:
        self.filtered = {int(t): int(c) for t, c in state}


def group_filter(cfg, tokenizer, dataset, side) -> Optional[GroupFilter]:
    """The replica's filter when ``algorithm.dynamic_sampling.enable`` (else None); ``side``: the
    :class:`~hyflow.placement.pool_models.GenerationSide`."""
    if not cfg.algorithm.dynamic_sampling.enable:
        return None
    first, stop = side.share(cfg.data.train_batch_size)
    replica = side.groups.pgs.mp
    return GroupFilter(cfg, tokenizer, dataset, stop - first, replica if dist.get_world_size(replica) > 1 else None,
                       side.groups.device)


def filter_metrics(scores: torch.Tensor, n: int, filtered: int, dp_group, device: torch.device) -> dict:
    """The training side's dynamic-sampling metrics of a step (the colocated job's names), from the
    rows it trains on: ``scores`` ``[rows]`` (this rank's, ``n`` per group, the shaped reward),
    ``filtered`` (the groups its senders filtered while forming this batch: counted once per replica,
    :func:`~hyflow.placement.rows.send_rows`); sums over the training data-parallel ranks.

    ``kept_groups``: groups with signal in the batch (recounted here, not taken from the senders);
    ``generated_groups``: the batch's groups plus the filtered ones; ``gave_up``: 1 when some trained
    group has no signal; ``train/num_gen_batches``: generated groups in batches' worth (verl's name;
    the colocated job's rounds)."""
    groups = scores.numel() // n
    ids = torch.arange(groups, device=scores.device).repeat_interleave(n)
    signal = groups_with_signal(scores, ids).view(groups, n)[:, 0] if groups else scores.new_zeros(0)
    sums = torch.tensor([float(signal.sum()), float(groups), float(filtered)], dtype=torch.float64, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
    kept, total, filtered = sums.tolist()
    return {"dynamic_sampling/kept_groups": kept, "dynamic_sampling/generated_groups": total + filtered,
            "dynamic_sampling/filtered_groups": filtered, "dynamic_sampling/gave_up": float(kept < total),
            "train/num_gen_batches": (total + filtered) / max(total, 1.0)}
