"""Per-step communication statistics: seconds and bytes per collective kind and per group kind.

While installed, the ``torch.distributed`` collective functions are wrapped; every call is
charged to its *op* (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
``p2p``, ``all_to_all``, ``barrier``) and to the *kind* of its process group, which the code
that creates groups declares once::

    from hyflow.monitor import comm
    comm.register_group(group, "dp")          # or comm.register_collection(pg_collection)
    comm.install()                            # once, before the loop
    ...
    metrics.update(comm.step_summary())       # after each step: comm/<op>/seconds|bytes, ...

Group kinds: ``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``mp`` (Megatron's model-parallel group,
used for the gradient norm), ``reshard`` (the hybrid engine's merge groups), ``data`` (the data
plane), ``world`` (the default group) and ``other`` (a group nobody registered).

Bytes, per rank, per call:

* ``all_reduce`` and ``broadcast``: the buffer (nccl-tests' "size"); a DP gradient all-reduce
  counts the gradient buffer once;
* ``all_gather``: the bytes that arrive from the other ranks (output minus own input);
  ``reduce_scatter``: the bytes that leave for the other ranks (input minus own output) -- the
  quantities the reshard planner counts;
* ``p2p``: the message; ``barrier``: 0. A group of one rank moves nothing and counts 0.

Seconds are the time the calling rank spends in the call (for ``async_op=True``, in the
``wait()`` of the returned handle; for Megatron's coalesced bucket reductions, in the
coalescing manager's exit or its ``wait()``): the communication the step waits for, not
communication hidden behind compute. On CUDA, synchronous calls are timed with CUDA events on
the current stream, resolved at :func:`step_summary`, but not every call: per step, the first
:data:`EVENTS_PER_STEP` calls of each (op, group kind) get events and the others are charged the
mean of those; inside :func:`untimed` (the generation's decode loop: two TP all-reduces per layer
per token) calls are counted with their bytes and get no events at all (the phase's own timer
has their time).

Transfers that bypass ``torch.distributed`` (the hybrid engine's shared-memory transport)
are charged with :func:`transfer`; collectives made inside it are not charged again.
A call that raises an error mentioning a timeout increments ``comm/timeouts`` (NCCL with
asynchronous error handling aborts the process instead; the count then never leaves it).

The wrapper costs a few microseconds per call (``hyflow bench rl`` reports the measured
overhead as a share of the step). Statistics are this rank's; rank 0 logs them.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hyflow.monitor.comm_groups import GROUP_KINDS, forget_groups, group_kind, register_collection, register_group

__all__ = ["OPS", "GROUP_KINDS", "register_group", "register_collection", "forget_groups", "group_kind", "install",
           "uninstall", "installed", "step_summary", "transfer", "totals", "untimed", "wrapper_overhead"]

#: CUDA-event-timed calls per (op, group kind) per step; the others are charged their mean
EVENTS_PER_STEP = 16
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all", "barrier")
#: The ops every summary reports, even at zero (stable TensorBoard curves).
MAIN_OPS = OPS[:5]
# ------------------------------------------------------------------------- statistics

class _Stats:
    """Calls, seconds and bytes per (op, group kind) since the last summary."""

    def __init__(self) -> None:
        self.table: dict[tuple[str, str], list] = {}
        self.pending_events: list = []   # (op, kind, start event, end event) on CUDA
        self.events_used: dict[tuple[str, str], int] = {}  # CUDA-timed calls this step
        self.event_seconds: dict[tuple[str, str], float] = {}
        self.not_timed: dict[tuple[str, str], int] = {}  # CUDA calls beyond the budget, outside untimed()
        self.timeouts = 0
        self.kinds_seen: set[str] = set()
        self.sizes: dict[int, int] = {}  # id(group) -> size
        self.total_calls = 0

    def add(self, op: str, kind: str, seconds: float, nbytes: int, calls: int = 1) -> None:
        row = self.table.get((op, kind))
        if row is None:
            row = self.table[(op, kind)] = [0, 0.0, 0]
            self.kinds_seen.add(kind)
        row[0] += calls
        row[1] += seconds
        row[2] += nbytes
        self.total_calls += calls


_STATS = _Stats()
# Per thread: > 0 inside a charged call, whose nested collectives are not charged again (a
# background thread's collectives are charged on their own).
_NESTING = threading.local()


def _depth() -> int:
    return getattr(_NESTING, "depth", 0)


def _enter(step: int) -> None:
    _NESTING.depth = _depth() + step


def _untimed_depth() -> int:
    return getattr(_NESTING, "untimed", 0)


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Collectives in the block are counted (calls, bytes) but not timed on CUDA: no events for
    the many small calls of a loop whose whole time a phase timer measures."""
    _NESTING.untimed = _untimed_depth() + 1
    try:
        yield
    finally:
        _NESTING.untimed = _untimed_depth() - 1


def _new_events() -> tuple:
    """A (start, end) pair of timing CUDA events."""
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
_ACTIVE = [False]  # the wrappers charge calls only while installed
_PATCHED: list[tuple[Any, str, Any]] = []   # (owner, attribute, original)


def _size(group: Any) -> int:
    size = _STATS.sizes.get(id(group))
    if size is None:
        size = _STATS.sizes[id(group)] = dist.get_world_size(group)
    return size


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


# Per op: (group argument position, bytes of a call given (args, kwargs, group size)).
def _arg(args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name)


def _bytes_buffer(args, kwargs, n):  # all_reduce, broadcast: the buffer
    return _nbytes(_arg(args, kwargs, 0, "tensor")) if n > 1 else 0


def _bytes_gather_list(args, kwargs, n):  # all_gather(tensor_list, tensor)
    return (n - 1) * _nbytes(_arg(args, kwargs, 1, "tensor"))


def _bytes_gather_tensor(args, kwargs, n):  # all_gather_into_tensor(output, input)
    return _nbytes(_arg(args, kwargs, 0, "output_tensor")) - _nbytes(_arg(args, kwargs, 1, "input_tensor"))


def _bytes_scatter_list(args, kwargs, n):  # reduce_scatter(output, input_list)
    return (n - 1) * _nbytes(_arg(args, kwargs, 0, "output"))


def _bytes_scatter_tensor(args, kwargs, n):  # reduce_scatter_tensor(output, input)
    return _nbytes(_arg(args, kwargs, 1, "input")) - _nbytes(_arg(args, kwargs, 0, "output"))


def _bytes_p2p(args, kwargs, n):
    return _nbytes(_arg(args, kwargs, 0, "tensor"))


def _bytes_all_to_all(args, kwargs, n):  # all_to_all_single(output, input): what leaves
    return _nbytes(_arg(args, kwargs, 1, "input")) * (n - 1) // max(n, 1)


def _bytes_batch_p2p(args, kwargs, n):
    return sum(_nbytes(op.tensor) for op in _arg(args, kwargs, 0, "p2p_op_list"))


def _zero(args, kwargs, n):
    return 0


#: function name -> (op, keyword of its group argument, position of the group argument, bytes)
_WRAPPED: dict[str, tuple[str, str, int, Callable]] = {
    "all_reduce": ("all_reduce", "group", 2, _bytes_buffer),
    "broadcast": ("broadcast", "group", 2, _bytes_buffer),
    "all_gather": ("all_gather", "group", 2, _bytes_gather_list),
    "all_gather_into_tensor": ("all_gather", "group", 2, _bytes_gather_tensor),
    "_all_gather_base": ("all_gather", "group", 2, _bytes_gather_tensor),
    "reduce_scatter": ("reduce_scatter", "group", 3, _bytes_scatter_list),
    "reduce_scatter_tensor": ("reduce_scatter", "group", 3, _bytes_scatter_tensor),
    "_reduce_scatter_base": ("reduce_scatter", "group", 3, _bytes_scatter_tensor),
    "all_to_all_single": ("all_to_all", "group", 4, _bytes_all_to_all),
    "send": ("p2p", "group", 2, _bytes_p2p),
    "recv": ("p2p", "group", 2, _bytes_p2p),
    "isend": ("p2p", "group", 2, _bytes_p2p),
    "irecv": ("p2p", "group", 2, _bytes_p2p),
    "batch_isend_irecv": ("p2p", "", -1, _bytes_batch_p2p),
    "barrier": ("barrier", "group", 0, _zero),
}


def _coalescing() -> bool:
    """True inside a ``_coalescing_manager`` block (calls are queued, not run)."""
    return bool(getattr(_C10D_WORLD[0], "pg_coalesce_state", None))


_C10D_WORLD: list = [None]  # torch.distributed.distributed_c10d._world, set by install()


class _TimedWork:
    """An async handle whose ``wait()`` time is charged to its call (bytes were charged when
    the call was made)."""

    def __init__(self, work: Any, op: str, kind: str) -> None:
        self._work, self._op, self._kind = work, op, kind

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as exc:
            if _is_timeout(exc):
                _STATS.timeouts += 1
            raise
        finally:
            _STATS.add(self._op, self._kind, time.perf_counter() - start, 0, calls=0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _group_of(args: tuple, kwargs: dict, name: str, key: str, pos: int) -> Any:
    if name == "batch_isend_irecv":
        ops = _arg(args, kwargs, 0, "p2p_op_list")
        return getattr(ops[0], "group", None) if ops else None
    return args[pos] if len(args) > pos else kwargs.get(key)


def _cuda_tensor(args: tuple) -> Any:
    first = args[0] if args else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
        first = getattr(first, "tensor", first)  # a P2POp
    return first if getattr(first, "is_cuda", False) else None


def _wrap(name: str, original: Callable) -> Callable:
    op, key, pos, count = _WRAPPED[name]

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stats = _STATS
        if not _ACTIVE[0] or _depth():
            return original(*args, **kwargs)
        group = _group_of(args, kwargs, name, key, pos)
        kind = group_kind(group)
        try:
            nbytes = max(int(count(args, kwargs, _size(group))), 0)
        except Exception:  # noqa: BLE001 - never let accounting break a collective
            nbytes = 0
        cuda = _cuda_tensor(args) if name != "barrier" else None
        events = None
        if cuda is not None and not _untimed_depth():
            used = stats.events_used.get((op, kind), 0)
            if used < EVENTS_PER_STEP:
                stats.events_used[(op, kind)] = used + 1
                events = _new_events()
                events[0].record()
        _enter(1)
        start = time.perf_counter()
        try:
            result = original(*args, **kwargs)
        except Exception as exc:
            if _is_timeout(exc):
                stats.timeouts += 1
            raise
        finally:
            _enter(-1)
        seconds = time.perf_counter() - start
        if _coalescing():  # queued: the fused collective is timed by the coalescing manager
            stats.add(op, kind, seconds, nbytes)
            return result
        async_op = kwargs.get("async_op") or name in ("isend", "irecv", "batch_isend_irecv")
        if async_op and result is not None:  # the time is charged when it is waited for
            stats.add(op, kind, seconds, nbytes)
            if isinstance(result, list):
                return [_TimedWork(w, op, kind) for w in result]
            return _TimedWork(result, op, kind)
        if events is not None:
            events[1].record()
            stats.pending_events.append((op, kind, nbytes, events))
        elif cuda is not None:  # counted; charged the timed calls' mean at the summary (none in untimed())
            stats.add(op, kind, 0.0, nbytes)
            if not _untimed_depth():
                stats.not_timed[(op, kind)] = stats.not_timed.get((op, kind), 0) + 1
        else:
            stats.add(op, kind, seconds, nbytes)
        return result

    wrapper.__hyflow_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _wrap_coalescing(original: Callable) -> Callable:
    """``_coalescing_manager``: the queued calls are charged their bytes when made; the time
    of the fused collective (the manager's exit, or its ``wait()``) goes to the same op."""

    @contextlib.contextmanager
    def manager(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[Any]:
        if not _ACTIVE[0] or _depth():
            with original(group, device, async_ops) as handle:
                yield handle
            return
        before = {k: v[0] for k, v in _STATS.table.items()}
        cm = original(group, device, async_ops)
        handle = cm.__enter__()
        try:
            yield handle
        except BaseException:
            if not cm.__exit__(*sys.exc_info()):
                raise
            return
        queued = [k for k, v in _STATS.table.items() if v[0] != before.get(k, 0)]
        start = time.perf_counter()
        cm.__exit__(None, None, None)
        if not queued:
            return
        op, kind = queued[-1]
        _STATS.add(op, kind, time.perf_counter() - start, 0, calls=0)
        works = getattr(handle, "works", None)
        if async_ops and works:
            handle.works = [_TimedWork(w, op, kind) for w in works]

    manager.__hyflow_original__ = original  # type: ignore[attr-defined]
    return manager


def patch_everywhere(replacements: dict[int, Callable], skip: Any = None) -> list[tuple[Any, str, Any]]:
    """Replace functions by their wrappers in every loaded module that holds them (``torch.distributed``,
    ``distributed_c10d`` itself, and modules that imported one by name). ``replacements`` maps
    ``id(original)`` to a wrapper carrying ``__hyflow_original__``; returns ``(module, attribute,
    original)`` of each replacement, for :func:`unpatch`."""
    patched = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or module is skip:
            continue
        for attr, value in list(namespace.items()):
            new = replacements.get(id(value))
            if new is not None and getattr(new, "__hyflow_original__", None) is value:
                patched.append((module, attr, value))
                setattr(module, attr, new)
    return patched


def unpatch(patched: list[tuple[Any, str, Any]]) -> None:
    while patched:
        owner, attr, original = patched.pop()
        setattr(owner, attr, original)


def installed() -> bool:
    """True while the collectives are wrapped."""
    return _ACTIVE[0]


def install() -> None:
    """Wrap the collectives in ``torch.distributed`` and in every loaded module that imported
    one by name (``from torch.distributed import _coalescing_manager``). Idempotent."""
    if _PATCHED:
        return
    _C10D_WORLD[0] = c10d._world
    replacements: dict[int, Callable] = {}
    for name in _WRAPPED:
        original = getattr(c10d, name, None)
        if original is not None:
            replacements[id(original)] = _wrap(name, original)
    coalescing = getattr(c10d, "_coalescing_manager", None)
    if coalescing is not None:
        replacements[id(coalescing)] = _wrap_coalescing(coalescing)
    _PATCHED.extend(patch_everywhere(replacements, skip=sys.modules[__name__]))
    _STATS.__init__()
    _ACTIVE[0] = True


def uninstall() -> None:
    """Put the original functions back."""
    _ACTIVE[0] = False
    unpatch(_PATCHED)


@contextlib.contextmanager
def transfer(op: str, group: Any) -> Iterator["_Transfer"]:
    """Charge a transfer made outside ``torch.distributed`` (set ``.nbytes`` inside the block)
    to ``op`` and ``group``'s kind; collectives called inside are not charged again."""
    xfer = _Transfer()
    if not _ACTIVE[0] or _depth():
        yield xfer
        return
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}")
    _enter(1)
    start = time.perf_counter()
    try:
        yield xfer
    finally:
        _enter(-1)
    _STATS.add(op, group_kind(group), time.perf_counter() - start, int(xfer.nbytes))


class _Transfer:
    nbytes: int = 0


def _resolve_events() -> None:
    pending, _STATS.pending_events = _STATS.pending_events, []
    for op, kind, nbytes, (start, end) in pending:
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        _STATS.event_seconds[(op, kind)] = _STATS.event_seconds.get((op, kind), 0.0) + seconds
        _STATS.add(op, kind, seconds, nbytes)
    for key, n in _STATS.not_timed.items():  # calls beyond the event budget: the timed calls' mean
        timed = _STATS.events_used.get(key, 0)
        if timed:
            _STATS.add(*key, n * _STATS.event_seconds.get(key, 0.0) / timed, 0, calls=0)
    _STATS.not_timed = {}


def totals() -> dict[tuple[str, str], tuple[int, float, int]]:
    """``(op, kind) -> (calls, seconds, bytes)`` since the last summary."""
    _resolve_events()
    return {k: tuple(v) for k, v in _STATS.table.items()}  # type: ignore[misc]


def step_summary(reset: bool = True) -> dict[str, float]:
    """Metrics since the last call: ``comm/<op>/seconds|bytes`` (the main ops always, others
    when used), ``comm/<kind>/seconds|bytes`` for every kind seen in the run,
    ``comm/seconds``, ``comm/bytes``, ``comm/calls`` and ``comm/timeouts`` (cumulative).
    Empty when the monitor is not installed."""
    if not _ACTIVE[0]:
        return {}
    _resolve_events()
    by_op: dict[str, list] = {op: [0.0, 0] for op in MAIN_OPS}
    by_kind: dict[str, list] = {kind: [0.0, 0] for kind in sorted(_STATS.kinds_seen)}
    calls = 0
    for (op, kind), (n, seconds, nbytes) in _STATS.table.items():
        for acc in (by_op.setdefault(op, [0.0, 0]), by_kind[kind]):
            acc[0] += seconds
            acc[1] += nbytes
        calls += n
    out: dict[str, float] = {}
    for name, (seconds, nbytes) in list(by_op.items()) + list(by_kind.items()):
        out[f"comm/{name}/seconds"] = seconds
        out[f"comm/{name}/bytes"] = float(nbytes)
    out["comm/seconds"] = sum(v[0] for v in by_op.values())
    out["comm/bytes"] = float(sum(v[1] for v in by_op.values()))
    out["comm/calls"] = float(calls)
    out["comm/timeouts"] = float(_STATS.timeouts)
    if reset:
        _STATS.table, _STATS.events_used, _STATS.event_seconds = {}, {}, {}
    return out


def wrapper_overhead(calls: int = 20000) -> float:
    """CPU seconds the wrapper adds to one call: a wrapped no-op minus the bare no-op, best of 5,
    in process CPU time so that other processes on a busy machine do not count (what ``hyflow
    bench rl`` multiplies by the step's calls to get the monitor's share of the step)."""
    _WRAPPED["_hyflow_probe"] = ("barrier", "group", 0, _zero)
    clock = time.process_time

    def probe(group: Any = None) -> None:
        return None

    active = _ACTIVE[0]
    _ACTIVE[0] = True
    try:
        wrapped = _wrap("_hyflow_probe", probe)
        group = object()
        _STATS.sizes[id(group)] = 2
        saved = _STATS.table, _STATS.total_calls, set(_STATS.kinds_seen)
        best = float("inf")
        for _ in range(5):
            t0 = clock()
            for _ in range(calls):
                probe(group)
            t1 = clock()
            for _ in range(calls):
                wrapped(group)
            t2 = clock()
            best = min(best, ((t2 - t1) - (t1 - t0)) / calls)
        _STATS.table, _STATS.total_calls, _STATS.kinds_seen = saved
        _STATS.sizes.pop(id(group), None)
        return max(best, 0.0)
    finally:
        _ACTIVE[0] = active
        _WRAPPED.pop("_hyflow_probe", None)
