"""Validation metrics under verl's names, from each DP rank's prompts, reduced with one all-reduce.

For every prompt with ``N`` scored responses and every variable (``reward``, and each numeric key a
``compute_score`` dict returns, e.g. ``acc``):

* ``mean@N``: the mean of the N values; ``std@N`` (N > 1): their population standard deviation;
* ``best@k/mean``, ``best@k/std`` and ``worst@k/mean``, ``worst@k/std`` for k = 2, 4, 8, ... < N and
  k = N: the mean and standard deviation of the largest (smallest) of k values drawn with
  replacement from the N. verl estimates these by bootstrap (1000 resamples); here they are
  computed exactly from the order statistics, so they carry no resampling noise and two runs of
  the same responses give the same numbers.

Each metric is averaged over the prompts of a data source and logged as
``val-core/<data_source>/<var>/<metric>`` for the core variable's (``acc`` when the reward
function returns it, else ``reward``) ``mean@N`` and ``best@N/*``, ``val-aux/...`` for the rest:
verl's split, so its dashboards carry over. (verl's ``maj@N`` needs a ``pred`` string from the
reward function; hyflow's reward functions return numbers only, so it is not computed.)

Scale: every rank computes its own prompts' per-prompt metrics; the sums and prompt counts per
(data source, variable, metric) go through one all-reduce over the data-parallel group.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

CORE_PREFIXES = ("mean", "maj", "best")


def subset_sizes(n: int) -> list[int]:
    """verl's k values of best@k / worst@k: 2, 4, 8, ... below ``n``, then ``n`` (none for n = 1)."""
    if n < 2:
        return []
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def metric_names(n: int) -> list[str]:
    """The per-prompt metrics of ``n`` responses, in a fixed order (every rank agrees on it)."""
    names = [f"mean@{n}"]
    if n > 1:
        names.append(f"std@{n}")
        for k in subset_sizes(n):
            names += [f"best@{k}/mean", f"best@{k}/std", f"worst@{k}/mean", f"worst@{k}/std"]
    return names


def extreme_of_draws(values: Sequence[float], k: int, largest: bool) -> tuple[float, float]:
    """Mean and standard deviation of the max (``largest``) or min of ``k`` draws with replacement
    from ``values``: with the values sorted so that the i-th of N (1-based) is exceeded by none of
    the first i, P(extreme is the i-th) = (i/N)^k - ((i-1)/N)^k."""
    ordered = sorted(values, reverse=not largest)
    n = len(ordered)
    mean = second = 0.0
    for i, v in enumerate(ordered, start=1):
        p = (i / n) ** k - ((i - 1) / n) ** k
        mean += p * v
        second += p * v * v
    return mean, math.sqrt(max(second - mean * mean, 0.0))


def prompt_metrics(values: Sequence[float]) -> list[float]:
    """:func:`metric_names` of one prompt's response values, in that order."""
    n = len(values)
    mean = sum(values) / n
    out = [mean]
    if n > 1:
        out.append(math.sqrt(sum((v - mean) ** 2 for v in values) / n))
        for k in subset_sizes(n):
            out += [*extreme_of_draws(values, k, largest=True), *extreme_of_draws(values, k, largest=False)]
    return out


def metric_key(data_source: str, var: str, metric: str, core_var: str, n: int) -> str:
    """verl's name: ``val-core`` for the core variable's mean / maj / best at the largest N."""
    core = var == core_var and metric.startswith(CORE_PREFIXES) and f"@{n}" in metric
    return f"{'val-core' if core else 'val-aux'}/{data_source}/{var}/{metric}"


class ValidationStats:
    """Per-prompt metrics summed per (data source, variable); :meth:`reduce` averages them over
    every prompt of every data-parallel rank.

    ``sources`` and ``variables`` must be the same list on every rank (the dataset's data sources;
    ``reward`` plus the extras keys gathered from every rank)."""

    def __init__(self, sources: Sequence[str], variables: Sequence[str], n: int, device: torch.device) -> None:
        self.sources, self.variables, self.n = list(sources), list(variables), n
        self.names = metric_names(n)
        self.sums = torch.zeros(len(self.sources), len(self.variables), len(self.names), dtype=torch.float64,
                                device=device)
        self.counts = torch.zeros(len(self.sources), len(self.variables), dtype=torch.float64, device=device)

    def add_prompt(self, data_source: str, var: str, values: Sequence[float]) -> None:
        """One prompt's ``n`` values of ``var``; a prompt with a missing (NaN) value is left out."""
        if len(values) != self.n:
            raise ValueError(f"validation: {len(values)} responses of a prompt, expected {self.n}")
        if any(math.isnan(v) for v in values):
            return
        s, v = self.sources.index(data_source), self.variables.index(var)
        self.sums[s, v] += torch.tensor(prompt_metrics(values), dtype=torch.float64, device=self.sums.device)
        self.counts[s, v] += 1

    def reduce(self, group=None) -> dict[str, float]:
        """``val-core/...`` and ``val-aux/...`` means over every rank's prompts (one all-reduce)."""
        flat = torch.cat([self.sums.flatten(), self.counts.flatten()])
        if group is not None and group.size() > 1:
            dist.all_reduce(flat, group=group)
        sums = flat[:self.sums.numel()].view_as(self.sums).tolist()
        counts = flat[self.sums.numel():].view_as(self.counts).tolist()
        core_var = "acc" if "acc" in self.variables else "reward"
        out: dict[str, float] = {}
        for s, source in enumerate(self.sources):
            for v, var in enumerate(self.variables):
                if not counts[s][v]:
                    continue
                for m, name in enumerate(self.names):
                    out[metric_key(source, var, name, core_var, self.n)] = sums[s][v][m] / counts[s][v]
        return out


def core_keys(metrics: dict, n: Optional[int] = None) -> list[str]:
    """The ``val-core/<source>/<var>/mean@N`` keys of ``metrics`` (what a progress line or plot shows)."""
    return sorted(k for k in metrics if k.startswith("val-core/") and "/mean@" in k
                  and (n is None or k.endswith(f"@{n}")))
