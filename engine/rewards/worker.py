"""User reward functions in worker processes, so that a call that never returns is stopped.

A reward function is user code: a verifier that loops, a sandbox that never answers, a file that
sleeps at import. Run inside the rank, one such call hangs the whole job. :class:`FunctionPool`
runs the function in ``workers`` processes of its own (:func:`serve`: a fresh interpreter that
imports nothing but hyflow's reward modules and the function's file) and gives each call ``timeout_s`` seconds; a call past it
is abandoned, its worker killed and replaced, and the call reported as timed out (the manager
scores it ``reward.timeout_score`` and counts it in ``reward/timeouts``). ``batch_timeout_s``
bounds a whole batch the same way. Importing the file gets ``import_timeout_s``.

Workers ignore stop signals (the rank decides when to stop: Slurm signals every process of a
job step) and die with the rank (``PR_SET_PDEATHSIG``, and end of input when the rank closes its
side). Calls and results cross a socket pair as pickles of plain data (row fields, floats).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Sequence

from hyflow.rewards.user_function import RewardError, load_user_function

#: A call's arguments: (data_source, solution_str, ground_truth, extra_info, where).
Call = tuple
#: What a timed-out call returns from :meth:`FunctionPool.map`.
TIMED_OUT = None
DEFAULT_IMPORT_TIMEOUT_S = 60.0
#: A replacement worker's import gets this many times the first one's limit (it imported fine once).
_REPLACEMENT_IMPORT_FACTOR = 4
_WORKER_MAIN = "import sys; from hyflow.rewards.worker import serve; serve(int(sys.argv[1]))"


class _RemoteTraceback(Exception):
    """The worker's traceback, chained under the :class:`RewardError` for the rank's log."""

    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return "\n" + self.args[0]


class _Worker:
    """One worker process and its end of the socket pair: started at once, ready once it has
    imported the function (:meth:`ready`)."""

    def __init__(self, path: str, name: str, import_timeout_s: float) -> None:
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.path, self.name, self.limit_s = path, name, import_timeout_s
        self.deadline = time.monotonic() + import_timeout_s  # for its import
        self.conn = Connection(mine.detach())
        self.conn.send(("load", path, name))

    def ready(self) -> "_Worker":
        """Wait for the import (until the deadline); raises :class:`RewardError` when it fails."""
        if not self.conn.poll(max(0.0, self.deadline - time.monotonic())):
            self.kill()
            raise RewardError(f"importing reward function file {self.path} did not finish within {self.limit_s:.0f} s "
                              "(it hangs at import, imports something very slow, or the machine is overloaded)",
                              function=self.name, path=self.path)
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            code = self.kill()
            raise RewardError(f"the reward worker for {self.path} died while importing it (exit code {code})",
                              function=self.name, path=self.path) from None
        if reply[0] != "ready":
            self.kill()
            raise RewardError(reply[1], function=self.name, path=self.path)
        return self

    def kill(self) -> Optional[int]:
        """Stop the worker now; its exit code."""
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


class FunctionPool:
    """``workers`` processes calling ``name`` from the file ``path`` (see the module docstring).

    Raises :class:`RewardError` at construction for a file that fails (or takes longer than
    ``import_timeout_s``) to import, a missing function or a wrong signature, as
    :func:`~hyflow.rewards.user_function.load_user_function` does in-process.
    """

    def __init__(self, path: str, name: str = "compute_score", workers: int = 1, timeout_s: float = 60.0,
                 batch_timeout_s: float = 0.0, import_timeout_s: Optional[float] = None) -> None:
        if workers < 1 or timeout_s <= 0 or batch_timeout_s < 0:
            raise ValueError("workers >= 1, timeout_s > 0 and batch_timeout_s >= 0 are required")
        if not path or not os.path.isfile(os.path.expanduser(path)):
            load_user_function(path, name)  # raises the error naming the missing file
        self.path, self.name = os.path.abspath(os.path.expanduser(path)), name
        self.timeout_s, self.batch_timeout_s = float(timeout_s), float(batch_timeout_s)
        self.import_timeout_s = max(DEFAULT_IMPORT_TIMEOUT_S, self.timeout_s) if import_timeout_s is None \
            else float(import_timeout_s)
        self.size = workers
        self._idle: list[_Worker] = []  # ready for a call
        self._starting: dict[Connection, _Worker] = {}  # importing the function
        self._idle.append(_Worker(self.path, self.name, self.import_timeout_s).ready())  # a broken file fails now
        self.timeouts = 0  # over the pool's life

    def _replacement(self) -> _Worker:
        """A worker started while calls run (it imported fine once: a slow start is the machine's load)."""
        return _Worker(self.path, self.name, _REPLACEMENT_IMPORT_FACTOR * self.import_timeout_s)

    def map(self, calls: Sequence[Call]) -> list[Optional[tuple[float, dict]]]:
        """``(score, extras)`` per call, in order; :data:`TIMED_OUT` (None) for a call that took more
        than ``timeout_s`` or was unfinished at ``batch_timeout_s``. A call that raises raises
        :class:`RewardError` (the function's error, naming the row)."""
        results: list[Optional[tuple[float, dict]]] = [TIMED_OUT] * len(calls)
        todo = collections.deque(range(len(calls)))
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        starting = self._starting  # replacements of killed workers, importing (kept across batches)
        end = time.monotonic() + self.batch_timeout_s if self.batch_timeout_s else float("inf")
        try:
            while todo or busy:
                while todo and self._idle:  # a call's time starts when a ready worker takes it
                    worker, i = self._idle.pop(), todo.popleft()
                    try:
                        worker.conn.send((i, *calls[i]))
                    except OSError:
                        self._died(worker, calls[i])
                    busy[worker.conn] = (worker, i, time.monotonic() + self.timeout_s)
                while todo and len(busy) + len(starting) < self.size:
                    worker = self._replacement()
                    starting[worker.conn] = worker
                deadline = min([d for _, _, d in busy.values()] + [w.deadline for w in starting.values()] + [end])
                for conn in wait([*busy, *starting], timeout=max(0.0, deadline - time.monotonic())):
                    if conn in starting:
                        self._idle.append(starting.pop(conn).ready())
                        continue
                    worker, i, _ = busy.pop(conn)
                    results[i] = self._reply(worker, calls[i])
                    self._idle.append(worker)
                now = time.monotonic()
                for conn, (worker, _i, d) in list(busy.items()):
                    if now >= d or now >= end:  # abandoned: the worker is killed, a fresh one replaces it
                        busy.pop(conn)
                        worker.kill()
                        self.timeouts += 1
                for conn, worker in list(starting.items()):
                    if now >= worker.deadline:
                        starting.pop(conn).ready()  # raises: it did not import in time
                if now >= end:
                    self.timeouts += len(todo)
                    todo.clear()
        finally:
            for worker, _, _ in busy.values():  # an error left calls running: stop them
                worker.kill()
        return results

    def _reply(self, worker: _Worker, call: Call) -> tuple[float, dict]:
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            self._died(worker, call)
        if reply[1] == "ok":
            return reply[2], reply[3]
        data_source, where = call[0], call[4]
        error = RewardError(reply[2], self.name, self.path, where, data_source)
        raise error from _RemoteTraceback(reply[3])

    def _died(self, worker: _Worker, call: Call) -> None:
        code = worker.kill()
        how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
        raise RewardError(f"reward function {self.name}() from {self.path} crashed its worker process ({how}) on "
                          f"{call[4] or 'a sample'} (data_source={call[0]!r})", self.name, self.path, call[4], call[0])

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        while self._idle:
            self._idle.pop().kill()
        while self._starting:
            self._starting.popitem()[1].kill()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def probe_user_function(path: str, name: str, import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S) -> None:
    """Import ``path`` and check ``name`` in a worker (the pre-flight check: a file that hangs at
    import fails after ``import_timeout_s`` instead of hanging the launcher). Raises :class:`RewardError`."""
    pool = FunctionPool(path, name, import_timeout_s=import_timeout_s)
    pool.close()


# --------------------------------------------------------------------------- the worker process


def _die_with_parent() -> None:
    """SIGKILL when the rank that started this worker exits (Linux; elsewhere end of input ends it)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(fd: int) -> None:
    """The worker process: load the function, then answer calls until the rank closes its side."""
    _die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd)
    _, path, name = conn.recv()
    try:
        fn = load_user_function(path, name)
    except RewardError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            i, data_source, solution, ground_truth, extra_info, where = conn.recv()
        except (EOFError, OSError):
            return
        try:
            score, extras = fn(data_source, solution, ground_truth, extra_info, where=where)
            reply: tuple[Any, ...] = (i, "ok", score, extras)
        except BaseException as e:  # noqa: BLE001 - SystemExit from user code too: reported, the worker lives
            message = str(e) if isinstance(e, RewardError) else \
                f"{fn.label} raised {type(e).__name__}: {e} on {where or 'a sample'} (data_source={data_source!r})"
            reply = (i, "err", message, traceback.format_exc())
        conn.send(reply)

