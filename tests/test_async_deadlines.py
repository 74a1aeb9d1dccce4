"""How ``trainer.mode: async`` forms training batches from completed GRPO groups
(:meth:`hyflow.jobs.fully_async.AsyncGeneration._form`), on scripted schedules: no model, no ranks.

A group's deadline is the last batch it may land in (its oldest token's version + k + 1). The first
streaming rule filled batches in completion order and dropped a group that missed its deadline: the long
ones, which biased a length task toward short answers. The deadline rule makes a batch wait for a running
group that would otherwise be left without a place, and still drops (and counts) what cannot fit.
"""
from types import SimpleNamespace

from hyflow.jobs.fully_async import AsyncGeneration, Group

N = 2  # samples per group


def _replica(k: int, share: int, received: int = 0, formed: int = 0) -> AsyncGeneration:
    gen = object.__new__(AsyncGeneration)  # the forming state only: no engine, no training pool
    gen.k, gen.share, gen.total, gen.received, gen.formed = k, share, 100, received, formed
    gen.groups, gen.completed, gen.unbatched, gen.batches, gen.drops, gen.dropped = {}, [], [], {}, {}, 0
    return gen


def _start(gen: AsyncGeneration, origin: int, index: int, version: int) -> Group:
    """A running group whose samples have each sampled one token with ``w_version``."""
    group = Group(origin, index, index, [SimpleNamespace(versions=[version]) for _ in range(N)])
    gen.groups[group.key] = group
    return group


def _finish(gen: AsyncGeneration, group: Group, at: int) -> None:
    group.done_at = at
    gen.completed.append(group)
    gen._form()


def _staleness_ok(gen: AsyncGeneration) -> None:
    for t, batch in gen.batches.items():
        assert all((t - 1) - g.oldest(t) <= gen.k for g in batch), t


def test_a_short_late_group_does_not_take_the_place_of_two_long_earlier_ones():
    """k = 2, one group per batch. Batch 1 is sent; the groups a, b (first tokens w_0: deadline batch 3)
    run long, and c, started after w_1 (deadline 4), completes first. Completion order would make c
    batch 2, then a or b batch 3 and the other one dropped. The deadline rule makes batch 2 wait: a
    and b due by batch 3 need both places of batches 2-3."""
    gen = _replica(k=2, share=1, received=1, formed=1)
    a, b, c = _start(gen, 1, 1, 0), _start(gen, 1, 2, 0), _start(gen, 2, 0, 1)
    _finish(gen, c, at=10)
    assert gen.formed == 1  # batch 2 waits
    _finish(gen, b, at=20)
    assert gen.formed == 2 and gen.batches[2] == [b]  # b has the earlier deadline
    _finish(gen, a, at=30)
    assert [gen.batches[t] for t in (3, 4)] == [[a], [c]]
    assert gen.dropped == 0 and gen.drops == {}
    _staleness_ok(gen)


def test_a_batch_forms_without_waiting_when_every_running_group_has_a_place():
    """k = 2, two groups per batch: the long group (deadline 3) leaves batches 1-2 to the short ones
    (formed as soon as two are complete), then batch 3 waits for it rather than take two later groups."""
    gen = _replica(k=2, share=2)
    long = _start(gen, 1, 0, 0)
    short = [_start(gen, 1, i, 0) for i in (1, 2, 3, 4)]
    for at, g in enumerate(short, 1):
        _finish(gen, g, at)
    assert gen.formed == 2 and [g.index for t in (1, 2) for g in gen.batches[t]] == [1, 2, 3, 4]
    _finish(gen, _start(gen, 2, 0, 1), at=6)  # started after w_1: deadline 4
    _finish(gen, _start(gen, 2, 1, 1), at=7)
    assert gen.formed == 2  # batch 3 waits for the long group, due by then
    _finish(gen, long, at=9)
    assert gen.formed == 3 and [g.key for g in gen.batches[3]] == [(1, 0), (2, 0)]
    _staleness_ok(gen)


def test_what_cannot_fit_is_still_dropped_and_counted():
    """k = 1, one group per batch, three completed groups with w_0 tokens (deadline batch 2; more than
    the admission bound lets start, as after a resume with a smaller k): two are trained on, the third
    is dropped when batch 3 forms, its samples counted against it."""
    gen = _replica(k=1, share=1)
    groups = [_start(gen, 1, i, 0) for i in range(3)]
    for at, g in enumerate(groups, 1):
        g.done_at = at
        gen.completed.append(g)
    gen._form()
    assert [gen.batches[t] for t in (1, 2)] == [[groups[0]], [groups[1]]]
    assert gen.dropped == 1 and gen.drops == {3: N} and groups[2].key not in gen.groups
    _staleness_ok(gen)
