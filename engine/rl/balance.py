"""Even work per data-parallel rank in an update: rows move between DP ranks inside each mini-batch.

A DP rank trains on its own prompts' samples, and responses of 1 to 64 tokens make one rank's
share of a mini-batch much longer than another's; the gradient all-reduce then waits for the
slowest rank. Before an epoch's mini-batches, rows are re-dealt so that every rank holds about the
same number of tokens of every mini-batch (verl's ``balance_batch`` does the same before its
update):

1. every rank all-gathers, over its DP group only, each of its rows' length and mini-batch
   (``2 x rows`` integers per rank);
2. :func:`balance_plan` (pure, the same result on every rank, unit-tested without process
   groups) deals each mini-batch's rows longest first to the rank with the fewest tokens that
   still has room, every rank keeping its count of rows per mini-batch;
3. :func:`exchange_rows` moves the rows as tensors, one ``all_to_all_single`` per column.

Mini-batch membership and the loss weights (global token counts per mini-batch) do not change,
so the update equals the unbalanced one up to floating-point summation order. Model-parallel peers
(TP / PP / CP ranks of one DP rank) hold the same rows and make the same exchange in their own DP
groups.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

#: (source DP rank, row index on that rank)
Source = tuple[int, int]


def balance_plan(lengths: Sequence[Sequence[int]], assign: Sequence[Sequence[int]],
                 n_minibatches: int) -> list[list[Source]]:
    """The rows each DP rank should hold, as ``(source rank, source row)`` in mini-batch order.

    ``lengths[r][i]`` / ``assign[r][i]``: the length and mini-batch of row ``i`` of rank ``r``.
    Every rank ends with as many rows of each mini-batch as it started with; within a mini-batch
    rows go longest first to the least-loaded rank with room (ties: the row's own rank, then the
    lowest rank), so no row moves without need.
    """
    dp = len(lengths)
    out: list[list[Source]] = [[] for _ in range(dp)]
    for k in range(n_minibatches):
        rows = [(lengths[r][i], r, i) for r in range(dp) for i in range(len(lengths[r])) if assign[r][i] == k]
        room = [sum(1 for a in assign[r] if a == k) for r in range(dp)]
        load = [0] * dp
        for length, r, i in sorted(rows, key=lambda t: (-t[0], t[1], t[2])):
            d = min((d for d in range(dp) if room[d] > 0), key=lambda d: (load[d], d != r, d))
            room[d] -= 1
            load[d] += length
            out[d].append((r, i))
    return out


def _gather_meta(lengths: Sequence[int], assign: Sequence[int], width: int, group, device) -> torch.Tensor:
    """[dp, 2 B + 1] int64: every rank's row lengths, mini-batches and column width."""
    mine = torch.tensor(list(lengths) + list(assign) + [width], dtype=torch.long, device=device)
    out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.long, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)  # flat: gloo takes no [dp, n] output
    return out.view(-1, mine.numel())


def exchange_rows(columns: dict[str, torch.Tensor], plan: list[list[Source]], rank: int, width: int,
                  group) -> dict[str, torch.Tensor]:
    """This rank's rows of ``plan`` ([B', width] per [B, S] column; per-row [B] columns as they are):
    each source sends each destination the rows it is owed in the destination's order, one
    ``all_to_all_single`` per column."""
    dp = len(plan)
    send_rows = [[i for src, i in plan[d] if src == rank] for d in range(dp)]
    recv_counts = [sum(1 for src, _ in plan[rank] if src == s) for s in range(dp)]
    # the received buffer is grouped by source, in each source's send order: where plan[rank] sits in it
    starts = [sum(recv_counts[:s]) for s in range(dp)]
    seen = [0] * dp
    order = []
    for src, _ in plan[rank]:
        order.append(starts[src] + seen[src])
        seen[src] += 1
    device = next(iter(columns.values())).device
    send_index = torch.tensor([i for rows in send_rows for i in rows], dtype=torch.long, device=device)
    order_t = torch.tensor(order, dtype=torch.long, device=device)
    out = {}
    for name, value in columns.items():
        if value.dim() > 1 and value.shape[1] < width:  # a common width for the exchange
            value = torch.cat([value, value.new_zeros((value.shape[0], width - value.shape[1]) + value.shape[2:])], 1)
        send = value.index_select(0, send_index).contiguous()
        recv = value.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
        dist.all_to_all_single(recv, send, output_split_sizes=recv_counts,
                               input_split_sizes=[len(r) for r in send_rows], group=group)
        out[name] = recv.index_select(0, order_t)
    return out


def balance_rows(columns: dict[str, torch.Tensor], lengths: Sequence[int], assign: Sequence[int],
                 n_minibatches: int, group) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    """``(columns, lengths, assign)`` of this rank after the DP ranks re-deal each mini-batch's rows
    (see the module docstring)."""
    rank = dist.get_rank(group)
    device = columns["response_mask"].device
    B = len(lengths)
    width = columns["response_mask"].shape[1]
    meta = _gather_meta(lengths, assign, width, group, device).tolist()
    all_lengths = [row[:B] for row in meta]
    all_assign = [row[B:2 * B] for row in meta]
    plan = balance_plan(all_lengths, all_assign, n_minibatches)
    width = max(row[2 * B] for row in meta)
    moved = exchange_rows(columns, plan, rank, width, group)
    return moved, [all_lengths[s][i] for s, i in plan[rank]], [all_assign[s][i] for s, i in plan[rank]]
