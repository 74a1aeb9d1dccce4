"""Tests of the multi-rank harness (hyflow.testing.multirank): pooling, failures, state reset."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

import pytest

from hyflow.testing import MultiRankError, default_timeout, run_on_ranks, run_on_ranks_fresh

pytestmark = pytest.mark.multirank


# ----------------------------------------------------------------------------- tasks (module level)


def _rank_info(scale: float, *, offset: float = 0.0) -> Tuple[int, int, float, str, int]:
    """rank, world size, all_reduce(rank) * scale + offset, $RANK, pid."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item() * scale + offset, os.environ["RANK"], os.getpid()


def _all_gather_ranks() -> List[int]:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([dist.get_rank()]))
    return [int(t.item()) for t in out]


def _raise_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank-one-exploded-7f3a")
    dist.barrier()  # rank 0 blocks here forever: rank 1 never arrives


def _die_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def _sleep(seconds: float, child_pid_file: str = "") -> None:
    """Sleep; optionally first start a grandchild process (which the harness must clean up)."""
    if child_pid_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(child_pid_file, "w") as handle:
            handle.write(str(child.pid))
    time.sleep(seconds)


def _process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (absent, or a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _print_marker(marker: str) -> int:
    import torch.distributed as dist

    print(f"{marker} {dist.get_rank()}", flush=True)
    return dist.get_rank()


def _megatron_layout(tp: int, leak: bool) -> Dict[str, Any]:
    """Check the state is clean, initialize parallel_state with ``tp``, report, leave a mess."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    clean = {
        "initialized_before": ps.model_parallel_is_initialized(),
        "groups_before": len(dist.distributed_c10d._world.pg_map),
        "leak_env_before": os.environ.get("HYFLOW_HARNESS_LEAK"),
        "dtype_before": str(torch.get_default_dtype()),
    }
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    value = torch.tensor([1.0])
    dist.all_reduce(value, group=ps.get_tensor_model_parallel_group())
    if leak:  # deliberately leave global state behind for the harness to clean up
        dist.new_group(list(range(dist.get_world_size())))
        os.environ["HYFLOW_HARNESS_LEAK"] = "1"
        torch.set_default_dtype(torch.float64)
    return {**clean, "tp": ps.get_tensor_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "tp_sum": value.item()}


# ----------------------------------------------------------------------------- tests


def _groups_with_comm_stats() -> int:
    """Build a layout's groups, register them with the communication monitor (as the jobs do),
    run a collective on each; return this process's thread count before the build."""
    import torch
    import torch.distributed as dist

    from hyflow.monitor import comm
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    before = len(os.listdir("/proc/self/task"))
    groups = init_training_groups(Layout(tp=2))
    comm.register_collection(groups.pgs)
    for group in (groups.pgs.tp, groups.pgs.dp, groups.pgs.pp):
        dist.all_reduce(torch.ones(1), group=group)
    return before


def test_results_per_rank_in_rank_order() -> None:
    results = run_on_ranks(_rank_info, 2, 10.0, offset=0.5)
    assert [r[0] for r in results] == [0, 1]
    assert [r[1] for r in results] == [2, 2]
    assert [r[2] for r in results] == [10.5, 10.5]  # all_reduce(0 + 1) * 10 + 0.5
    assert [r[3] for r in results] == ["0", "1"]
    assert len({r[4] for r in results}) == 2 and os.getpid() not in {r[4] for r in results}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_world_sizes(world_size: int) -> None:
    assert run_on_ranks(_all_gather_ranks, world_size) == [list(range(world_size))] * world_size


def test_pool_is_reused_and_much_faster_than_a_fresh_start() -> None:
    pids = [r[4] for r in run_on_ranks(_rank_info, 2, 1.0)]
    start = time.monotonic()
    again = run_on_ranks(_rank_info, 2, 1.0)
    reuse_s = time.monotonic() - start
    assert [r[4] for r in again] == pids

    start = time.monotonic()
    fresh = run_on_ranks_fresh(_rank_info, 2, 1.0)
    fresh_s = time.monotonic() - start
    assert [r[2] for r in fresh] == [1.0, 1.0]
    assert not set(pids) & {r[4] for r in fresh}
    assert reuse_s < 1.0 and reuse_s * 5 < fresh_s, (reuse_s, fresh_s)
    assert [r[4] for r in run_on_ranks(_rank_info, 2, 1.0)] == pids  # fresh left the pool alone


def test_megatron_state_is_reset_between_tasks() -> None:
    first = run_on_ranks(_megatron_layout, 2, 2, True)
    second = run_on_ranks(_megatron_layout, 2, 1, False)
    for rank in range(2):
        assert (first[rank]["tp"], first[rank]["dp"], first[rank]["tp_sum"]) == (2, 1, 2.0)
        assert (second[rank]["tp"], second[rank]["dp"], second[rank]["tp_sum"]) == (1, 2, 1.0)
        for key in ("initialized_before", "leak_env_before"):
            assert not first[rank][key] and not second[rank][key]
        assert second[rank]["groups_before"] == first[rank]["groups_before"]  # extra groups destroyed
        assert second[rank]["dtype_before"] == "torch.float32"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_process_groups_and_their_threads_go_between_tasks() -> None:
    """A gloo group's threads end when its last reference goes; the communication monitor's
    registry held every group alive, so a worker grew ~80 threads per RL step until scheduling
    them dominated the suite (63 min on CI)."""
    counts = [run_on_ranks(_groups_with_comm_stats, 2) for _ in range(4)]
    assert counts[-1] == counts[1], counts  # after the first task, nothing accumulates


def test_worker_output_is_streamed_with_rank_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    marker = "harness-marker-51c2"
    assert run_on_ranks(_print_marker, 2, marker) == [0, 1]
    seen = ""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and f"[rank 1] {marker} 1" not in seen:
        time.sleep(0.05)
        seen += capsys.readouterr().err
    assert f"[rank 0] {marker} 0" in seen and f"[rank 1] {marker} 1" in seen


def test_bad_arguments_fail_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(lambda: 0, 2)
    with pytest.raises(ValueError):
        run_on_ranks(_sleep, 0, 0.0)
    monkeypatch.setenv("HYFLOW_TEST_TIMEOUT", "7.5")
    assert default_timeout() == 7.5


def test_exception_on_one_rank_while_other_is_blocked_in_a_collective() -> None:
    old_pids = [r[4] for r in run_on_ranks(_rank_info, 2, 1.0)]
    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_raise_on_rank_one, 2, timeout=15)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1" in message and "ValueError: rank-one-exploded-7f3a" in message
    assert "Traceback (most recent call last)" in message and "_raise_on_rank_one" in message
    assert info.value.raised == [1] and info.value.timed_out == [0] and info.value.finished == []
    assert elapsed < 15, elapsed
    # The broken pool was discarded: the next call works on new processes.
    results = run_on_ranks(_rank_info, 2, 1.0)
    assert [r[2] for r in results] == [1.0, 1.0]
    assert not set(old_pids) & {r[4] for r in results}


def test_hard_worker_death_is_detected_fast() -> None:
    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_die_on_rank_one, 2, timeout=60)
    elapsed = time.monotonic() - start
    assert info.value.died == [1] and "rank 1 died (exit code 7)" in str(info.value)
    assert elapsed < 10, elapsed  # far below the 60 s timeout


def test_timeout_kills_the_stuck_ranks_and_their_children(tmp_path: Any) -> None:
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_sleep, 1, 60.0, str(pid_file), timeout=1.5)
    elapsed = time.monotonic() - start
    assert info.value.timed_out == [0] and "rank 0 timed out" in str(info.value)
    assert "_sleep" in str(info.value)  # the faulthandler stack dump of the stuck rank
    assert elapsed < 8, elapsed
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 3
    while not _process_gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _process_gone(child), "the task's own child process outlived the killed pool"
