"""Run a function on N local CPU/GPU ranks for the converters.

World size 1 runs in this process (a one-rank group). Larger worlds spawn N
fresh processes that join a group on 127.0.0.1; each returns its result through
a pipe. Conversion works on host memory only, so the backend is always gloo
(also on GPU machines), and the CPU layer is activated where CUDA is absent. If
one rank fails, the others are stopped at once and the failing rank's traceback
is raised here as :class:`RankFailure`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable
import datetime

import torch.distributed as dist

from hyflow.compat import cpu
from hyflow.parallel.distributed import free_port


class RankFailure(RuntimeError):
    """A rank raised or died; the message holds its traceback or exit status."""


def _exit_with_parent() -> None:
    """Stop this rank as soon as the launching process is gone (no orphaned ranks)."""
    parent = mp.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(3)


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple,
               conn: Connection) -> None:
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    threads = max(1, (os.cpu_count() or 1) // world)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(threads))
    try:
        # torch and Megatron load only in the ranks: `hyflow --help` imports this module (bench, convert)
        import torch

        torch.set_num_threads(threads)
        _init_gloo(rank, world, port)
        try:
            result = ("ok", fn(*args))
        finally:
            _shutdown()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("err", f"{type(e).__name__}: {e}", traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(result))
    except Exception as e:  # noqa: BLE001
        conn.send_bytes(pickle.dumps(("err", f"result not picklable: {e}", "")))
    conn.close()


def _init_gloo(rank: int, world: int, port: int) -> None:
    cpu.maybe_activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(hours=2))


def _shutdown() -> None:
    # torch and Megatron load only in the ranks: `hyflow --help` imports this module (bench, convert)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _in_process(fn: Callable[..., Any], args: tuple) -> list[Any]:
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("run_ranks(world_size=1) inside a multi-rank job; call the rank "
                               "function directly on every rank instead")
        return [fn(*args)]
    was_active = cpu.is_active()
    _init_gloo(0, 1, free_port())
    try:
        return [fn(*args)]
    finally:
        _shutdown()
        if not was_active and cpu.is_active():
            cpu.deactivate()  # leave the caller's process as it was (its torch is not ours to patch)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``; ``fn`` must be module-level."""
    if world_size == 1:
        return _in_process(fn, args)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, args, child),
                           name=f"hyflow-convert-rank{rank}")
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    results: dict[int, Any] = {}
    try:
        pending = set(range(world_size))
        while pending:
            ready = wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending])
            for rank in sorted(pending):
                if conns[rank] in ready or conns[rank].poll():
                    try:
                        reply = pickle.loads(conns[rank].recv_bytes())
                    except EOFError:
                        reply = None
                elif procs[rank].sentinel in ready:
                    reply = None
                else:
                    continue
                pending.discard(rank)
                if reply is None:
                    procs[rank].join(5)
                    raise RankFailure(f"rank {rank} of {world_size} died (exit code "
                                      f"{procs[rank].exitcode}) without reporting")
                if reply[0] == "err":
                    raise RankFailure(f"rank {rank} of {world_size} failed: {reply[1]}\n{reply[2]}")
                results[rank] = reply[1]
    finally:
        for proc in procs:
            if proc.is_alive() and len(results) < world_size:
                proc.terminate()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]
