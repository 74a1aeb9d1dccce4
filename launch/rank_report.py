"""What each rank leaves behind for the launcher: its traceback in a log file, a one-line error
record, an exit record; and the one-line summary the launcher prints from them.

The launchers (``hyflow train``, ``hyflow launch local``, the sbatch script) set
``HYFLOW_LOG_DIR`` for the ranks. A rank whose job raises writes (under that directory)::

    rank_00003.log          the full traceback (appended)
    rank_00003.error.json   {rank, type, message, peer, time, log}: one line's worth
    rank_00003.exit.json    {rank, status: ok | error, agent_pid}: written by every rank at exit

and exits 1 without printing the traceback; the launcher then prints, first::

    [hyflow] rank 3 failed: RewardError: reward function compute_score() ... row 61 (data_source=...)
    [hyflow] the job stopped; traceback: runs/x/logs/<launch>/rank_00003.log (every rank's in runs/x/logs/<launch>)
    [hyflow] `trainer.resume=auto` (the default) continues from step 40: runs/x/checkpoints/step_000040

A rank that died without a record (``kill -9``, the OOM killer, a segfault) is named from the
exit status torchrun saw. Errors that only say a *peer* went away (gloo's "Connection closed by
peer", NCCL aborts) are secondary: the root cause is the earliest other failure; each further
distinct cause gets one more line.

Writing a record never fails a rank a second time: when the log directory cannot be written (a
full disk, the very error being reported), the traceback and the records go to
``HYFLOW_RECORD_FALLBACK_DIR``, a directory the launcher made in memory (``/dev/shm``) and reads too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from hyflow.checkpoint.discovery import checkpoints_root, latest_checkpoint
from hyflow.checkpoint.files import write_json

LOG_DIR_ENV = "HYFLOW_LOG_DIR"
FALLBACK_DIR_ENV = "HYFLOW_RECORD_FALLBACK_DIR"
#: Text of errors that only report that another rank is gone.
_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
                 "ProcessGroupNCCL", "Socket Timeout", "DistNetworkError", "DistBackendError",
                 "recvBytes", "sendBytes", "Connection refused", "failed to recv", "Timed out waiting")
_MAX_MESSAGE = 600
_MAX_CAUSES = 3  # distinct causes named in a failure summary


def rank_log(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank_{rank:05d}.log")


def _record_path(log_dir: str, rank: int, kind: str) -> str:
    return os.path.join(log_dir, f"rank_{rank:05d}.{kind}.json")


def one_line(text: str) -> str:
    """A message on one line (multi-line messages joined with ' | '), at most ~600 characters."""
    line = " | ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())
    return line if len(line) <= _MAX_MESSAGE else line[:_MAX_MESSAGE - 3] + "..."


def is_peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` only reports a lost peer (another rank failed first): its ``peer``
    attribute says so, or its text is a transport's."""
    if getattr(exc, "peer", False):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in _PEER_MARKERS)


def run_reporting(fn: Callable[[], Any], rank: int, log_dir: Optional[str] = None) -> int:
    """Run ``fn`` (a rank's whole job) and return its exit code: 0, or 1 after an exception,
    whose traceback goes to :func:`rank_log` and whose one-line record the launcher reads.
    Without a log directory (``HYFLOW_LOG_DIR`` unset: not started by a hyflow launcher) the
    exception propagates as usual."""
    log_dir = log_dir or os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        fn()
        return 0
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError:
        pass  # the records fall back (see the module docstring)
    exit_record = {"rank": rank, "status": "ok", "agent_pid": os.getppid(), "pid": os.getpid()}
    try:
        fn()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then reported by the launcher
        exit_record["status"] = "error"
        record_failure(exc, rank, log_dir)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        _write_record(log_dir, rank, "exit", exit_record)


def _fallback_dirs(log_dir: str) -> list[str]:
    return [log_dir] + [d for d in [os.environ.get(FALLBACK_DIR_ENV)] if d and d != log_dir]


def _write_record(log_dir: str, rank: int, kind: str, record: dict) -> Optional[str]:
    """Write a record into the first directory that takes it; its path (None: nowhere)."""
    for d in _fallback_dirs(log_dir):
        try:
            write_json(_record_path(d, rank, kind), record)
            return _record_path(d, rank, kind)
        except OSError:
            continue
    return None


def record_failure(exc: BaseException, rank: int, log_dir: str) -> dict:
    """Append ``exc``'s traceback to the rank's log and write its error record (in the fallback
    directory when the log directory cannot be written); returns the record."""
    text = (f"[hyflow] rank {rank} failed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    path = None
    for d in _fallback_dirs(log_dir):
        try:
            with open(rank_log(d, rank), "a") as f:
                f.write(text)
            path = rank_log(d, rank)
            break
        except OSError:
            continue
    record = {"rank": rank, "type": type(exc).__name__, "message": one_line(exc) or type(exc).__name__,
              "peer": is_peer_error(exc), "time": time.time(), "log": path or "(not written: no space for it)"}
    _write_record(log_dir, rank, "error", record)
    return record


def make_fallback_dir() -> Optional[str]:
    """A directory in memory (``/dev/shm`` where it exists, else the temp directory) for the ranks'
    records when the run directory is full; exported as ``HYFLOW_RECORD_FALLBACK_DIR``."""
    for base in ("/dev/shm", None):
        try:
            path = tempfile.mkdtemp(prefix="hyflow-records-", dir=base)
        except OSError:
            continue
        os.environ[FALLBACK_DIR_ENV] = path
        return path
    return None


def remove_fallback_dir(path: Optional[str]) -> None:
    """Remove the fallback directory unless it holds a traceback (then the summary names it)."""
    if not path or not os.path.isdir(path):
        return
    if not any(name.endswith(".log") for name in os.listdir(path)):
        shutil.rmtree(path, ignore_errors=True)


def read_records(log_dir: str, kind: str) -> list[dict]:
    """The ``error`` or ``exit`` records in ``log_dir`` (and the fallback directory), by rank."""
    out: dict[Any, dict] = {}
    for d in _fallback_dirs(log_dir):
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            if name.endswith(f".{kind}.json"):
                try:
                    with open(os.path.join(d, name)) as f:
                        record = json.load(f)
                except (OSError, ValueError):
                    continue
                out.setdefault(record.get("rank", name), record)
    return [out[k] for k in sorted(out, key=lambda k: (not isinstance(k, int), k if isinstance(k, int) else 0, str(k)))]


@dataclass
class Death:
    """A rank that ended without a record, as torchrun saw it."""

    rank: int
    exitcode: int
    pid: int = 0
    time: float = 0.0


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def summarize_failure(log_dir: str, deaths: Sequence[Death] = (), resume_hint: str = "") -> list[str]:
    """At most three lines: the root-cause rank and its error, where the tracebacks are, and
    how to continue (``resume_hint``, e.g. from :func:`resume_hint`)."""
    errors = read_records(log_dir, "error")
    recorded = {e["rank"] for e in errors}
    # a rank killed by a signal (SIGKILL: OOM killer, kill -9; SIGSEGV...) is the likeliest cause;
    # SIGTERM / SIGINT deaths are torchrun stopping the survivors
    killed = sorted((d for d in deaths if d.exitcode < 0 and -d.exitcode not in (signal.SIGTERM, signal.SIGINT)
                     and d.rank not in recorded), key=lambda d: d.time)
    primary = sorted((e for e in errors if not e.get("peer") and e["type"] != "KeyboardInterrupt"),
                     key=lambda e: e["time"])
    lines = []
    if killed:
        d = killed[0]
        lines.append(f"[hyflow] rank {d.rank}{f' (pid {d.pid})' if d.pid else ''} was killed by "
                     f"{signal_name(-d.exitcode)}{' (out of memory? kill -9?)' if -d.exitcode == signal.SIGKILL else ''}")
        where = f"logs of every rank: {log_dir}"
    elif primary or errors:
        e = (primary or sorted(errors, key=lambda r: r["time"]))[0]
        lines.append(f"[hyflow] rank {e['rank']} failed: {e['type']}: {e['message']}")
        where = f"traceback: {e['log']} (every rank's log in {log_dir})"
        seen = {_cause(e)}
        for other in primary[1:]:  # one more line per distinct cause, not one per rank
            if _cause(other) not in seen and len(seen) < _MAX_CAUSES:
                seen.add(_cause(other))
                lines.append(f"[hyflow] rank {other['rank']} also failed: {other['type']}: {other['message']}")
    elif deaths:
        d = sorted(deaths, key=lambda d: d.time)[0]
        how = f"was killed by {signal_name(-d.exitcode)}" if d.exitcode < 0 else f"exited with code {d.exitcode}"
        lines.append(f"[hyflow] rank {d.rank} {how} without a hyflow error record")
        where = f"logs: {log_dir}"
    else:
        lines.append("[hyflow] the job failed without a rank error record")
        where = f"logs: {log_dir}"
    others = len({e["rank"] for e in errors} | {d.rank for d in deaths}) - 1
    lines.append(f"[hyflow] the job stopped{f' ({others} other rank(s) stopped with it)' if others > 0 else ''}; "
                 f"{where}")
    if resume_hint:
        lines.append(resume_hint)
    return lines


def _cause(record: dict) -> tuple[str, str]:
    """A failure's cause, the same for every rank (numbers, e.g. ranks and shard names, and a path
    in parentheses, which ranks that hit the same full disk report differently, left out)."""
    return record.get("type", ""), re.sub(r"\d+", "#", re.sub(r" \(/[^()]*\)", "", record.get("message", "")))


def resume_hint(output_dir: Optional[str], log_dir: Optional[str] = None) -> str:
    """``trainer.resume=auto`` continues from step N (path), or an empty string. When a rank's
    error (in ``log_dir``) names that very checkpoint, it was refused: the hint says so instead of
    sending the user back into the same error."""
    if not output_dir:
        return ""
    errors = read_records(log_dir, "error") if log_dir else []
    if any(r.get("type") == "RunDirInUse" for r in errors):
        return ""  # the directory is another run's: nothing of this one to continue
    entry = latest_checkpoint(checkpoints_root(output_dir), lambda _: None)
    if entry is None:
        return "[hyflow] no checkpoint was saved yet: the same command starts the run over"
    intact = f"{entry.path} (step {entry.step}) is intact"  # a failed save names the previous checkpoint so
    refused = any(entry.path in m and intact not in m  # (Checkpointer._previous_note)
                  for m in (r.get("message", "") for r in errors))
    if refused:
        return (f"[hyflow] the newest checkpoint, step {entry.step} ({entry.path}), was refused (above): the same "
                "command would load it again; move it away (trainer.resume=auto then takes the one before) or set "
                "trainer.resume to an earlier step_* directory")
    return (f"[hyflow] run the same command to continue: `trainer.resume=auto` (the default) resumes from "
            f"step {entry.step} ({entry.path})")
