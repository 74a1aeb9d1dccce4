"""torchrun with hyflow's reporting: ``python -m hyflow.launch.torchrun [torchrun options] -m hyflow.cli ...``.

The same agent as ``torchrun`` (``torch.distributed.run``, run in this process), with three
differences a user sees:

* a rank failure is reported in at most three lines: which rank, the hyflow error (or the
  signal that killed it), where the tracebacks are, and the step ``trainer.resume=auto``
  continues from (:mod:`hyflow.launch.rank_report`) - instead of torchrun's ChildFailedError
  dump, its own traceback and every rank's traceback;
* a stop signal (SIGTERM, SIGUSR1) after which every rank saved and exited cleanly ends with
  exit code 0 (torchrun re-raises the signal and exits 1, which a requeue reads as a failure);
* ``--shutdown-timeout`` (how long torchrun waits for the ranks after forwarding a signal before
  it SIGKILLs them) should cover a step plus a save: :mod:`hyflow.launch.grace` sizes it.

``HYFLOW_LOG_DIR`` must name the directory the ranks write their records to; ``HYFLOW_RUN_DIR``
(optional) the run directory, whose newest checkpoint the summary names.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Optional, Sequence

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing import api
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from hyflow.launch.rank_report import (LOG_DIR_ENV, Death, make_fallback_dir, read_records, remove_fallback_dir,
                                       resume_hint, summarize_failure)

RUN_DIR_ENV = "HYFLOW_RUN_DIR"
#: torchrun's loggers whose failure / shutdown messages this module replaces with its summary.
_QUIET = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
          "torch.distributed.elastic.multiprocessing.errors", "torch.distributed.launcher.api",
          "torch.distributed.elastic.multiprocessing.tail_log")


def _quiet_torchrun_logs() -> None:
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def run(argv: Sequence[str], log_dir: Optional[str] = None, run_dir: Optional[str] = None,
        out=None) -> int:
    """Run torchrun's agent with ``argv`` (torchrun's own command line) and return the exit
    code: 0 when every rank exited 0 (after a stop signal, too), 1 after a rank failure, 128 +
    the signal number when a signal stopped ranks that did not exit cleanly."""
    out = out or sys.stderr
    log_dir = log_dir or os.environ.get(LOG_DIR_ENV)
    run_dir = run_dir or os.environ.get(RUN_DIR_ENV)
    if not log_dir:
        raise ValueError(f"{LOG_DIR_ENV} is not set: the directory the ranks report to")
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:  # a full or read-only disk: the ranks' records go to the fallback directory
        print(f"[hyflow] warning: cannot create the log directory {log_dir}: {e.strerror}", file=out, flush=True)
    os.environ[LOG_DIR_ENV] = log_dir
    if run_dir:
        os.environ[RUN_DIR_ENV] = run_dir
    fallback = make_fallback_dir()
    args = torchrun.parse_args(list(argv))
    _quiet_torchrun_logs()
    aborted = _abort_on_second_interrupt()
    started = time.time()
    try:
        torchrun.run(args)
        return 0
    except ChildFailedError as e:
        deaths = [Death(rank=rank, exitcode=f.exitcode, pid=f.pid, time=getattr(f, "timestamp", 0.0))
                  for rank, f in e.failures.items()]
        _print(summarize_failure(log_dir, deaths, resume_hint(run_dir, log_dir)), out)
        return 1
    except SignalException as e:
        if aborted:
            _print([f"[hyflow] second SIGINT: the ranks were killed without saving (logs: {log_dir}); "
                    "`trainer.resume=auto` continues from the last complete checkpoint"], out)
            return 128 + int(signal.SIGINT)
        return _after_signal(e.sigval, log_dir, run_dir, args.nproc_per_node, started, out)
    finally:
        remove_fallback_dir(fallback)


def _abort_on_second_interrupt() -> list:
    """Make a second SIGINT (Ctrl-C) kill the ranks at once. torchrun's agent forwards the first to
    the ranks (they save after their step) and waits for them; on a second signal it waits again.
    Its handler is wrapped: from the second SIGINT on, the ranks (this process's children, each
    leading its process group) are killed before it raises. Returns a list that is non-empty once
    that happened."""
    original = api._terminate_process_handler
    interrupts, aborted = [], []

    def handler(signum, frame):
        if signum == signal.SIGINT:
            interrupts.append(signum)
            if len(interrupts) > 1:
                aborted.append(signum)
                _kill_children()
        return original(signum, frame)

    api._terminate_process_handler = handler  # registered by the agent when it starts the ranks
    return aborted


def _kill_children() -> None:
    for pid in _children(os.getpid()):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _children(pid: int) -> list[int]:
    """This process's direct children, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _after_signal(sig: signal.Signals, log_dir: str, run_dir: Optional[str], nproc: str, started: float,
                  out) -> int:
    """The agent forwarded ``sig`` to the ranks and waited for them (``--shutdown-timeout``):
    exit 0 when every one of its ranks exited cleanly."""
    mine = [r for r in read_records(log_dir, "exit") if r.get("agent_pid") == os.getpid()]
    try:
        expected = int(nproc)
    except ValueError:  # "gpu", "auto": count what reported
        expected = len(mine)
    clean = len(mine) == expected and expected > 0 and all(r.get("status") == "ok" for r in mine)
    name = sig.name if isinstance(sig, signal.Signals) else str(sig)
    if clean:
        _print([f"[hyflow] stopped on {name}: every rank saved and exited cleanly",
                resume_hint(run_dir)], out)
        return 0
    errors = read_records(log_dir, "error")
    lines = [f"[hyflow] stopped on {name}, but {expected - sum(r.get('status') == 'ok' for r in mine)} of "
             f"{expected} rank(s) did not exit cleanly (killed after the shutdown timeout, or failed)"]
    if errors:
        lines = summarize_failure(log_dir, (), "")[:1] + lines
    lines.append(resume_hint(run_dir, log_dir))
    _print(lines, out)
    return 128 + int(sig)


def _print(lines: Sequence[str], out) -> None:
    for line in lines:
        if line:
            try:
                print(line, file=out, flush=True)
            except (OSError, ValueError):  # SIGHUP: the terminal is gone
                return


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
