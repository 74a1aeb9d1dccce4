"""Token balance over data-parallel ranks in an update (``actor.balance_batch``): the planner keeps
every mini-batch's rows and each rank's row count per mini-batch while evening out tokens, and the
exchange hands each rank exactly the rows of the plan. That the balanced DP=2 update equals the
one-rank one is ``test_rl_data_plane.py::test_dp2_and_tp2_equal_one_rank`` (balance is the default:
3 steps of 2 epochs, <= 1e-5 relative)."""

import random

import pytest
import torch

from hyflow.rl.balance import balance_plan
from hyflow.testing import run_on_ranks


def _loads(plan, lengths, assign, k):
    return [sum(lengths[s][i] for s, i in rows if assign[s][i] == k) for rows in plan]


@pytest.mark.parametrize("dp,rows,M", [(2, 16, 1), (2, 16, 4), (4, 8, 2), (3, 12, 3)])
def test_plan_keeps_minibatches_and_evens_out_tokens(dp, rows, M):
    rng = random.Random(dp * 100 + rows + M)
    lengths = [[rng.randint(1, 64) for _ in range(rows)] for _ in range(dp)]
    lengths[0] = [length + 40 for length in lengths[0]]  # rank 0 drew the long responses
    assign = [[(i + r) % M for i in range(rows)] for r in range(dp)]
    plan = balance_plan(lengths, assign, M)
    flat = sorted(src for rows_of in plan for src in rows_of)
    assert flat == sorted((r, i) for r in range(dp) for i in range(rows))  # every row once
    for k in range(M):
        for d in range(dp):  # each rank keeps its count of rows of mini-batch k
            assert sum(1 for s, i in plan[d] if assign[s][i] == k) == sum(1 for a in assign[d] if a == k)
        before = [sum(lengths[r][i] for i in range(rows) if assign[r][i] == k) for r in range(dp)]
        after = _loads(plan, lengths, assign, k)
        longest = max(lengths[r][i] for r in range(dp) for i in range(rows) if assign[r][i] == k)
        assert max(after) - min(after) <= longest  # within one row of even
        assert max(after) < max(before)  # the slowest rank got lighter
    # mini-batch order: a rank's rows come mini-batch by mini-batch
    for rows_of in plan:
        ks = [assign[s][i] for s, i in rows_of]
        assert ks == sorted(ks)


def test_plan_moves_nothing_when_already_even():
    lengths = [[5, 9, 9, 5], [9, 5, 5, 9]]
    assign = [[0, 0, 1, 1], [0, 0, 1, 1]]
    plan = balance_plan(lengths, assign, 2)
    assert all(s == r for r, rows in enumerate(plan) for s, _ in rows)


def _exchange_and_update():
    import torch.distributed as dist

    from hyflow.rl.balance import balance_rows

    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    lengths = [[30, 28, 25, 22, 20, 19], [3, 4, 2, 5, 6, 3]][rank]  # rank 0 holds the long rows
    width = max(lengths) + 2
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        tokens[i, :n] = 1000 * rank + 10 * i + torch.arange(1, n + 1)  # each row tells where it came from
        mask[i, 1:n] = 1.0
    assign = [0, 1, 0, 1, 0, 1]
    cols, new_lengths, new_assign = balance_rows({"tokens": tokens, "response_mask": mask}, lengths, assign, 2,
                                                 group)
    return lengths, cols, new_lengths, new_assign


@pytest.mark.multirank
def test_exchange_delivers_the_planned_rows():
    results = run_on_ranks(_exchange_and_update, 2)
    lengths = [r[0] for r in results]
    assign = [[0, 1, 0, 1, 0, 1]] * 2
    plan = balance_plan(lengths, assign, 2)
    for d, (_, cols, new_lengths, new_assign) in enumerate(results):
        assert new_lengths == [lengths[s][i] for s, i in plan[d]]
        assert new_assign == [assign[s][i] for s, i in plan[d]]
        for row, (s, i) in enumerate(plan[d]):
            n = lengths[s][i]
            want = 1000 * s + 10 * i + torch.arange(1, n + 1)
            assert torch.equal(cols["tokens"][row, :n], want)
            assert float(cols["response_mask"][row].sum()) == n - 1
            assert int(cols["tokens"][row, n:].abs().sum()) == 0
    tokens = [sum(r[2]) for r in results]
    assert abs(tokens[0] - tokens[1]) < abs(sum(lengths[0]) - sum(lengths[1])) / 4  # 124 vs 23 before
