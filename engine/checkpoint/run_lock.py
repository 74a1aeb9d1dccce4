"""One run per run directory: an exclusive lock on ``<trainer.output_dir>/run.lock``.

Two runs writing into one directory delete each other's checkpoints and interleave their
metrics. Rank 0 of a run holds an exclusive ``flock`` on ``run.lock`` from before it reads or
writes anything there until the run ends; the kernel releases it when the process dies, however
it dies, so a lock is never stale while ``flock`` works. The file names the owner (host, pid, start
time, command) for the refusal a second run gets: one line from the launcher's pre-flight check
(:func:`check_unlocked`), or from rank 0 when two launches race past it.

Where ``flock`` is not supported (some network file systems) the file's contents decide: a lock
whose owner is this host's live process, or another host's and not marked released, is held
(the message says to delete the file when that run is known to be gone).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

from hyflow.checkpoint.errors import CheckpointError

LOCK_FILE = "run.lock"


class RunDirInUse(CheckpointError):
    """The run directory is locked by another run."""


def lock_path(output_dir: str) -> str:
    return os.path.join(output_dir, LOCK_FILE)


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held_by_contents(owner: dict) -> bool:
    """Without flock: whether the file's owner is still running (as far as this host can tell)."""
    if not owner or owner.get("released"):
        return False
    if owner.get("host") == socket.gethostname():
        return isinstance(owner.get("pid"), int) and owner["pid"] != os.getpid() and _alive(owner["pid"])
    return True


def describe_owner(output_dir: str, owner: dict) -> str:
    """The refusal a second run gets."""
    who = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["started"])) \
        if isinstance(owner.get("started"), (int, float)) else "?"
    return (f"trainer.output_dir {output_dir} is in use by another run ({who}, started {since}: "
            f"{owner.get('command', '?')}); wait for it to end or stop it, or use another trainer.output_dir "
            f"(if that run is gone, delete {lock_path(output_dir)})")


def current_owner(output_dir: str) -> Optional[dict]:
    """The owner of the run directory's lock while a run holds it, else None (nothing is created)."""
    path = lock_path(output_dir)
    if not os.path.exists(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return _read(path) or {"pid": "?", "host": "?"}
            owner = _read(path)  # flock unsupported here: the contents decide
            return owner if _held_by_contents(owner) else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_unlocked(output_dir: str) -> None:
    """Raise :class:`RunDirInUse` when another run holds ``output_dir`` (the launcher's check)."""
    owner = current_owner(output_dir)
    if owner is not None:
        raise RunDirInUse(describe_owner(output_dir, owner))


class RunLock:
    """The exclusive lock of one run directory, held by rank 0 (:meth:`acquire` / :meth:`release`,
    or a ``with`` block)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = lock_path(output_dir)
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        os.makedirs(self.output_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirInUse(describe_owner(self.output_dir, _read(self.path))) from None
            owner = _read(self.path)  # no flock on this file system: the contents decide
            if _held_by_contents(owner):
                raise RunDirInUse(describe_owner(self.output_dir, owner)) from None
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._fd = fd
        self._write({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                     "command": " ".join(sys.argv)[:300], "released": False})
        return self

    def _write(self, data: dict) -> None:
        text = (json.dumps(data) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text, 0)
        os.fsync(self._fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            data = _read(self.path)
            data["released"] = True
            self._write(data)
        except OSError:
            pass  # a full disk must not keep the lock: closing the descriptor releases it
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
