"""Step metrics over the whole batch from each rank's shard: sums, maxima and minima, reduced
over the data-parallel group in three all-reduces of one vector each.

Names follow verl's, so dashboards carry over (``critic/score/mean``, ``actor/pg_clipfrac``,
``response_length/clip_ratio``, ``timing_s/gen``, ``perf/throughput``, ...); README's metric
table maps hyflow's earlier names to them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist


class BatchStats:
    """Collects per-rank partials; :meth:`reduce` turns them into whole-batch metrics.

    Every rank of the group must add the same names in the same order (they run the same code).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sums: dict[str, torch.Tensor] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._min: dict[str, torch.Tensor] = {}
        self._means: list[tuple[str, str, str]] = []  # (metric, numerator, denominator)
        self._totals: list[tuple[str, list[str], Callable[[dict], dict]]] = []

    def _value(self, value) -> torch.Tensor:
        return torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(())

    def add(self, name: str, value) -> None:
        """A partial sum (summed over ranks)."""
        self._sums[name] = self._sums.get(name, self._value(0.0)) + self._value(value)

    def extreme(self, name: str, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        """``name/max`` and ``name/min`` of ``values`` (where ``mask``; no value leaves them +-inf)."""
        v = values.detach().double()
        keep = torch.ones_like(v, dtype=torch.bool) if mask is None else mask.bool()
        self._max[f"{name}/max"] = torch.where(keep, v, -torch.inf).max() if v.numel() else self._value(-torch.inf)
        self._min[f"{name}/min"] = torch.where(keep, v, torch.inf).min() if v.numel() else self._value(torch.inf)

    def distribution(self, name: str, values: torch.Tensor, mask: Optional[torch.Tensor] = None,
                     std: bool = False) -> None:
        """``name/mean``, ``/max``, ``/min`` (and ``/std``) of ``values`` where ``mask``."""
        v = values.detach().double()
        m = torch.ones_like(v) if mask is None else mask.double()
        self.add(f"_{name}/sum", (v * m).sum())
        self.add(f"_{name}/count", m.sum())
        self._means.append((f"{name}/mean", f"_{name}/sum", f"_{name}/count"))
        if std:
            self.add(f"_{name}/sumsq", (v * v * m).sum())
        self.extreme(name, v, m)

    def mean(self, name: str, numerator, denominator) -> None:
        """``name`` = sum of ``numerator`` / sum of ``denominator`` over ranks."""
        self.add(f"_{name}/num", numerator)
        self.add(f"_{name}/den", denominator)
        self._means.append((name, f"_{name}/num", f"_{name}/den"))

    def row_totals(self, prefix: str, rows: dict[str, torch.Tensor], finish: Callable[[dict], dict]) -> None:
        """Per-row statistics (``[B]`` each) summed over every row of every rank (maximised for keys
        ending in ``_max``, which must be non-negative); :meth:`reduce` hands the totals to
        ``finish``, whose metrics it returns (e.g. :func:`hyflow.algorithms.mismatch.mismatch_metrics`)."""
        for key, value in rows.items():
            name = f"_{prefix}/{key}"
            v = value.detach().double()
            if key.endswith("_max"):
                self._max[name] = v.amax() if v.numel() else self._value(0.0)
            else:
                self.add(name, v.sum())
        self._totals.append((prefix, list(rows), finish))

    def reduce(self, group) -> dict[str, float]:
        out: dict[str, float] = {}
        for store, op in ((self._sums, dist.ReduceOp.SUM), (self._max, dist.ReduceOp.MAX),
                          (self._min, dist.ReduceOp.MIN)):
            if not store:
                continue
            names = list(store)
            vec = torch.stack([store[k] for k in names])
            if group is not None and group.size() > 1:
                dist.all_reduce(vec, op=op, group=group)
            out.update(zip(names, vec.tolist()))
        for name, num, den in self._means:
            out[name] = out[num] / out[den] if out[den] else 0.0
            base = name[:-len("/mean")] if name.endswith("/mean") else None
            if base and f"_{base}/sumsq" in out and out[den]:
                var = max(out[f"_{base}/sumsq"] / out[den] - out[name] ** 2, 0.0)
                out[f"{base}/std"] = var ** 0.5
        for prefix, keys, finish in self._totals:
            out.update(finish({k: out[f"_{prefix}/{k}"] for k in keys}))
        for key in [k for k in out if k.startswith("_")]:
            del out[key]
        for key in [k for k in out if k.endswith(("/max", "/min")) and abs(out[k]) == float("inf")]:
            out[key] = 0.0  # an empty selection
        return out


def all_gather_strings(strings: Iterable[str], group, device: torch.device) -> list[str]:
    """The sorted union of every rank's ``strings`` (as uint8 tensors, not pickled objects)."""
    mine = sorted(set(strings))
    if group is None or group.size() == 1:
        return mine
    data = torch.tensor(list("\0".join(mine).encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    sizes = [torch.empty_like(size) for _ in range(group.size())]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    union: set[str] = set()
    for part, n in zip(parts, sizes):
        text = bytes(part[:int(n)].tolist()).decode()
        union.update(s for s in text.split("\0") if s)
    return sorted(union)


def score_metrics(stats: BatchStats, scores: torch.Tensor, sources: Sequence[str],
                  known_sources: Sequence[str], extras: dict[str, Sequence[float]]) -> None:
    """``critic/score/*`` (and per data source when there are several), ``reward_extra/<key>``."""
    stats.distribution("critic/score", scores, std=True)
    if len(known_sources) > 1:
        for src in known_sources:
            sel = torch.tensor([s == src for s in sources], dtype=torch.float64, device=scores.device)
            stats.mean(f"critic/score/{src}/mean", (scores.double() * sel).sum(), sel.sum())
    for key, values in extras.items():
        v = torch.tensor(values, dtype=torch.float64, device=scores.device)
        finite = ~torch.isnan(v)
        stats.mean(f"reward_extra/{key}", torch.where(finite, v, 0.0).sum(), finite.sum())
