"""How hyflow calls Megatron's ``dist_checkpointing``: without notices that do not apply, and
with a writer-results queue that survives the signal asking for a last save."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from multiprocessing.managers import SyncManager
from typing import Iterator

from megatron.core.dist_checkpointing.strategies import filesystem_async


@contextlib.contextmanager
def quiet_dist_checkpointing(holds_nothing: bool = False) -> Iterator[None]:
    """Silence dist_checkpointing's notices that do not apply here.

    Megatron warns "Overwriting old incomplete / corrupted checkpoint" for any non-empty
    directory (ours already holds the tokenizer), and torch's DCP emits deprecation
    FutureWarnings about APIs Megatron 0.16 uses internally. ``holds_nothing``: this rank joins a
    save with an empty state dict (a pool without the model), so the validation's "Rank N common
    state dict differs from rank 0 common state dict" on the first save is expected there.
    """
    # serialization: the overwrite warning; filesystem_async: a writer's failure, which the save
    # raises again and hyflow reports in one line (the rank log keeps the traceback)
    logs = {logging.getLogger("megatron.core.dist_checkpointing.serialization"): logging.ERROR,
            logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async"): logging.CRITICAL}
    if holds_nothing:
        logs[logging.getLogger("megatron.core.dist_checkpointing.validation")] = logging.ERROR
    levels = {log: log.level for log in logs}
    for log, level in logs.items():
        log.setLevel(level)
    try:
        with warnings.catch_warnings():
            for module in (r"torch\.distributed\.checkpoint.*", r"megatron\.core\.dist_checkpointing.*"):
                warnings.filterwarnings("ignore", category=FutureWarning, module=module)
            yield
    finally:
        for log, level in levels.items():
            log.setLevel(level)


def _ignore_stop_signals() -> None:
    """Manager initializer: ignore stop signals, and exit as soon as the rank that started it
    is gone (it would be orphaned by a SIGKILLed rank otherwise)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="hyflow-parent-watch", daemon=True).start()


def stop_signal_proof_writer_queue() -> None:
    """Create the queue Megatron's checkpoint writers report through ourselves, in a manager
    process that ignores stop signals.

    Megatron starts it on the first save, as a spawned ``multiprocessing.Manager`` in the
    rank's process group. torchrun stops a rank with SIGTERM to its whole process group and
    Slurm signals every process of a job step, so the manager would die on the very signal that
    asks for a last save, and that save would fail with "Broken pipe". (The manager is still
    shut down with the rank, and SIGKILL still ends it.)"""
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_ignore_stop_signals)
    filesystem_async._results_queue = manager.Queue()
    filesystem_async._hyflow_manager = manager  # keep it alive as long as the queue
