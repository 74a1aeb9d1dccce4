"""How a model's decoder layers split over pipeline stages: the per-token cost of a decoder layer
and of the output layer (the FLOP model of :mod:`hyflow.plan.flops`, which ``hyflow plan`` and
``hyflow bench rl`` use), and the split in Megatron-Core's form (any first and last stage count,
the middle stages equal) that makes the last stage, which also runs the output layer, cost what the
others cost. :func:`resolve_stage_layers` fills in ``Layout.stage_layers`` when a config leaves it
null; it is pure arithmetic on the config, so every rank and ``hyflow plan`` pick the same split.

A decoder layer costs ``2 P_layer + 4 q c`` FLOPs per token forward (``P_layer`` its
matrix-multiply weights, ``q`` the query width, ``c`` half the mean sequence), the output layer
``2 h V`` per *scored* token; a training pass costs 3x its forward, the fused output head
(``actor.fused_output_layer``) scores response tokens only and recomputes its logits in the
backward (4x instead of 3x).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence


def matmul_params(desc: Any, output_layer: bool = True) -> int:
    """Weights that take part in a matrix multiply, per token (all layers; a mixture-of-experts
    layer's router, its ``top_k`` routed experts and its shared expert)."""
    h, f, d = desc.hidden_size, desc.ffn_hidden_size, desc.head_dim
    q, kv = desc.num_attention_heads * d, 2 * desc.num_query_groups * d
    moe = getattr(desc, "moe", None)
    mlp = 3 * h * f  # gated (SwiGLU), every family hyflow builds
    if moe is not None:
        mlp = moe.layer_parameters(h, active=True) - (h if moe.shared_expert_gate else 0)
    per_layer = h * (q + kv) + q * h + mlp
    return desc.num_layers * per_layer + (h * desc.vocab_size if output_layer else h)


def layer_flops(desc: Any, mean_seq: float) -> float:
    """Forward FLOPs of one decoder layer per token."""
    per_layer = (matmul_params(desc, output_layer=False) - desc.hidden_size) / desc.num_layers
    return 2 * per_layer + 4 * desc.num_attention_heads * desc.head_dim * (mean_seq / 2)


def head_flops(desc: Any) -> float:
    """Forward FLOPs of the output layer per scored token."""
    return 2.0 * desc.hidden_size * desc.vocab_size


def head_in_layers(desc: Any, mean_seq: float, response_fraction: float = 1.0, fused: bool = True) -> float:
    """The last stage's output layer in decoder layers' worth of training work (per token)."""
    head = head_flops(desc) * (response_fraction * 4 / 3 if fused else 1.0)
    return head / layer_flops(desc, mean_seq)


def stage_costs(layers: Sequence[int], head_layers: float) -> list[float]:
    """Per-stage cost in layers' worth: its layers, plus the output layer on the last stage."""
    return [n + (head_layers if i == len(layers) - 1 else 0.0) for i, n in enumerate(layers)]


def balanced_stage_layers(num_layers: int, pp: int, head_layers: float) -> list[int]:
    """Layers per stage minimising the slowest stage, in the form Megatron-Core accepts: any
    first and last stage counts, the middle stages equal. Ties keep the split most even."""
    if pp <= 1:
        return [num_layers]
    best: Optional[tuple[float, int, list[int]]] = None
    for first in range(1, num_layers):
        for last in range(1, num_layers - first + 1):
            rest = num_layers - first - last
            if pp == 2 and rest:
                continue
            if pp > 2 and (rest <= 0 or rest % (pp - 2)):
                continue
            layers = [first] + [rest // (pp - 2)] * (pp - 2) + [last] if pp > 2 else [first, last]
            key = (max(stage_costs(layers, head_layers)), max(layers) - min(layers))
            if best is None or key < best[:2]:
                best = (key[0], key[1], layers)
    if best is None:
        raise ValueError(f"{num_layers} layers cannot fill {pp} pipeline stages")
    return best[2]


def job_head_layers(cfg: Any, desc: Any) -> float:
    """The output layer in decoder layers' worth of training work for ``cfg``'s actor, sequences
    assumed half the config's bounds (prompt ``max_prompt_length / 2``, response ``max_new_tokens / 2``)."""
    rollout = getattr(cfg, "rollout", None)
    prompt = (getattr(rollout, "max_prompt_length", None) or getattr(cfg.data, "max_length", 512)) / 2
    response = (getattr(rollout, "max_new_tokens", 0) or 0) / 2
    fused = bool(getattr(cfg.actor, "fused_output_layer", False))
    mean_seq = prompt + response
    r_frac = response / mean_seq if response else 1.0
    return head_in_layers(desc, mean_seq, r_frac if fused else 1.0, fused)


def resolve_stage_layers(layout: Any, desc: Any, head_layers: float) -> Any:
    """``layout`` with ``stage_layers`` filled in when it is null: :func:`balanced_stage_layers`
    for a model whose last stage carries an output layer of ``head_layers`` layers' worth. Pure
    arithmetic on the config, so every rank (and ``hyflow plan``) picks the same split. Unchanged
    without a pipeline, with an explicit split, or with virtual stages (Megatron-Core's uneven
    split and the interleaved schedule are not combined here)."""
    if layout.stage_layers is not None or layout.pp == 1 or layout.vpp:
        return layout
    if desc.num_layers < layout.pp:
        return layout  # check_model names the problem
    return dataclasses.replace(layout, stage_layers=balanced_stage_layers(desc.num_layers, layout.pp, head_layers))
