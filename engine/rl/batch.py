"""A rank's rollout batch on its device, and how it is cut into micro-batches.

A rank holds only its data-parallel shard of the step's samples (:mod:`hyflow.rl.dispatch`):
``B`` rows, one sequence ``prompt + response`` each, right-padded to the shard's longest row.
Per-token quantities (log-probs, values, advantages) are aligned to the token they score, the
convention of :func:`hyflow.training.logprobs.shifted_token_logprobs`.

Micro-batches are planned on row lengths alone (pure functions, unit-tested without tensors):

* :func:`plan_fixed`: ``micro_batch_size`` rows each, in order;
* :func:`plan_sorted`: ``micro_batch_size`` rows each, rows of similar length together (what
  :class:`MicroBatching` uses for a fixed size: each micro-batch pads only to its own longest row,
  so sorting first wastes the least; the rows are put back in order by :func:`scatter_rows`);
* :func:`plan_token_budget`: rows grouped by length so that ``rows x longest row`` stays within a
  token budget (verl's dynamic batch size); each micro-batch is padded only to its own longest row;
* :func:`plan_packed`: several sequences concatenated into one row of at most the budget, each with
  its own positions and a block-diagonal causal attention mask (sequence packing).

Every plan can be stretched to a common micro-batch count (:func:`equalize`) so the data-parallel
ranks run the same number of micro-batches. :func:`make_micro_batches` builds the tensors,
:func:`scatter_rows` puts per-micro-batch outputs back in row order. Loss normalisation does not
depend on the grouping: losses are weighted per token with global denominators
(:mod:`hyflow.rl.step_losses`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hyflow.models.builder import resolve_spec
from hyflow.models.context_parallel import sequence_bounds, shard_micro_batch
from hyflow.models.lora import lora_spec

Plan = list[list[int]]  # rows of each micro-batch


@dataclass
class RolloutBatch:
    """This rank's rows, on its device.

    Attributes:
        tokens: [B, S] prompt + response, right-padded with the pad id.
        response_mask: [B, S] float, 1 on response tokens.
        rollout_logprobs: [B, S] log-probs the sampler reported (0 elsewhere).
        lengths: [B] prompt + response length of each row.
        prompt_lengths, response_lengths: [B].
        group_ids: [B] global index of the prompt each row answers (GRPO / RLOO groups).
        sample_ids: [B] index of the row among its prompt's samples.
        truncated: [B] bool, the response hit the length limit.
    """
    tokens: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    truncated: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def row_lengths(self) -> list[int]:
        """Host copy of ``lengths`` for planning micro-batches (one sync)."""
        return self.lengths.tolist()

    def response_positions(self) -> torch.Tensor:
        """[B, S] bool: every position after the prompt (``response_mask`` without its holes: a
        multi-turn trajectory's observations included), the layout of the data plane's log-probs."""
        cols = torch.arange(self.tokens.shape[1], device=self.device).unsqueeze(0)
        return (cols >= self.prompt_lengths.unsqueeze(1)) & (cols < self.lengths.unsqueeze(1))


def build_rollout_batch(flat_tokens: torch.Tensor, flat_logprobs: torch.Tensor, prompt_lengths: torch.Tensor,
                        response_lengths: torch.Tensor, group_ids: torch.Tensor, sample_ids: torch.Tensor,
                        truncated: torch.Tensor, pad_id: int = 0,
                        flat_mask: Optional[torch.Tensor] = None) -> RolloutBatch:
    """A padded batch from samples stored back to back: ``flat_tokens`` holds each row's prompt and
    response, ``flat_logprobs`` each row's response log-probs (the data plane's wire format).
    ``flat_mask`` (as ``flat_logprobs``): 0 on response tokens the sampler did not produce (a
    multi-turn trajectory's observations): they stay in the row, out of ``response_mask``.
    Built where the inputs are, without a host round trip."""
    device = flat_tokens.device
    lengths = prompt_lengths + response_lengths
    B = lengths.shape[0]
    S = int(lengths.max()) if B else 0
    cols = torch.arange(S, device=device).unsqueeze(0)
    starts = torch.cumsum(lengths, 0) - lengths
    valid = cols < lengths.unsqueeze(1)
    index = (starts.unsqueeze(1) + cols).clamp(max=max(flat_tokens.numel() - 1, 0))
    tokens = torch.where(valid, flat_tokens[index] if flat_tokens.numel() else index, pad_id)
    response = valid & (cols >= prompt_lengths.unsqueeze(1))
    lp_starts = torch.cumsum(response_lengths, 0) - response_lengths
    lp_index = (lp_starts.unsqueeze(1) + cols - prompt_lengths.unsqueeze(1)).clamp(
        min=0, max=max(flat_logprobs.numel() - 1, 0))
    logprobs = flat_logprobs[lp_index] if flat_logprobs.numel() else torch.zeros_like(lp_index, dtype=torch.float32)
    if flat_mask is not None and flat_mask.numel():
        response = response & (flat_mask[lp_index] > 0)
    return RolloutBatch(
        tokens=tokens.long(), response_mask=response.float(),
        rollout_logprobs=torch.where(response, logprobs.float(), 0.0),
        lengths=lengths, prompt_lengths=prompt_lengths, response_lengths=response_lengths,
        group_ids=group_ids, sample_ids=sample_ids, truncated=truncated)


# --------------------------------------------------------------------------- planning


def plan_fixed(n_rows: int, size: int) -> Plan:
    """``size`` rows per micro-batch in row order (the last one may be smaller)."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    return [list(range(s, min(s + size, n_rows))) for s in range(0, n_rows, size)]


def plan_sorted(lengths: Sequence[int], size: int) -> Plan:
    """``size`` rows per micro-batch, longest rows first (ties in row order): the same number of
    micro-batches as :func:`plan_fixed`, never more padding."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[s:s + size] for s in range(0, len(order), size)]


def plan_token_budget(lengths: Sequence[int], budget: int) -> Plan:
    """Rows grouped so that ``len(group) * longest row <= budget``: rows sorted by length, then cut
    into consecutive runs (the fewest micro-batches, and the least padding, for a padded layout). A
    row longer than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: Plan = []
    for row in order:
        if plan and (len(plan[-1]) + 1) * lengths[plan[-1][0]] <= budget:
            plan[-1].append(row)
        else:
            plan.append([row])
    return plan


def plan_packed(lengths: Sequence[int], budget: int) -> Plan:
    """Rows packed into micro-batches of at most ``budget`` tokens in total (first fit, longest rows
    first). A row longer than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: Plan = []
    used: list[int] = []
    for row in order:
        for b, total in enumerate(used):
            if total + lengths[row] <= budget:
                plan[b].append(row)
                used[b] += lengths[row]
                break
        else:
            plan.append([row])
            used.append(lengths[row])
    return plan


def plan_cost(plan: Plan, lengths: Sequence[int], packed: bool) -> list[int]:
    """Tokens each micro-batch processes, padding included."""
    if packed:
        return [sum(lengths[r] for r in rows) for rows in plan]
    return [len(rows) * max(lengths[r] for r in rows) for rows in plan]


def equalize(plan: Plan, count: int, lengths: Sequence[int], packed: bool) -> Plan:
    """``plan`` split until it has ``count`` micro-batches: the costliest micro-batch with more
    than one row is halved (never more padding). Empty micro-batches are not created: with fewer
    rows than ``count`` the plan stays shorter."""
    plan = [list(rows) for rows in plan if rows]
    while len(plan) < count:
        costs = plan_cost(plan, lengths, packed)
        splittable = [i for i, rows in enumerate(plan) if len(rows) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: (costs[j], -j))
        rows = plan.pop(i)
        half = len(rows) // 2
        plan[i:i] = [rows[:half], rows[half:]]
    return plan


# --------------------------------------------------------------------------- tensors


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def packed_attention_mask(seq_lengths: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """[1, 1, width, width] boolean, True where attention is *masked* (Megatron's convention):
    causal inside each sequence, nothing across sequences; padding attends to itself only."""
    segment = torch.full((width,), -1, dtype=torch.long, device=device)
    start = 0
    for i, n in enumerate(seq_lengths):
        segment[start:start + n] = i
        start += n
    pad = torch.arange(width, device=device) >= start
    segment = torch.where(pad, len(seq_lengths) + torch.arange(width, device=device), segment)
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return ~(same & causal).view(1, 1, width, width)


def make_micro_batches(columns: dict[str, torch.Tensor], lengths: Sequence[int], plan: Plan, *,
                       packed: bool = False, pad_multiple: int = 1, pad_id: int = 0, thd: bool = False,
                       bounds: bool = False) -> list[dict]:
    """The micro-batches of ``plan`` from per-row ``columns`` ([B, S] each; ``tokens`` among them).

    Unpacked: rows ``plan[i]``, cut to their longest row (rounded up to ``pad_multiple``, e.g. the
    TP size under sequence parallelism), positions ``0..s-1``. Packed: the rows' real tokens back
    to back in one row, per-sequence positions and a block-diagonal causal ``attention_mask``.
    Each micro-batch also records ``rows`` (and, packed, ``segments``: (row, start, length)) for
    :func:`scatter_rows`. ``thd``: packed rows for Transformer Engine's THD attention, which takes
    the sequence boundaries (``cu_seqlens``) instead of a mask and restarts positions itself.
    ``bounds``: a packed row's ``attention_mask`` is its sequences' bounds (1-D) instead of the
    ``s x s`` mask, for attention that runs per sequence (the SDPA spec).
    """
    device = columns["tokens"].device
    out = []
    for rows in plan:
        index = torch.tensor(rows, dtype=torch.long, device=device)
        if not packed:
            width = _round_up(max(lengths[r] for r in rows), pad_multiple)
            mb = {k: v[index, :width] for k, v in columns.items()}
            if mb["tokens"].shape[1] < width:  # rounding beyond the batch's width
                mb = {k: _pad_right(v, width, pad_id if k == "tokens" else 0) for k, v in mb.items()}
            mb["position_ids"] = torch.arange(width, device=device).unsqueeze(0).expand(len(rows), width)
            mb["rows"] = index
            out.append(mb)
            continue
        seq_lengths = [lengths[r] for r in rows]
        width = _round_up(sum(seq_lengths), pad_multiple)
        mb = {}
        for key, value in columns.items():
            parts = [value[r, :n] for r, n in zip(rows, seq_lengths)]
            fill = pad_id if key == "tokens" else 0
            mb[key] = _pad_right(torch.cat(parts).unsqueeze(0), width, fill)
        mb["position_ids"] = _pad_right(
            torch.cat([torch.arange(n, device=device) for n in seq_lengths]).unsqueeze(0), width, 0)
        if thd:
            bounds = [0]
            for n in seq_lengths + ([width - sum(seq_lengths)] if width > sum(seq_lengths) else []):
                bounds.append(bounds[-1] + n)  # the padding is a sequence of its own
            mb["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
            mb["max_seqlen"] = max(b - a for a, b in zip(bounds, bounds[1:]))
        elif bounds:

            mb["attention_mask"] = sequence_bounds(seq_lengths, width)  # on the host
        else:
            mb["attention_mask"] = packed_attention_mask(seq_lengths, width, device)
        mb["rows"] = index
        starts = [0]
        for n in seq_lengths[:-1]:
            starts.append(starts[-1] + n)
        mb["segments"] = list(zip(rows, starts, seq_lengths))
        mb["packed"] = True
        out.append(mb)
    return out


def _pad_right(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] >= width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1]) + tuple(t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def scatter_rows(outputs: Sequence[torch.Tensor], micro: Sequence[dict], shape: tuple[int, int]) -> torch.Tensor:
    """Per-row [B, S] tensor from per-micro-batch [b, s] ``outputs`` (zeros where no row reaches)."""
    first = outputs[0]
    result = torch.zeros(shape, dtype=first.dtype, device=first.device)
    for value, mb in zip(outputs, micro):
        if mb.get("packed"):
            for row, start, n in mb["segments"]:
                result[row, :n] = value[0, start:start + n]
        else:
            width = min(value.shape[1], shape[1])
            result[mb["rows"], :width] = value[:, :width]
    return result


@dataclass
class MicroBatching:
    """How a role cuts a batch: ``max_tokens`` None means ``micro_batch_size`` rows each; widths
    rounded up to ``pad_multiple`` (sequence and context parallelism); ``thd``: packed rows for
    TE's THD attention; ``cp_group``: each micro-batch becomes this context-parallel rank's
    label-aligned share (:func:`hyflow.models.context_parallel.shard_micro_batch`); planning
    (token budgets, packing) counts whole sequences."""
    micro_batch_size: int
    max_tokens: Optional[int] = None
    packed: bool = False
    pad_multiple: int = 1
    pad_id: int = 0
    thd: bool = False
    cp_group: Any = None
    bounds: bool = False

    @property
    def cp_size(self) -> int:
        return self.cp_group.size() if self.cp_group is not None else 1

    def cut(self, columns: dict[str, torch.Tensor], lengths: Sequence[int]) -> list[dict]:
        """The micro-batches of ``columns`` (per-row [B, S] tensors) under this policy."""
        micro = make_micro_batches(columns, lengths, self.plan(lengths), packed=self.packed,
                                   pad_multiple=self.pad_multiple, pad_id=self.pad_id, thd=self.thd,
                                   bounds=self.bounds)
        if self.cp_size > 1:

            micro = [shard_micro_batch(mb, self.cp_group) for mb in micro]
        return micro

    def plan(self, lengths: Sequence[int]) -> Plan:
        if self.max_tokens is None:  # packed too: micro_batch_size sequences per packed row
            return plan_fixed(len(lengths), self.micro_batch_size) if self.packed else \
                plan_sorted(lengths, self.micro_batch_size)
        if self.packed:
            return plan_packed(lengths, self.max_tokens)
        return plan_token_budget(lengths, self.max_tokens)


def pad_multiple(groups) -> int:
    """Micro-batch widths must divide: sequence parallelism shards the sequence over TP, context
    parallelism into ``2 cp`` chunks (and a CP rank's share over TP under both)."""
    layout = groups.layout
    tp = layout.tp if layout.sequence_parallel else 1
    return tp if layout.cp == 1 else layout.cp * math.lcm(2, tp)


def _thd(cfg) -> bool:
    """Packed rows go to Transformer Engine's THD attention when the model uses the TE spec."""
    return cfg.actor.pack_sequences and resolve_spec(lora_spec(cfg.actor.spec, cfg.actor.lora, cfg.critic.lora)) == "te"


def batching_for(cfg, role: str, groups, pad_id: int) -> MicroBatching:
    """How ``role`` of an RL job config (``actor`` update, ``reference`` / old-log-prob scoring and
    the reward model, ``critic``) cuts its rows."""
    actor = cfg.actor
    size, budget = actor.micro_batch_size, actor.max_tokens_per_micro_batch
    if role == "reference":
        size = cfg.reference.micro_batch_size or size
        budget = cfg.reference.max_tokens_per_micro_batch or budget
    elif role == "critic":
        size, budget = cfg.critic.micro_batch_size, cfg.critic.max_tokens_per_micro_batch or budget
    cp_group = groups.pgs.cp if groups.layout.cp > 1 else None

    return MicroBatching(size, budget, actor.pack_sequences, pad_multiple=pad_multiple(groups), pad_id=pad_id,
                         thd=_thd(cfg), cp_group=cp_group,
                         bounds=resolve_spec(lora_spec(actor.spec, actor.lora, cfg.critic.lora)) == "sdpa")
