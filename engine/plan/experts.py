"""``hyflow plan``'s arithmetic for mixture-of-experts layers (pure; no torch).

Per rank of a layout (see :mod:`hyflow.parallel.layout` for the expert grid):

* **parameters** of one MoE layer: the router (``E x h``, replicated), the shared expert (a SwiGLU
  MLP split over TP) and its gate, and ``E / EP`` routed experts split ``ETP`` ways
  (:func:`layer_params`); the routed experts' optimizer state shards over the *expert*
  data-parallel ranks (:func:`expert_shard`), not the dense ones.
* **activations** of the MoE MLP for ``sb`` local tokens (:func:`mlp_activation_bytes`): with balanced
  routing each rank's experts receive ``sb x top_k`` token rows (the expert-TP all-gather multiplies
  the rows by ETP and divides their width by ETP), each keeping a SwiGLU's ``5 F`` values and the
  permuted input row, plus the router's fp32 logits and probabilities and the shared expert.
* **all-to-all traffic** (:func:`alltoall_bytes`): every token row goes to its ``top_k`` experts and
  comes back; with balanced routing ``(EP - 1) / EP`` of those rows leave the rank, each ``h``
  values, in the dispatch and again in the combine; a backward doubles it.
"""

from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def is_moe(desc: Any) -> bool:
    return getattr(desc, "moe", None) is not None


def expert_params(desc: Any, layout: Any) -> int:
    """Routed-expert parameters of one layer on one rank: ``E / EP`` experts at ``1 / ETP``."""
    moe = desc.moe
    return moe.num_experts // layout.ep * 3 * desc.hidden_size * (moe.ffn_hidden_size // layout.expert_tp)


def dense_mlp_params(desc: Any, tp: int) -> int:
    """Router, shared expert and shared-expert gate of one layer on one TP rank."""
    moe, h = desc.moe, desc.hidden_size
    shared = moe.shared_expert_ffn_hidden_size or 0
    return moe.num_experts * h + 3 * h * shared // tp + (h if moe.shared_expert_gate else 0)


def expert_shard(layout: Any, distributed_optimizer: bool) -> int:
    """Ranks the routed experts' optimizer state is sharded over (their expert data parallelism)."""
    return layout.expert_dp if distributed_optimizer else 1


def mlp_activation_bytes(desc: Any, layout: Any, sb: float, p: int, forward_only: bool = False) -> float:
    """Bytes of the MoE MLP for ``sb`` tokens of a micro-batch on one rank of ``layout``: what
    autograd keeps, or with ``forward_only`` the working set of a forward. Under sequence
    parallelism a rank routes ``sb / TP`` of the tokens (without it every TP rank routes all)."""
    moe, h = desc.moe, desc.hidden_size
    local = sb / (layout.tp if layout.sequence_parallel else 1)
    rows = local * moe.top_k  # token rows this rank's experts compute (balanced routing)
    width = 3 if forward_only else 5  # a forward keeps fc1's output and the product at most
    experts = rows * (width * moe.ffn_hidden_size * p + 2 * h * p)  # SwiGLU + permuted input / output rows
    router = local * moe.num_experts * 4 * 2  # fp32 logits and probabilities
    shared = width * sb * (moe.shared_expert_ffn_hidden_size or 0) * p / layout.tp
    return experts + router + shared


def alltoall_bytes(desc: Any, layout: Any, tokens: float, layers: int, dtype: str, backward: bool) -> float:
    """Bytes one rank sends (= receives) through the expert all-to-all for ``tokens`` tokens of its
    own (after sequence parallelism) through ``layers`` MoE layers: dispatch and combine, twice with
    the backward."""
    if layout.ep == 1:
        return 0.0
    per_layer = 2 * tokens * desc.moe.top_k * desc.hidden_size * DTYPE_BYTES[dtype] * (layout.ep - 1) / layout.ep
    return per_layer * layers * (2 if backward else 1)


def rl_step_alltoall(cfg: Any, desc: Any, layout: Any) -> dict[str, float]:
    """Expert all-to-all bytes per step on the busiest rank of an RL job: the actor's update
    (forward and backward, every PPO epoch), the old-log-prob forward, the reference's and the
    critic's forwards (the same MoE trunk in the actor's layout). Generation gathers every expert on
    each replica (EP_g = 1) and sends none."""
    if not is_moe(desc) or layout.ep == 1:
        return {}
    ts = layout.tp if layout.sequence_parallel else 1
    rows = cfg.data.train_batch_size // layout.dp * cfg.rollout.n
    seq = cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens
    tokens = rows * seq / ts / layout.cp  # padded rows: an upper bound
    layers = max(layout.layers_per_stage(desc.num_layers))
    dtype = cfg.actor.dtype
    out = {"actor update": cfg.actor.ppo_epochs * alltoall_bytes(desc, layout, tokens, layers, dtype, True)}
    if cfg.actor.old_logprobs == "recompute":
        out["old log-probs"] = alltoall_bytes(desc, layout, tokens, layers, dtype, False)
    if cfg.reference.enable:
        out["reference"] = alltoall_bytes(desc, layout, tokens, layers, dtype, False)
    if cfg.critic.enable:
        epochs = cfg.critic.ppo_epochs or cfg.actor.ppo_epochs
        out["critic"] = alltoall_bytes(desc, layout, tokens, layers, dtype, False) + \
            epochs * alltoall_bytes(desc, layout, tokens, layers, dtype, True)
    out["total"] = sum(out.values())
    return out
