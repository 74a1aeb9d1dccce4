"""Small file helpers for checkpoints: durable atomic writes and JSON reads that name the file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from typing import Any

from hyflow.checkpoint.errors import CheckpointDamaged, CheckpointError


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` durably, so readers see the old file or the whole new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def write_json(path: str, data: Any) -> None:
    """``data`` as indented JSON, written with :func:`write_atomic`."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: str, root: str = "") -> Any:
    """Parse a checkpoint's JSON file; a missing or unparsable one raises
    :class:`CheckpointDamaged` naming it (``root``: the checkpoint it belongs to)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path} is missing", root or os.path.dirname(path),
                                os.path.relpath(path, root) if root else os.path.basename(path), "missing") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointDamaged(f"{path} is not valid JSON ({e})", root or os.path.dirname(path),
                                os.path.relpath(path, root) if root else os.path.basename(path),
                                "unreadable") from None


def describe_os_error(e: OSError, doing: str) -> str:
    """One sentence for an OS error while ``doing`` something: disk full and permission
    problems say what to do."""
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    if e.errno == errno.ENOSPC:
        return f"no space left on the device while {doing}{where}: free space there or point the run elsewhere"
    if e.errno == errno.EDQUOT:
        return f"disk quota exceeded while {doing}{where}: free space or raise the quota"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied while {doing}{where}: the directory is not writable"
    return f"{e.strerror or e} while {doing}{where}"


def find_os_error(exc: BaseException) -> "OSError | None":
    """The OSError behind ``exc``: itself, a cause / context, or (torch DCP) one of the
    per-rank failures a ``CheckpointException`` collects."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):  # rank -> exception, or (exception, traceback)
            for f in failures.values():
                todo += list(f) if isinstance(f, tuple) else [f]
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
    # Exceptions that crossed a process boundary (torch DCP gathers them from the ranks, Megatron
    # from its writer processes) keep only their text: "[Errno 28] No space left on device: 'path'"
    match = _ERRNO_TEXT.search(str(exc))
    if match:
        return OSError(int(match.group(1)), match.group(2), match.group(3))
    return None


#: Free space below which a failed write is taken for a full disk (writers that lost the errno:
#: torch's zip writer reports "enforce fail ... unexpected pos", a background writer only a message).
FULL_BELOW_BYTES = 64 << 20


def full_disk_error(path: str) -> "OSError | None":
    """An ENOSPC error for ``path`` when its file system has less than :data:`FULL_BELOW_BYTES`
    free (call it after a write failed for a reason the exception does not tell)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize >= FULL_BELOW_BYTES:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:\n]+)(?:: '([^'\n]*)')?")


__all__ = ["write_atomic", "write_json", "read_json", "describe_os_error", "find_os_error",
           "CheckpointError", "CheckpointDamaged"]
