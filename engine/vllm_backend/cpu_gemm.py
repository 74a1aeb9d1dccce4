"""How vLLM's CPU build runs its linear layers (``rollout.vllm.cpu_gemm``): on packed copies of
the weights, or on the live weights through torch's ``linear``.

vLLM 0.32's CPU build packs every unquantized linear layer's weight for its GEMM kernels once the
weights are loaded (``UnquantizedLinearMethod.process_weights_after_loading`` ->
``dispatch_cpu_unquantized_gemm``: a oneDNN handler, or sgl's ``convert_weight_packed`` for small
ones, kept in the closure ``layer.cpu_linear``) and drops the plain weight; the output layer keeps
its weight *and* a packed copy. Packing is a pass over every weight, and an RL job loads new
weights every step, so with ``packed`` each transition re-packs (~1 s for 443M parameters on 2
cores, BENCHMARKS.md). ``plain`` keeps the weights vLLM loads and runs ``torch.nn.functional.linear``
on them, as vLLM's GPU build does: the transition's in-place load is one copy per tensor
(:mod:`hyflow.vllm_backend.inplace`'s path for weights vLLM keeps), no packing step.

vLLM has no engine argument or environment variable for this. It does honour a per-layer flag,
``_cpu_skip_gemm_dispatch`` (set on MLA's ``kv_b_proj``): the layer's post-load processing then
sets ``cpu_linear = torch.nn.functional.linear`` and keeps the weight, at start-up and in every
later reload (vLLM's ``reload_weights`` re-runs the processing on the same module). So
:func:`set_cpu_gemm` sets or clears that flag on every unquantized linear layer, gives a packed
layer back a weight of its shape (the packed copy goes with the old ``cpu_linear``: memory does not
grow) and re-runs vLLM's own processing, then checks the result. The output layer's method does not
read the flag: its ``cpu_linear`` is set (plain) or its processing re-run (packed) directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyflow.vllm_backend.config import CPU_GEMM_MODES


def set_cpu_gemm(model: torch.nn.Module, mode: str) -> None:
    """Put every unquantized linear layer of vLLM's ``model`` (and its output layer) in ``mode``
    (module docstring). A layer already in ``mode`` is left as it is; one that changes keeps its
    weight's values when it is packed, and gets zeros when it is unpacked (a packed copy cannot be
    read back: the next weight load writes them). No-op outside vLLM's CPU platform."""
    # optional dependency (loaded by then)
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if mode not in CPU_GEMM_MODES:
        raise ValueError(f"cpu_gemm must be one of {', '.join(CPU_GEMM_MODES)}, got {mode!r}")
    if not current_platform.is_cpu():
        return
    plain = mode == "plain"
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(layer, LinearBase) and type(method) is UnquantizedLinearMethod:
            if is_plain(layer) == plain and (plain or layer.weight.numel() == 0):
                continue
            layer._cpu_skip_gemm_dispatch = plain
            weight = layer.weight
            if weight.numel() == 0:  # packed: vLLM dropped the plain weight
                shape = (sum(layer.output_partition_sizes), layer.input_size_per_partition)
                layer.weight = torch.nn.Parameter(torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                                                  requires_grad=False)
            bias = getattr(layer, "bias", None)
            if plain and bias is not None and bias.dtype != layer.weight.dtype:
                bias.data = bias.data.to(layer.weight.dtype)  # sgl's packing keeps biases in fp32
            method.process_weights_after_loading(layer)
            if is_plain(layer) != plain or (plain and layer.weight.numel() == 0):
                raise RuntimeError(f"vLLM's {name} did not switch to rollout.vllm.cpu_gemm={mode} (its CPU GEMM "
                                   "dispatch no longer honours _cpu_skip_gemm_dispatch): use cpu_gemm=packed")
        elif isinstance(layer, ParallelLMHead) and type(method) is UnquantizedEmbeddingMethod:
            if plain:
                layer.cpu_linear = F.linear
            elif is_plain(layer):
                method.process_weights_after_loading(layer)


def is_plain(layer: torch.nn.Module) -> bool:
    """Whether vLLM runs ``layer``'s GEMM with torch's ``linear`` on its live weight."""
    return getattr(layer, "cpu_linear", None) is F.linear


def holds_packed_copy(layer: torch.nn.Module) -> bool:
    """Whether vLLM's CPU build runs ``layer``'s GEMM on a copy it packed (rebuilt after each load)."""
    return callable(getattr(layer, "cpu_linear", None)) and not is_plain(layer)
