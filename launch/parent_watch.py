"""Ranks die with their launcher.

torchrun starts each rank in a session of its own, so a launcher killed with SIGKILL (or its
process group) leaves the ranks running to the end of the job, writing into the run directory
with no one to stop them. :func:`exit_with_parent` starts a thread in the rank that polls its parent
(the torchrun agent: ``hyflow train``'s launcher here, torchrun on each node under Slurm) once a
second; when the parent is gone the rank is sent SIGTERM, which during training saves after the
current step like any stop signal, and killed after :data:`ORPHAN_GRACE_S` if it has not exited by
then. (Under Slurm, ``srun --kill-on-bad-exit=1`` also ends the job step when a node's torchrun dies.)
A polling thread rather than ``prctl(PR_SET_PDEATHSIG)``: that signal fires when the *thread* that
forked the rank exits, which need not be the agent's end.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

#: Seconds an orphaned rank gets to stop on its own (finish its step, save) before it is killed.
ORPHAN_GRACE_ENV = "HYFLOW_ORPHAN_GRACE_S"
ORPHAN_GRACE_S = 20.0
_POLL_S = 1.0


def exit_with_parent(grace_s: float | None = None) -> threading.Thread | None:
    """Watch this process's parent from a daemon thread (see the module docstring); returns the
    thread, or None when there is no parent to watch (started by init, or the parent is gone)."""
    parent = os.getppid()
    if parent <= 1:
        return None
    if grace_s is None:
        grace_s = float(os.environ.get(ORPHAN_GRACE_ENV, ORPHAN_GRACE_S))

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        rank = os.environ.get("RANK", "?")
        try:
            print(f"[hyflow] rank {rank}: the launcher (pid {parent}) is gone; stopping (killed in {grace_s:.0f} s "
                  "unless it stops first)", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # no terminal any more
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="hyflow-parent-watch", daemon=True)
    thread.start()
    return thread
