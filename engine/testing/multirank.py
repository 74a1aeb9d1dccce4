"""Run a function on N CPU ranks (torch.distributed + gloo) from a test, fast and never hanging.

Workers are ``spawn``-ed once per world size and kept in a pool: each imports torch and
Megatron-Core, calls :func:`hyflow.compat.cpu.maybe_activate`, joins a gloo process group
(rendezvous through a ``TCPStore`` that rank 0 binds on port 0 of 127.0.0.1) and then serves tasks.

What is reset after every task (so the next one starts clean):

* Megatron ``parallel_state`` (``destroy_model_parallel``), the Megatron RNG tracker and the
  num-microbatches calculator;
* every process group the task created (destroyed locally; the default world group is kept);
* ``os.environ``, the working directory, ``torch``'s default dtype, grad mode and thread count.

Each worker leads its own process group; killing a pool (error, timeout, shutdown) kills the
groups, so processes a task spawned die with it.

What is *not* reset: RNG seeds (tasks seed themselves), imported modules and their other module
globals, other global torch settings (deterministic flags, anomaly mode, ...). Tasks that change
such state should use :func:`run_on_ranks_fresh`. A pool that saw any error or timeout is
killed and rebuilt on the next call.

Environment: ``HYFLOW_TEST_TIMEOUT`` (per-call default, seconds), ``HYFLOW_TEST_STARTUP_TIMEOUT``
(pool start), ``HYFLOW_TEST_MAX_POOL_WORKERS`` (idle pools are evicted beyond this many workers),
``HYFLOW_TEST_WORKER_OUTPUT=quiet`` (do not stream worker output; it is still kept for errors).
"""
from __future__ import annotations

import atexit
import collections
import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import selectors
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hyflow.compat import cpu

__all__ = ["MultiRankError", "run_on_ranks", "run_on_ranks_fresh", "shutdown_pools", "default_timeout"]

_HOST = "127.0.0.1"
_ERROR_GRACE_S = 1.0  # after one rank fails, how long the others get to report before the kill
_TAIL_LINES = 80  # output lines per rank kept for error messages
_PRELOAD = ("megatron.core.parallel_state", "megatron.core.tensor_parallel")


class MultiRankError(RuntimeError):
    """A task raised, died or timed out on some rank; attributes list the ranks by outcome."""

    def __init__(self, message: str, *, finished: Optional[List[int]] = None,
                 raised: Optional[List[int]] = None, timed_out: Optional[List[int]] = None,
                 died: Optional[List[int]] = None, tracebacks: Optional[Dict[int, str]] = None) -> None:
        super().__init__(message)
        self.finished, self.raised = finished or [], raised or []
        self.timed_out, self.died = timed_out or [], died or []
        self.tracebacks = tracebacks or {}


def default_timeout() -> float:
    """Per-call timeout in seconds: ``HYFLOW_TEST_TIMEOUT`` or 120."""
    return float(os.environ.get("HYFLOW_TEST_TIMEOUT", "120"))


# ----------------------------------------------------------------------------- worker side


def _watch_parent() -> None:
    """Kill this worker and its own children as soon as the parent process is gone (no orphans)."""
    parent = mp.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os.killpg(0, signal.SIGKILL)


def _reset_state(baseline_pgs: set, env: Dict[str, str], cwd: str, threads: int) -> None:
    """Undo the global state a task may have left behind (see the module docstring)."""
    # Megatron (seconds) only in the ranks' workers: `hyflow --help` imports this module
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    # Unconditional: destroy_model_parallel() only drops references (and destroys Megatron's own
    # gloo groups), so it is safe on a clean state and also clears a partially-initialized one.
    parallel_state.destroy_model_parallel()
    tp_random._CUDA_RNG_STATE_TRACKER = None
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    num_microbatches_calculator.unset_num_microbatches_calculator()
    for pg in list(dist.distributed_c10d._world.pg_map):
        if id(pg) not in baseline_pgs:
            dist.destroy_process_group(pg)
    # A gloo group's threads end only when the last reference goes: drop ours, collect cycles.
    comm = sys.modules.get("hyflow.monitor.comm")
    if comm is not None:
        comm.forget_groups()
    gc.collect()
    if os.getcwd() != cwd:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)


def _worker_main(rank: int, world_size: int, conn: Connection, out: Connection) -> None:
    """Entry point of one pooled worker process."""
    os.setpgid(0, 0)  # own process group: the parent kills it with whatever the tasks spawned
    os.environ.pop("PYTEST_CURRENT_TEST", None)  # inherited from whichever test started the pool
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    out.close()
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # stack dump on timeout
    threading.Thread(target=_watch_parent, daemon=True).start()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_HOST,
                      OMP_NUM_THREADS=str(threads))

    cpu.maybe_activate()
    torch.set_num_threads(threads)
    for name in _PRELOAD:  # pay the Megatron import once per worker, not once per task
        __import__(name)
    long_wait = datetime.timedelta(minutes=30)
    if rank == 0:
        store = dist.TCPStore(_HOST, 0, world_size, True, timeout=long_wait, wait_for_workers=False)
        port = store.port
        conn.send(("port", port))
    else:
        _, port = conn.recv()
        store = dist.TCPStore(_HOST, port, world_size, False, timeout=long_wait)
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=long_wait)
    baseline = {id(pg) for pg in dist.distributed_c10d._world.pg_map}
    env, cwd = dict(os.environ), os.getcwd()
    conn.send(("ready", os.getpid()))

    while True:  # serve tasks until told to stop
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        try:
            kind, *rest = pickle.loads(data)
            if kind == "stop":  # stateless worker: skip the slow interpreter/c10d teardown
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            fn, args, kwargs, path = rest
            sys.path[:0] = [p for p in path if p not in sys.path]
            reply: tuple = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
            reply = ("err", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        try:
            _reset_state(baseline, env, cwd, threads)
        except BaseException as exc:  # noqa: BLE001 - the pool is discarded after any error
            note = f"state reset after the task failed: {type(exc).__name__}: {exc}"
            if reply[0] == "ok":
                reply = ("err", note, traceback.format_exc())
            else:
                reply = ("err", reply[1], f"{reply[2]}\n{note}\n{traceback.format_exc()}")
        try:
            payload = ForkingPickler.dumps(reply)
        except BaseException as exc:  # noqa: BLE001
            payload = pickle.dumps(("err", f"result is not picklable: {type(exc).__name__}: {exc}",
                                    traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(payload)


# ----------------------------------------------------------------------------- parent side


class _OutputPump(threading.Thread):
    """Reads the workers' merged stdout/stderr, streams it as ``[rank k] ...`` and keeps a tail."""

    def __init__(self, readers: List[Connection]) -> None:
        super().__init__(daemon=True, name="multirank-output")
        self._sel = selectors.DefaultSelector()
        for rank, reader in enumerate(readers):
            self._sel.register(reader.fileno(), selectors.EVENT_READ, (rank, reader))
        self.tails: List[Deque[str]] = [collections.deque(maxlen=_TAIL_LINES) for _ in readers]
        self._partial = [b""] * len(readers)
        self._quiet = os.environ.get("HYFLOW_TEST_WORKER_OUTPUT", "").lower() == "quiet"

    def _emit(self, rank: int, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        self.tails[rank].append(line)
        if not self._quiet:
            text = f"[rank {rank}] {line}\n"
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (ValueError, OSError):  # e.g. a closed pytest capture stream
                sys.__stderr__.write(text)

    def run(self) -> None:
        while self._sel.get_map():
            for key, _ in self._sel.select(timeout=1.0):
                rank, reader = key.data
                try:
                    chunk = os.read(key.fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    self._sel.unregister(key.fd)
                    reader.close()
                    if self._partial[rank]:
                        self._emit(rank, self._partial[rank])
                    continue
                *lines, self._partial[rank] = (self._partial[rank] + chunk).split(b"\n")
                for raw in lines:
                    self._emit(rank, raw)

    def tail(self, rank: int) -> str:
        return "\n".join(self.tails[rank])


def _describe_exit(code: Optional[int]) -> str:
    """``exit code 7`` / ``killed by SIGSEGV`` for a process exit code."""
    if code is None or code >= 0:
        return f"exit code {code}"
    return f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"


def _signal_group(proc: Any, sig: int) -> None:
    """Send ``sig`` to a worker's process group, or to the worker alone before it made one."""
    try:
        os.killpg(proc.pid, sig)
    except OSError:
        if proc.exitcode is None:
            try:
                os.kill(proc.pid, sig)
            except OSError:
                pass


class _Pool:
    """``world_size`` spawned workers sharing one gloo process group."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.conns: List[Connection] = []
        self.procs: List[Any] = []
        self.pids: List[int] = []
        self.broken = self.dead = False
        self.last_used = time.monotonic()
        readers: List[Connection] = []
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                out_r, out_w = ctx.Pipe(duplex=False)
                self.conns.append(parent_end)
                readers.append(out_r)
                proc = ctx.Process(target=_worker_main, args=(rank, world_size, child_end, out_w),
                                   name=f"hyflow-rank{rank}")
                proc.start()
                self.procs.append(proc)
                child_end.close()
                out_w.close()
        except BaseException:
            for proc in self.procs:
                _signal_group(proc, signal.SIGKILL)
            raise
        self.pump = _OutputPump(readers)
        self.pump.start()
        deadline = time.monotonic() + float(os.environ.get("HYFLOW_TEST_STARTUP_TIMEOUT", "300"))
        try:
            port = self._expect([0], deadline, "pool start (rendezvous)")[0]
            for conn in self.conns[1:]:
                conn.send(("port", port))
            self.pids = self._expect(list(range(world_size)), deadline, "pool start (gloo init)")
        except BaseException:
            self.kill()
            raise

    def _expect(self, ranks: List[int], deadline: float, label: str) -> List[Any]:
        """Receive the startup message of each rank in ``ranks``; kill the pool on failure."""
        replies, died, pending, start = self._collect(ranks, deadline)
        if died or pending:
            self._fail(label, start, deadline - start, replies, died, pending)
        return [replies[rank][1] for rank in ranks]

    def _collect(self, ranks: List[int], deadline: float) -> Tuple[dict, dict, set, float]:
        """Wait for one reply per rank until ``deadline``; after a rank fails, others get a grace.

        Returns (replies by rank, exit description of ranks that died, ranks still pending, start).
        """
        start = time.monotonic()
        replies: Dict[int, tuple] = {}
        died: Dict[int, str] = {}
        pending, first_failure = set(ranks), None
        while pending:
            limit = deadline if first_failure is None else min(deadline, first_failure + _ERROR_GRACE_S)
            if time.monotonic() >= limit:
                break
            waitables = {obj: r for r in pending for obj in (self.conns[r], self.procs[r].sentinel)}
            for obj in wait(list(waitables), timeout=max(0.0, limit - time.monotonic())):
                rank = waitables[obj]
                if rank not in pending:
                    continue
                pending.discard(rank)
                try:
                    replies[rank] = self.conns[rank].recv() if self.conns[rank].poll() else None
                except (EOFError, OSError):
                    replies[rank] = None
                if replies[rank] is None:  # the worker is gone without replying
                    del replies[rank]
                    self.procs[rank].join(1.0)
                    died[rank] = _describe_exit(self.procs[rank].exitcode)
                if rank in died or replies[rank][0] == "err":
                    first_failure = first_failure or time.monotonic()
        return replies, died, pending, start

    def run(self, payload: bytes, timeout: float, label: str) -> List[Any]:
        """Send one pickled task to every rank and collect the replies (see :func:`run_on_ranks`)."""
        self.last_used = time.monotonic()
        self.broken = True  # until proven otherwise
        for tail in self.pump.tails:
            tail.clear()  # error reports show this task's output only
        for conn in self.conns:
            try:
                conn.send_bytes(payload)
            except OSError:
                pass  # a dead worker: _collect notices through its sentinel
        ranks = list(range(self.world_size))
        replies, died, pending, start = self._collect(ranks, time.monotonic() + timeout)
        if died or pending or any(reply[0] != "ok" for reply in replies.values()):
            self._fail(label, start, timeout, replies, died, pending)
        self.broken = False
        return [replies[rank][1] for rank in ranks]

    def _fail(self, label: str, start: float, timeout: float, replies: Dict[int, tuple],
              died: Dict[int, str], pending: set) -> None:
        """Dump the stuck ranks' stacks, kill the pool and raise a :class:`MultiRankError`."""
        for rank in pending:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)  # faulthandler stack dump
            except OSError:
                pass
        if pending:
            time.sleep(0.3)
        self.kill()
        elapsed = time.monotonic() - start
        finished = sorted(r for r, reply in replies.items() if reply[0] != "err")
        raised = sorted(r for r, reply in replies.items() if reply[0] == "err")
        stuck, dead = sorted(pending), sorted(died)
        parts = [f"rank {r} died ({died[r]})" for r in dead]
        parts += [f"rank {r} raised {replies[r][1]}" for r in raised]
        why = "" if raised or dead else f" after {elapsed:.1f}s"
        parts += [f"rank {r} timed out{why} (killed)" for r in stuck]
        lines = [f"{label} failed on world_size={self.world_size}: " + "; ".join(parts),
                 f"finished: {finished}, raised: {raised}, died: {dead}, timed out: {stuck} "
                 f"(timeout {timeout:g}s, ran {elapsed:.1f}s)"]
        for rank in raised:
            lines += [f"----- rank {rank} remote traceback -----", replies[rank][2].rstrip()]
        for rank in dead + stuck:
            lines += [f"----- rank {rank} last output -----", self.pump.tail(rank)]
        raise MultiRankError("\n".join(lines), finished=finished, raised=raised, timed_out=stuck,
                             died=dead, tracebacks={r: replies[r][2] for r in raised})

    def kill(self) -> None:
        """SIGTERM, then SIGKILL, each worker's process group (the worker and anything it
        spawned); never blocks for long. Idempotent."""
        if self.dead:
            return
        self.broken = self.dead = True
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        live = [proc.sentinel for proc in self.procs]
        end = time.monotonic() + 2.0
        while live and time.monotonic() < end:
            for sentinel in wait(live, timeout=max(0.0, end - time.monotonic())):
                live.remove(sentinel)
        for proc in self.procs:  # the leader is not reaped yet, so its group id is still ours
            _signal_group(proc, signal.SIGKILL)
        for proc in self.procs:
            proc.join(2.0)
        self.pump.join(2.0)  # drain the last output
        for conn in self.conns:
            conn.close()

    def close(self) -> None:
        """Ask workers to exit, then kill whatever is left."""
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        end = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.0, end - time.monotonic()))
        self.kill()


_POOLS: Dict[int, _Pool] = {}
_LOCK = threading.RLock()


def _evict_for(world_size: int) -> None:
    """Close idle pools (least recently used first) so that total workers stay under the cap."""
    cap = int(os.environ.get("HYFLOW_TEST_MAX_POOL_WORKERS", "8"))
    for ws, pool in sorted(_POOLS.items(), key=lambda item: item[1].last_used):
        if sum(p.world_size for p in _POOLS.values()) + world_size <= cap:
            break
        del _POOLS[ws]
        pool.close()


def _get_pool(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is not None and (pool.broken or not all(p.is_alive() for p in pool.procs)):
        del _POOLS[world_size]
        pool.kill()
        pool = None
    if pool is None:
        _evict_for(world_size)
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool


def _prepare(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict) -> bytes:
    """Validate the call and pickle the task once, before any rank sees it."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    try:
        return bytes(ForkingPickler.dumps(("run", fn, args, kwargs, list(sys.path))))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(f"run_on_ranks needs a module-level function and picklable arguments; "
                        f"could not pickle {fn!r}: {exc}") from exc


def run_on_ranks(fn: Callable[..., Any], world_size: int, /, *args: Any,
                 timeout: Optional[float] = None, **kwargs: Any) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1`` of a pooled gloo world.

    ``fn`` must be a module-level function; arguments and return values must pickle. Inside
    ``fn`` the default process group is initialized (gloo) and ``RANK``/``WORLD_SIZE``/
    ``MASTER_ADDR``/``MASTER_PORT`` are set. Returns the per-rank results in rank order.
    (``timeout`` is the harness's own keyword: it is never passed on to ``fn``.)

    Raises :class:`MultiRankError` if any rank raises, dies or is still running after
    ``timeout`` seconds (default :func:`default_timeout`), or if the pool fails to start; the
    pool is then killed and rebuilt on the next call.
    """
    payload = _prepare(fn, world_size, args, kwargs)
    with _LOCK:
        pool = _get_pool(world_size)
        try:
            return pool.run(payload, default_timeout() if timeout is None else timeout,
                            getattr(fn, "__qualname__", repr(fn)))
        finally:
            if pool.broken:  # error, timeout or interrupt: never reuse these processes
                if _POOLS.get(world_size) is pool:
                    del _POOLS[world_size]
                pool.kill()


def run_on_ranks_fresh(fn: Callable[..., Any], world_size: int, /, *args: Any,
                       timeout: Optional[float] = None, **kwargs: Any) -> List[Any]:
    """Like :func:`run_on_ranks` but on a one-off pool of brand-new processes, closed afterwards."""
    payload = _prepare(fn, world_size, args, kwargs)
    pool = _Pool(world_size)
    try:
        return pool.run(payload, default_timeout() if timeout is None else timeout,
                        getattr(fn, "__qualname__", repr(fn)))
    finally:
        pool.close()


def shutdown_pools() -> None:
    """Stop every pooled worker (registered with :mod:`atexit`; safe to call any time)."""
    with _LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
        for pool in pools:
            pool.close()


atexit.register(shutdown_pools)
