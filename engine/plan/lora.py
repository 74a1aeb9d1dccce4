"""``hyflow plan`` for LoRA roles (``actor.lora``, ``critic.lora``): pure arithmetic, no torch.

An adapted model keeps its frozen weights, adds the adapters (per layer and target, per TP rank:
a column layer's replicated ``A`` [r, in] and its ``B`` [out / TP, r]; a row layer's ``A`` [r, in / TP]
and its replicated ``B`` [out, r]), and holds gradients (fp32 DDP buffer) and Adam state for the
adapters only (:mod:`hyflow.models.lora`). The frozen reference is the base with the adapters off,
so it costs nothing; and the generation buffer keeps the base between transitions when the
generation layout differs from the training one (:mod:`hyflow.hybrid.adapter_sync`).
"""

from __future__ import annotations

from typing import Any

from hyflow.config.units import format_bytes
from hyflow.plan import memory_estimate as mem


def layer_adapter_params(desc: Any, lora: Any, tp: int) -> int:
    """Adapter parameters of one decoder layer on one TP rank."""
    h, d, f, r = desc.hidden_size, desc.head_dim, desc.ffn_hidden_size, lora.rank
    qkv_rows = (desc.num_attention_heads + 2 * desc.num_query_groups) * d
    per_target = {
        "linear_qkv": r * h + qkv_rows * r // tp,  # column: A replicated, B split
        "linear_proj": r * desc.num_attention_heads * d // tp + h * r,  # row: A split, B replicated
        "linear_fc1": r * h + 2 * f * r // tp,
        "linear_fc2": r * f // tp + h * r,
    }
    return sum(per_target[t] for t in lora.targets)


def stage_adapter_params(desc: Any, layout: Any, lora: Any) -> list[int]:
    """Adapter parameters held by one rank of each pipeline stage."""
    return [n * layer_adapter_params(desc, lora, layout.tp) for n in layout.layers_per_stage(desc.num_layers)]


def adapt_estimates(estimates: list[mem.MemoryEstimate], desc: Any, layout: Any, lora: Any, *, dtype: str,
                    distributed_optimizer: bool, trained_extra: int = 0) -> list[mem.MemoryEstimate]:
    """Training estimates of the full model (:func:`mem.training_estimates`) turned into the LoRA
    model's: the weights stay (frozen), the adapters join them, the gradient buffer and the Adam state
    cover the adapters (plus ``trained_extra`` parameters on the last stage: a critic's value head)."""
    adapters = stage_adapter_params(desc, layout, lora)
    shard = layout.dp * layout.cp if distributed_optimizer else 1
    obytes = mem.optimizer_bytes_per_param(dtype)
    out = []
    for q, est in enumerate(estimates):
        n = adapters[q]
        trained = n + (trained_extra if q == len(estimates) - 1 else 0)
        new = mem.MemoryEstimate(est.phase, stage=est.stage)
        for item in est.items:
            if item.name == "weights":
                new.add("weights", item.bytes, item.note + ", frozen")
                new.add("adapters", n * mem.DTYPE_BYTES[dtype], f"LoRA rank {lora.rank}: {n:,} params")
            elif item.name == "grads":
                new.add("grads", trained * 4, "fp32 DDP gradient buffer of the trained params only")
            elif item.name == "optimizer":
                new.add("optimizer", trained * obytes / shard,
                        f"Adam {obytes} B/param of the trained params" + (f" / {shard}" if shard > 1 else ""))
            else:
                new.add(item.name, item.bytes, item.note)
        out.append(new)
    return out


def savings_note(role: str, full: list[mem.MemoryEstimate], adapted: list[mem.MemoryEstimate], lora: Any,
                 reference_bytes: int = 0) -> str:
    """One line: what LoRA saves per GPU in ``role``'s update (and the reference it makes free)."""
    before, after = mem.worst(full).total, mem.worst(adapted).total
    line = (f"{role}.lora (rank {lora.rank}, {', '.join(lora.targets)}): the {role} update needs "
            f"{format_bytes(after)} per GPU instead of {format_bytes(before)} for full fine-tuning "
            f"(gradients and Adam state of the adapters only: {format_bytes(before - after)} less)")
    if reference_bytes:
        line += f"; the reference is the base with the adapters off ({format_bytes(reference_bytes)} less)"
    return line
