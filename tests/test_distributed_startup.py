"""A rank's start-up settings for CUDA: the collective timeout, the environment, the default dtype.

``trainer.collective_timeout_s``: how long a collective or receive may wait, on every group.

Placement pools wait inside a receive for the other pool's whole generation or update, so the
timeout must bound a phase, and it must hold for the groups created after start-up too: torch's
``new_group`` ignores ``init_process_group``'s timeout and takes its own default (10 minutes on
NCCL), which tripped on any longer phase. gloo has the same timeout semantics as NCCL's watchdog
here: two ranks, the second sleeps before it sends on a new group, the first waits in ``recv``.
"""

import os
import subprocess
import sys
import pytest

from hyflow.parallel.distributed import free_port

SCRIPT = r"""
import os, time
import torch, torch.distributed as dist
from hyflow.parallel.distributed import init_distributed, set_group_timeout

def wait_in_recv(sleep):
    group = dist.new_group([0, 1])  # as the pools' groups are created, after start-up
    t = torch.zeros(1)
    if dist.get_rank() == 1:
        time.sleep(sleep)
        try:
            dist.send(t + 1, 0, group=group)
        except RuntimeError:
            pass
        return
    start = time.perf_counter()
    try:
        dist.recv(t, 1, group=group)
        print(f"RECEIVED {time.perf_counter() - start:.1f}", flush=True)
    except RuntimeError as e:
        print(f"TIMEOUT {time.perf_counter() - start:.1f}: {str(e).splitlines()[0][:100]}", flush=True)

init_distributed(timeout_s=2)
wait_in_recv(sleep=5)  # longer than the timeout: the receive gives up after 2 s
set_group_timeout(30)
wait_in_recv(sleep=3)  # a phase shorter than the timeout: the receive waits for it
os._exit(0)  # no teardown of groups whose peer gave up
"""


@pytest.mark.multirank
def test_the_timeout_holds_on_groups_made_after_start_up():
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        out = procs[0].communicate(timeout=300)[0]
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [line for line in out.splitlines() if line.startswith(("TIMEOUT", "RECEIVED"))]
    assert len(lines) == 2, out
    # the configured 2 s, not torch's default for new gloo groups (30 min; NCCL's 10 min)
    assert lines[0].startswith("TIMEOUT") and float(lines[0].split()[1].rstrip(":")) < 4.5, out
    assert lines[1].startswith("RECEIVED"), out


def test_the_default_outlasts_long_phases_and_is_configurable():
    from hyflow.jobs.registry import load_job_config
    from hyflow.parallel.distributed import DEFAULT_TIMEOUT_S
    from hyflow.testing.rl import QUICKSTART

    assert DEFAULT_TIMEOUT_S >= 3600  # NCCL's 600 s tripped on a 10-minute generation of the other pool
    assert load_job_config(QUICKSTART, []).trainer.collective_timeout_s == DEFAULT_TIMEOUT_S
    assert load_job_config(QUICKSTART, ["trainer.collective_timeout_s=7200"]).trainer.collective_timeout_s == 7200


def test_ranks_get_cuda_device_max_connections_from_every_launcher(monkeypatch):
    """Megatron orders TP/SP communication with compute only with one CUDA connection: the Slurm
    launcher set it, the local one and a directly started rank did not."""
    from hyflow.parallel.distributed import set_rank_env

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    set_rank_env()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # what the environment says wins
    set_rank_env()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_dtype_auto_is_bf16_on_a_gpu_and_fp32_on_the_cpu(monkeypatch):
    import torch

    from hyflow.jobs.registry import load_job_config
    from hyflow.parallel import distributed
    from hyflow.testing.rl import QUICKSTART

    assert load_job_config(QUICKSTART, []).actor.dtype == "fp32"  # this machine: no CUDA
    monkeypatch.setattr(distributed, "rank_device", lambda: torch.device("cuda", 0))
    assert load_job_config(QUICKSTART, []).actor.dtype == "bf16"
    assert load_job_config(QUICKSTART, ["actor.dtype=fp32"]).actor.dtype == "fp32"  # explicit wins


def test_megatron_fusions_on_a_gpu_with_te_or_apex(monkeypatch):
    import torch

    from hyflow.models import builder
    from hyflow.models.description import tiny_llama
    from hyflow.parallel.groups import ParallelGroups
    from hyflow.parallel.layout import Layout

    def config(device, backends):
        monkeypatch.setattr(builder, "fusion_backends", lambda: backends)
        groups = ParallelGroups(layout=Layout(), pgs=None, rank=0, coords={"tp": 0, "pp": 0, "dp": 0, "cp": 0},
                                device=torch.device(device))
        return builder.transformer_config(tiny_llama(), groups, "bf16", perform_initialization=False)

    on = config("cuda", ("te",))
    assert on.bias_activation_fusion and on.masked_softmax_fusion
    for device, backends in (("cuda", ()), ("cpu", ("te",))):  # no kernels, or the CPU: the plain path
        off = config(device, backends)
        assert not off.bias_activation_fusion and not off.masked_softmax_fusion
