"""Each redirection of the CPU compatibility layer, tested directly (in-process)."""

import pytest
import torch

import hyflow.compat.cpu as compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for machines without CUDA")


@pytest.fixture
def active():
    was_active = compat.is_active()
    compat.activate()
    yield
    compat.deactivate()
    if was_active:
        compat.activate()


@pytest.fixture
def inactive():
    was_active = compat.is_active()
    compat.deactivate()
    yield
    if was_active:
        compat.activate()


def test_without_layer_megatron_idioms_fail(inactive):
    # The reason the layer exists: these are what Megatron-Core does on every path.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.empty(2, device="cuda")


def test_current_device_is_cpu(active):
    dev = torch.cuda.current_device()
    assert dev == torch.device("cpu")
    t = torch.zeros(3, device=torch.cuda.current_device())
    assert t.device.type == "cpu"
    assert torch.ones(2).to(torch.cuda.current_device()).device.type == "cpu"


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0])
@pytest.mark.parametrize("factory", ["empty", "zeros", "ones", "rand", "randn"])
def test_factories_map_cuda_to_cpu(active, device, factory):
    t = getattr(torch, factory)(2, 3, device=device)
    assert t.device.type == "cpu" and t.shape == (2, 3)


def test_other_factories_and_like(active):
    assert torch.tensor([1, 2], device="cuda").device.type == "cpu"
    assert torch.arange(4, device="cuda").tolist() == [0, 1, 2, 3]
    assert torch.full((2,), 7.0, device="cuda").tolist() == [7.0, 7.0]
    base = torch.ones(2)
    assert torch.zeros_like(base, device="cuda").device.type == "cpu"
    assert torch.empty(2, device="cpu").device.type == "cpu"  # untouched


def test_tensor_cuda_and_to(active):
    t = torch.arange(3.0)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(device="cuda:0", dtype=torch.float64).dtype == torch.float64
    assert t.to(torch.float16).dtype == torch.float16  # non-device arguments unchanged


def test_tensor_type_strings(active):
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
    converted = torch.zeros(2).type("torch.cuda.HalfTensor")
    assert converted.dtype == torch.float16 and converted.device.type == "cpu"
    assert torch.zeros(2).type(torch.float64).dtype == torch.float64


def test_cuda_rng_is_the_cpu_generator(active):
    torch.cuda.manual_seed(11)
    a = torch.randn(5)
    torch.manual_seed(11)
    b = torch.randn(5)
    assert torch.equal(a, b)
    state = torch.cuda.get_rng_state()
    x = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3), x)


def test_megatron_rng_tracker_forks(active):
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0)
    tracker = mrandom.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        in_fork = torch.rand(4)
    # The default stream is untouched by the fork ...
    assert torch.equal(torch.get_rng_state(), before)
    # ... the fork draws from the model-parallel seed (seed + 2718 + tp_rank) ...
    torch.manual_seed(123 + 2718 + 1)
    assert torch.equal(in_fork, torch.rand(4))
    # ... and a second fork continues that stream instead of restarting it.
    torch.set_rng_state(before)
    with tracker.fork():
        second = torch.rand(4)
    torch.manual_seed(123 + 2718 + 1)
    torch.rand(4)
    assert torch.equal(second, torch.rand(4))
    # A different tp_rank gives a different stream.
    mrandom.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with mrandom.get_cuda_rng_tracker().fork():
        other = torch.rand(4)
    assert not torch.equal(other, in_fork)


def test_synchronize_streams_and_memory_queries(active):
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    e = torch.cuda.Event()
    e.record()
    e.synchronize()
    with torch.cuda.stream(s):
        pass
    assert torch.cuda.memory_allocated() == 0


def test_deactivate_restores_every_original(active):
    patched = torch.empty
    compat.deactivate()
    assert torch.empty is not patched
    assert not compat.is_active()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    compat.activate()
    assert compat.is_active()


def test_refuses_to_activate_where_cuda_exists(inactive, monkeypatch):
    monkeypatch.setattr(compat, "_cuda_really_available", lambda: True)
    with pytest.raises(compat.CpuCompatError, match="must not run on a machine with CUDA"):
        compat.activate()
    assert compat.maybe_activate() is False
    assert not compat.is_active()


def test_opt_out_by_environment(inactive, monkeypatch):
    monkeypatch.setenv("HYFLOW_CPU_COMPAT", "0")
    assert compat.maybe_activate() is False
    assert not compat.is_active()
    monkeypatch.setenv("HYFLOW_CPU_COMPAT", "1")
    assert compat.maybe_activate() is True


def _layer_state() -> tuple:
    return compat.is_active(), torch.tensor is _ORIGINAL_TENSOR


_ORIGINAL_TENSOR = torch.tensor


def test_single_rank_in_process_run_leaves_the_callers_process_unpatched(inactive):
    """``run_ranks(fn, 1)`` runs ``fn`` in this process (``hyflow export`` does): the layer is on
    for ``fn`` and off again afterwards, so the caller's torch (and HF models it loads later,
    whose rotary buffers the patched ``torch.tensor`` corrupts) is left as it was."""
    import torch.distributed as dist

    from hyflow.tools.convert.launch import run_ranks

    if dist.is_initialized():
        pytest.skip("needs a process without a process group")
    assert run_ranks(_layer_state, 1) == [(True, False)]
    assert _layer_state() == (False, True)


def test_device_context_still_sees_wrapped_factories():
    """In a fresh interpreter (torch's cache of factory functions not yet built), factories
    called inside ``with torch.device("meta")`` land on meta while the layer is active, and an
    HF Llama-3 model loaded meanwhile has the same rotary frequencies as one built without it."""
    import subprocess
    import sys

    code = """
import torch, tempfile
from hyflow.compat import cpu
from hyflow.testing.tiny_models import make_tiny_hf_model
path = tempfile.mkdtemp()
ref = make_tiny_hf_model(path, "llama3", weights_format="safetensors").model.rotary_emb.inv_freq
cpu.activate()
with torch.device("meta"):
    devices = {torch.tensor([1.0]).device.type, torch.zeros(2).device.type, torch.arange(3).device.type,
               torch.full((2,), 1.0).device.type}
from transformers import AutoModelForCausalLM
loaded = AutoModelForCausalLM.from_pretrained(path).model.rotary_emb.inv_freq
print(sorted(devices), torch.equal(ref, loaded))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['meta'] True"


def test_moe_dispatcher_split_sizes_become_numpy(active):
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert type(splits).__module__ == "numpy" and splits.tolist() == [3, 1]
    kept = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]))
    assert torch.is_tensor(kept)
    assert moe_utils.te_general_gemm is None  # Transformer Engine absent: the router's matmul path


def _uneven_collectives():
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    rank, group = dist.get_rank(), dist.group.WORLD
    sizes = [2, 3]
    mine = torch.full((sizes[rank], 4), float(rank + 1))
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
    blocks = torch.arange(5 * 4, dtype=torch.float32).view(5, 4) * (rank + 1)
    reduced = mappings._reduce_scatter_along_first_dim(blocks, group, input_split_sizes=sizes)
    return gathered, reduced


@pytest.mark.multirank
def test_uneven_gather_and_reduce_scatter_on_gloo():
    """Expert tensor parallelism's token blocks of different sizes per rank (NCCL's uneven
    collectives) go through gloo padded to the largest block and trimmed back."""
    from hyflow.testing import run_on_ranks

    results = run_on_ranks(_uneven_collectives, 2)
    want_gather = torch.cat([torch.full((2, 4), 1.0), torch.full((3, 4), 2.0)])
    full = torch.arange(5 * 4, dtype=torch.float32).view(5, 4) * 3  # rank 0's x1 plus rank 1's x2
    for rank, (gathered, reduced) in enumerate(results):
        assert torch.equal(gathered, want_gather)
        assert torch.equal(reduced, full[:2] if rank == 0 else full[2:])
