"""Model FLOPs of an RL step and the device's peak: the cost model of ``hyflow plan`` (stages,
throughput) and the MFU that ``hyflow bench rl`` reports.

FLOPs count the useful work of the step's real (unpadded) tokens, as MFU does everywhere:
a forward pass over ``t`` tokens whose attention sees ``c`` earlier positions on average costs
``t * (2 * P + 4 * L * q * c)`` where ``P`` counts the weights of the matrix multiplies (attention
projections, MLP, output layer; not the embedding lookup), ``L`` the layers and ``q`` the query
width (heads x head_dim); ``c`` is half the mean sequence (causal). A backward pass costs
twice its forward.

Per step, with ``T`` tokens (prompt + response):

* generation: one forward over ``T`` (prefill + decode with the KV cache);
* old log-probs (``actor.old_logprobs=recompute``), reference (``reference.enable``): one
  forward each; critic values: one forward of the critic (no output layer);
* updates: ``3 x forward x actor.ppo_epochs`` for the actor, and for the critic.

Peaks: on GPU the datasheet's dense figure for the model's dtype; on CPU a measured one
(:func:`measure_cpu_peak`).
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from hyflow.models.stage_split import matmul_params  # noqa: F401 - re-exported: part of the FLOP model

#: Dense datasheet peaks in TFLOP/s per GPU: (name fragment, {dtype: peak}); first match wins.
GPU_PEAKS_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H800", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
)


def forward_flops(desc: Any, tokens: float, mean_seq: float, output_layer: bool = True) -> float:
    """FLOPs of a forward pass over ``tokens`` tokens of sequences of mean length ``mean_seq``."""
    attention = 4 * desc.num_layers * desc.num_attention_heads * desc.head_dim * (mean_seq / 2)
    return tokens * (2 * matmul_params(desc, output_layer) + attention)


def step_flops(cfg: Any, tokens: float, rows: int, response_tokens: Optional[float] = None) -> dict[str, float]:
    """Model FLOPs of one RL step by phase, for a resolved RL job config. With
    ``response_tokens`` and ``actor.fused_output_layer``, the scoring and update passes count the
    output layer on response tokens only (all the loss needs, and all they compute)."""
    desc = cfg.model
    seq = tokens / max(rows, 1)
    fwd = forward_flops(desc, tokens, seq)
    critic_fwd = forward_flops(desc, tokens, seq, output_layer=False)
    gen = fwd
    if response_tokens is not None and getattr(cfg.actor, "fused_output_layer", False):
        fwd = critic_fwd + 2 * desc.hidden_size * desc.vocab_size * response_tokens
    critic = bool(getattr(cfg.critic, "enable", False))
    out = {"generate": gen,
           "ref": fwd * ((cfg.actor.old_logprobs != "rollout") + bool(cfg.reference.enable)),
           "critic": critic_fwd if critic else 0.0,
           "update": 3 * cfg.actor.ppo_epochs * (fwd + (critic_fwd if critic else 0.0))}
    out["step"] = sum(out.values())
    return out


def measure_cpu_peak(threads: int = 1, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` fp32 matmul with ``threads`` torch threads: the best of ``repeats``
    timings of 3 products (2 n^3 FLOPs each), after one untimed product. Timed in process CPU
    time per thread, so other load on the machine does not lower the peak (it lowers the MFU of
    a job that runs under it, which is what MFU should show)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            for _ in range(3):
                torch.mm(a, b)
            best = min(best, (time.process_time() - start) / 3 / max(1, threads))
    finally:
        torch.set_num_threads(saved)
    return 2 * n ** 3 / best


def gpu_peak(name: str, dtype: str) -> Optional[float]:
    """Datasheet FLOP/s of GPU ``name`` for ``dtype`` (``bf16``/``fp16``/``fp32``); None if unknown."""
    for fragment, peaks in GPU_PEAKS_TFLOPS:
        if fragment.lower() in name.lower():
            value = peaks.get(dtype)
            return None if value is None else value * 1e12
    return None


def device_peak(dtype: str, threads: int = 1) -> tuple[float, str]:
    """``(FLOP/s per rank, how it was obtained)`` for this machine's ranks."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        peak = gpu_peak(name, dtype)
        if peak is not None:
            return peak, f"{name} datasheet dense {dtype} peak"
        return float("nan"), f"{name}: no datasheet peak known (pass --peak-tflops)"
    peak = measure_cpu_peak(threads)
    return peak, (f"measured: best of 5 CPU-time timings of a 1024x1024 fp32 matmul on {threads} torch "
                  f"thread(s) per rank")
