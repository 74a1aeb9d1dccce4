"""Per-GPU memory estimate of a role (pure arithmetic; no torch).

What is counted, per rank, for the worst pipeline stage:

* **weights**: this rank's shard in the parameter dtype. Layers split over ``pp`` stages as
  the layout's ``stage_layers`` says (else evenly); the first stage adds the (vocabulary-padded) embedding, the last the final norm
  and the output layer (a tied embedding is a second copy there when ``pp > 1``; a value
  head replaces the output layer for critics). TP shards everything but the norms.
* **grads**: Megatron DDP's contiguous gradient buffer, fp32 (``grad_reduce_in_fp32``).
* **optimizer**: Adam moments (8 B/param) plus fp32 master weights when the parameters are
  bf16/fp16 (4 B/param); divided by ``dp * cp`` with the distributed optimizer.
* **activations**: what autograd keeps per micro-batch, counted tensor by tensor for the
  layer spec in use (:func:`layer_activation_bytes`), times the layers a stage holds,
  times the micro-batches in flight under 1F1B / interleaved 1F1B; plus the stage input,
  the output head's fp32 logits and a backward transient (one weight-gradient temporary and
  two activation gradients).
* **KV cache** (generation): keys and values of ``slots`` sequences of ``capacity`` tokens for
  the layers and query groups a generation rank holds.
* **start-up** (:func:`startup_estimate`): the models built one after the other, each step's
  lasting bytes plus what exists only while it runs (Megatron DDP moving the weights into its
  buffer, the hybrid engine's generation buffer while its views are set up, a random initial
  state); the peak is the worst step.

Mixture-of-experts layers (``desc.moe``) count their router, shared expert and this rank's share
of the routed experts (``E / EP`` experts at ``1 / ETP``) as parameters, shard the experts'
optimizer state over the expert data-parallel ranks, and replace the SwiGLU activations by the
MoE MLP's (:mod:`hyflow.plan.experts`).

Not counted: the CUDA context, NCCL buffers and allocator fragmentation (the planner adds a
configurable reserve for them), Python objects, and host-side (CPU) copies made while
loading a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

from hyflow.models.description import ModelDescription
from hyflow.parallel.layout import Layout, pad_vocab_size
from hyflow.plan import experts
from hyflow.rollout.kv_cache import prefill_block_mask_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
Attention = Literal["local", "sdpa", "te"]
Recompute = Literal["none", "selective", "full"]


@dataclass
class MemoryItem:
    """One line of an estimate: ``bytes`` with a short explanation."""

    name: str
    bytes: int
    note: str = ""


@dataclass
class MemoryEstimate:
    """Items that are resident together at one moment (a phase) on the worst rank."""

    phase: str
    items: list[MemoryItem] = field(default_factory=list)
    stage: Optional[int] = None

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    def add(self, name: str, nbytes: float, note: str = "") -> "MemoryEstimate":
        self.items.append(MemoryItem(name, int(nbytes), note))
        return self

    def get(self, name: str) -> int:
        return sum(i.bytes for i in self.items if i.name == name)


def padded_vocab(desc: ModelDescription, tp: int) -> int:
    """Megatron's padded vocabulary for ``tp`` (what the embedding really holds)."""
    return pad_vocab_size(desc.vocab_size, tp)


def layer_params(desc: ModelDescription, tp: int, layout: Optional[Layout] = None) -> int:
    """Parameters of one transformer layer on one TP rank (of ``layout``, whose expert grid splits a
    mixture-of-experts layer's routed experts; default EP = 1, ETP = ``tp``)."""
    h, d, f = desc.hidden_size, desc.head_dim, desc.ffn_hidden_size
    qkv_rows = (desc.num_attention_heads + 2 * desc.num_query_groups) * d
    mlp = 0 if experts.is_moe(desc) else 3 * f * h
    sharded = qkv_rows * h + h * desc.num_attention_heads * d + mlp
    if desc.qkv_bias:
        sharded += qkv_rows
    out = sharded // tp + 2 * h + (2 * d if getattr(desc, "qk_layernorm", False) else 0)
    if experts.is_moe(desc):
        out += experts.dense_mlp_params(desc, tp) + stage_expert_params(desc, layout or Layout(tp=tp), 1)
    return out


def stage_expert_params(desc: ModelDescription, layout: Layout, layers: int) -> int:
    """Routed-expert parameters of ``layers`` MoE layers on one rank of ``layout`` (0 if dense)."""
    return experts.expert_params(desc, layout) * layers if experts.is_moe(desc) else 0


def stage_params(desc: ModelDescription, layout: Layout, value_head: bool = False) -> list[int]:
    """Parameters held by one rank of each pipeline stage (index = stage; the layers of
    ``layout.stage_layers``, else the even split)."""
    tp, pp = layout.tp, layout.pp
    h = desc.hidden_size
    emb = padded_vocab(desc, tp) * h // tp
    split = layout.layers_per_stage(desc.num_layers)
    out = []
    for q in range(pp):
        n = split[q] * layer_params(desc, tp, layout)
        if q == 0:
            n += emb
        if q == pp - 1:
            n += h  # final norm
            if value_head:
                n += h
            elif not desc.tied_embeddings or pp > 1:
                n += emb  # output layer, or the tied embedding's copy on the last stage
        out.append(n)
    return out


def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam state per parameter: 2 fp32 moments, plus an fp32 master copy for 16-bit params."""
    return 8 if dtype == "fp32" else 12


def layer_activation_bytes(desc: ModelDescription, layout: Layout, seq: int, mbs: int,
                           attention: Attention, recompute: Recompute, dtype: str) -> float:
    """Bytes autograd keeps for one layer and one micro-batch.

    Counted from the tensors each spec saves for backward (t = tp, ts = tp under sequence
    parallelism else 1, sb = tokens of the micro-batch on this rank, a/g heads/query groups
    per TP rank x t, d head size, f ffn size, p = bytes of the activation dtype):

    * ``local`` (Megatron's local spec, unfused attention; what CPU runs use): each RMSNorm
      keeps ``x * rsqrt`` in fp32, its output, an fp32 copy of its input when p < 4 and the
      fp32 ``rsqrt`` (``sbh (4 + p [+ 4]) + 4 sb``, over ts); in fp32 the norms' inputs are the
      residual stream itself (``2 sbh p / ts``; in 16 bits the fp32 copies stand for it);
      rotated q, repeated k and v and the context ``4 sb a d p / t``; the fp32 softmax
      ``4 b a s^2 / t`` (plus its p-byte copy when p < 4); SwiGLU ``5 sb f p / t`` (fc1
      output, silu, offset input, product);
    * ``sdpa``: as local, but memory-efficient attention: no ``s^2`` term; q, repeated k/v,
      output and reshaped context ``5 sb a d p / t`` and an fp32 log-sum-exp;
    * ``te``: fused RMSNorm-linear keeps the normalised input and fp32 ``rsigma``
      (``sbh p + 4 sb``, over ts), q/k/v and the attention output ``sb (2a + 2g) d p / t``,
      log-sum-exp, SwiGLU ``3 sb f p / t``.

    ``selective`` recomputes core attention: it keeps its inputs (rotated q and k, and v, a
    view that keeps the whole fused QKV projection alive) and its output, ``sb (3a + 3g) d p / t``;
    ``full`` keeps only each layer's input (the recomputed layer is a backward transient).
    """
    p = DTYPE_BYTES[dtype]
    t = layout.tp
    ts = t if layout.sequence_parallel else 1
    s = seq // layout.cp
    b = mbs
    h, d, f = desc.hidden_size, desc.head_dim, desc.ffn_hidden_size
    a, g = desc.num_attention_heads / t, desc.num_query_groups / t
    sb = s * b
    if recompute == "full":
        return sb * h * p / ts
    lse = 4 * b * a * s  # fp32 softmax statistics of memory-efficient kernels
    residual = 2 * sb * h * p / ts
    if attention == "te":
        norms = 2 * (sb * h * p + 4 * sb) / ts
        te_mlp = experts.mlp_activation_bytes(desc, layout, sb, p) if experts.is_moe(desc) else 3 * sb * f * p / t
        return norms + residual + sb * (2 * a + 2 * g) * d * p + lse + te_mlp
    upcast = 4 if p < 4 else 0
    norms = 2 * (sb * h * (4 + p + upcast) + 4 * sb) / ts
    if upcast:
        residual = 0.0  # the norms keep fp32 copies (counted above), not the residual stream
    mlp = experts.mlp_activation_bytes(desc, layout, sb, p) if experts.is_moe(desc) else 5 * sb * f * p / t
    if recompute == "selective":
        attn = sb * (3 * a + 3 * g) * d * p
    elif attention == "sdpa":
        attn = 5 * sb * a * d * p + lse
    else:
        attn = 4 * sb * a * d * p + b * a * s * s * (4 + (p if p < 4 else 0))
    return norms + residual + attn + mlp


def score_buffer_bytes(desc: ModelDescription, layout: Layout, seq: int, mbs: int, dtype: str) -> float:
    """Megatron's local attention writes the ``[b a / t, s, s]`` scores into one global buffer
    (``get_global_memory_buffer``) that every layer reuses and that stays allocated."""
    s = seq // layout.cp
    return mbs * desc.num_attention_heads / layout.tp * s * s * DTYPE_BYTES[dtype]


def attention_backward_bytes(desc: ModelDescription, layout: Layout, seq: int, mbs: int,
                             attention: Attention, recompute: Recompute, dtype: str) -> float:
    """Transient bytes inside one layer's attention backward, beyond what the layer keeps.

    * ``local``: the gradients of the ``s^2`` attention probabilities and scores. In fp32 both
      are alive at once (``8 b a s^2 / t``); in 16 bits autograd has released the 16-bit
      probabilities and the fp32 ones are consumed as the gradients appear (``3 b a s^2 / t``,
      measured in ``tests/test_plan_memory.py``);
    * ``sdpa`` / ``te`` (memory-efficient kernels): no ``s^2`` term (0 here; the activation
      gradients of the backward transient dominate);
    * ``selective`` recompute adds the recomputed core attention's own activations (the
      ``none`` minus ``selective`` attention terms of :func:`layer_activation_bytes`, i.e. what
      the forward kept beyond the inputs; with ``local`` the ``s^2`` softmax).
    """
    p = DTYPE_BYTES[dtype]
    t = layout.tp
    s, b = seq // layout.cp, mbs
    a = desc.num_attention_heads / t
    out = 0.0
    if attention == "local":
        out = b * a * s * s * (8 if p == 4 else 3)
    if recompute == "selective" and attention != "te":
        out += (layer_activation_bytes(desc, layout, seq, mbs, attention, "none", dtype)
                - layer_activation_bytes(desc, layout, seq, mbs, attention, "selective", dtype))
    return out


def forward_layer_bytes(desc: ModelDescription, layout: Layout, seq: int, mbs: int,
                        attention: Attention, dtype: str) -> float:
    """Peak bytes inside one layer's forward without autograd (scoring, prefill, decode).

    Intermediates die as soon as they are consumed, so a layer needs the residual stream
    (input and output, ``2 sbh p / ts``), one RMSNorm's working set (as in
    :func:`layer_activation_bytes`) and the larger of the two blocks: attention with q/k/v,
    their rotated / repeated copies, output and context (``sb (6a + 3g) d p / t``, plus the
    ``s^2`` scores for ``local``; ``sb (2a + 2g) d p / t`` for ``te``) or SwiGLU (``5 sb f p / t``,
    ``3 sb f p / t`` for ``te``).
    """
    p = DTYPE_BYTES[dtype]
    t = layout.tp
    ts = t if layout.sequence_parallel else 1
    s, b = seq // layout.cp, mbs
    h, d, f = desc.hidden_size, desc.head_dim, desc.ffn_hidden_size
    a, g = desc.num_attention_heads / t, desc.num_query_groups / t
    sb = s * b
    if attention == "te":
        norm = (sb * h * p + 4 * sb) / ts
        attn, mlp = sb * (2 * a + 2 * g) * d * p, 3 * sb * f * p / t
    else:
        norm = (sb * h * (4 + p + (4 if p < 4 else 0)) + 4 * sb) / ts
        attn, mlp = sb * (6 * a + 3 * g) * d * p, 5 * sb * f * p / t
        if attention == "local":
            attn += b * a * s * s * (4 + (p if p < 4 else 0))
    if experts.is_moe(desc):
        mlp = experts.mlp_activation_bytes(desc, layout, sb, p, forward_only=True)
    return 2 * sb * h * p / ts + norm + max(attn, mlp)


def microbatches_in_flight(layout: Layout, stage: int, n_micro: int) -> int:
    """Model chunks (micro-batch x virtual stage) whose activations ``stage`` keeps at once.

    No pipeline: one micro-batch at a time. 1F1B: stage q keeps ``pp - q`` micro-batches.
    Interleaved (vpp chunks): ``2 (pp - q - 1) + (vpp - 1) pp + 1`` chunks. Capped by the
    number of micro-batches.
    """
    pp, vpp = layout.pp, layout.vpp or 1
    if pp == 1:
        return 1
    if vpp == 1:
        return min(pp - stage, n_micro)
    return min(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, n_micro * vpp)


def training_estimates(desc: ModelDescription, layout: Layout, *, dtype: str, seq: int,
                       micro_batch_size: int, n_micro: int, attention: Attention,
                       recompute: Recompute, distributed_optimizer: bool,
                       head: Literal["lm", "value"] = "lm", logits_copies: int = 1,
                       phase: str = "train") -> list[MemoryEstimate]:
    """Training-step memory of one rank of every pipeline stage (index = stage).

    ``logits_copies`` counts the fp32 vocabulary-sized tensors the loss keeps for backward
    (1 for Megatron's cross entropy; 3 for the RL policy loss: the log-prob ``exp`` and the
    entropy's ``exp`` and masked logits), on top of the logits themselves.
    """
    pbytes = DTYPE_BYTES[dtype]
    vp = padded_vocab(desc, layout.tp)
    params = stage_params(desc, layout, value_head=head == "value")
    layer_bytes = layer_activation_bytes(desc, layout, seq, micro_batch_size, attention, recompute, dtype)
    ts = layout.tp if layout.sequence_parallel else 1
    tokens = seq // layout.cp * micro_batch_size
    per_token_h = tokens * desc.hidden_size / ts * pbytes
    vpp = layout.vpp or 1
    split = layout.layers_per_stage(desc.num_layers)
    h, f, t = desc.hidden_size, desc.ffn_hidden_size, layout.tp
    biggest_weight = max(vp * h // t, 2 * f * h // t, h * f // t)
    out = []
    for q, n in enumerate(params):
        est = MemoryEstimate(phase, stage=q)
        est.add("weights", n * pbytes, f"{n:,} params x {pbytes} B ({dtype})")
        est.add("grads", n * 4, "fp32 DDP gradient buffer")
        shard = layout.dp * layout.cp if distributed_optimizer else 1
        obytes = optimizer_bytes_per_param(dtype)
        routed = stage_expert_params(desc, layout, split[q])  # their state shards over expert DP
        eshard = experts.expert_shard(layout, distributed_optimizer) if routed else 1
        est.add("optimizer", (n - routed) * obytes / shard + routed * obytes / eshard,
                f"Adam {obytes} B/param" + (f" / {shard} (distributed)" if shard > 1 else "")
                + (f", routed experts / {eshard}" if routed else ""))
        chunks = microbatches_in_flight(layout, q, n_micro)
        per_chunk_layers = split[q] // vpp
        act = chunks * per_chunk_layers * layer_bytes + chunks * per_token_h  # + stage input
        note = f"{chunks} micro-batch chunk(s) x {per_chunk_layers} layer(s), recompute={recompute}"
        if recompute == "full":  # one layer recomputed with everything during backward
            act += layer_activation_bytes(desc, layout, seq, micro_batch_size, attention, "none", dtype)
        est.add("activations", act, note)
        if attention == "local":
            est.add("attention buffer", score_buffer_bytes(desc, layout, seq, micro_batch_size, dtype),
                    "Megatron's global score buffer, reused by every layer (local spec)")
        if q == layout.pp - 1:
            width = 1 if head == "value" else vp // t
            logits = tokens * width * 4 * logits_copies + tokens * width * pbytes
            est.add("logits", logits, f"fp32 log-softmax over {width} vocab rows x {tokens} tokens")
        transient = max(
            biggest_weight * pbytes + 2 * max(per_token_h * ts, tokens * 2 * f / t * pbytes),
            attention_backward_bytes(desc, layout, seq, micro_batch_size, attention, recompute, dtype))
        est.add("backward transient", transient,
                "weight-grad temporary + activation grads, or the attention backward"
                + (" with its recomputed forward" if recompute == "selective" else ""))
        out.append(est)
    return out


def inference_estimates(desc: ModelDescription, layout: Layout, *, dtype: str, seq: int,
                        micro_batch_size: int, attention: Attention,
                        head: Literal["lm", "value"] = "lm", phase: str = "forward") -> list[MemoryEstimate]:
    """Forward-only transient (log-prob / value computation) of each stage: one layer's
    working set at a time (:func:`forward_layer_bytes`) and, on the last stage, fp32 logits."""
    pbytes = DTYPE_BYTES[dtype]
    layer = forward_layer_bytes(desc, layout, seq, micro_batch_size, attention, dtype)
    tokens = seq // layout.cp * micro_batch_size
    out = []
    for q in range(layout.pp):
        est = MemoryEstimate(phase, stage=q)
        est.add("activations", layer, "one layer at a time (no autograd graph)")
        if attention == "local":
            est.add("attention buffer", score_buffer_bytes(desc, layout, seq, micro_batch_size, dtype),
                    "Megatron's global score buffer (local spec)")
        if q == layout.pp - 1 and head == "lm":
            width = padded_vocab(desc, layout.tp) // layout.tp
            est.add("logits", tokens * width * (4 + pbytes), f"fp32 log-softmax over {width} rows")
        out.append(est)
    return out


def generation_transient(desc: ModelDescription, gen_tp: int, *, prefill_tokens: int, rows: int,
                         dtype: str, context: int = 0, chunked: bool = False) -> int:
    """Largest forward-time transient of a generation rank: one layer's working set for a
    prefill forward of ``prefill_tokens`` (a prefill from position 0 is causal attention without
    a mask or a score matrix), and fp32 logits plus sampler work copies for the ``rows``
    sequences sampled at once. ``chunked``: prefill chunks after the first attend over up to
    ``context`` cached positions in query blocks, each with its own additive fp32 mask (GQA
    folded into the queries; :func:`hyflow.rollout.kv_cache.prefill_block_mask_bytes`, at most
    a fixed budget), so chunked prefill bounds all of this by the chunk size."""
    pbytes = DTYPE_BYTES[dtype]
    layer = forward_layer_bytes(desc, Layout(tp=gen_tp), prefill_tokens, 1, "sdpa", dtype)
    width = padded_vocab(desc, gen_tp) // gen_tp
    rep = desc.num_attention_heads // desc.num_query_groups
    attention = prefill_block_mask_bytes(prefill_tokens, context, rep) if chunked else 0
    return int(layer + attention + rows * width * (pbytes + 4 * 4))


def kv_cache_bytes(desc: ModelDescription, gen_tp: int, gen_pp: int, slots: int, capacity: int,
                   dtype: str, layers: Optional[int] = None) -> int:
    """Keys and values of ``slots`` x ``capacity`` tokens on one generation rank holding ``layers``
    decoder layers (default: an even stage's)."""
    layers = desc.num_layers // gen_pp if layers is None else layers
    groups = desc.num_query_groups // gen_tp
    return 2 * layers * slots * groups * capacity * desc.head_dim * DTYPE_BYTES[dtype]


def rollout_data_bytes(rows: int, seq: int, *, reference: bool, critic: bool) -> int:
    """The RL step's per-row tensors on one rank for its ``rows`` (its data-parallel shard) of at
    most ``seq`` tokens: int64 tokens; fp32 response mask, sampler log-probs, old log-probs,
    advantages, token rewards (+ reference log-probs, + values, returns); the data plane's flat
    copies (tokens, log-probs) of the same rows; and one mini-batch's gathered columns and
    per-token weights while it trains (at most the whole shard)."""
    fp32 = 5 + (1 if reference else 0) + (2 if critic else 0)
    per_token = 8 + 4 * fp32
    exchange = 8 + 4
    update = 8 + 4 * (fp32 + 2)
    return rows * seq * (per_token + exchange + update)


@dataclass
class BuildStep:
    """One step of a rank's start-up: ``kept`` bytes stay afterwards; ``transient`` bytes exist only
    while the step runs (named ``transient_name``)."""

    name: str
    kept: float = 0.0
    note: str = ""
    transient: float = 0.0
    transient_name: str = ""
    transient_note: str = "while the step runs"


def trainable_build_steps(role: str, params: int, dtype: str, distributed_optimizer: bool, shard: int,
                          initial: float = 0.0, initial_note: str = "") -> list[BuildStep]:
    """A trained model's start-up on one rank: its weights (``initial``: transient bytes of where
    they come from), Megatron DDP's buffers and the optimizer as built (Adam's moments appear at the
    first step, in the update phase).

    * DDP allocates the fp32 gradient buffer and, with the distributed optimizer, a parameter buffer
      the weights are copied into one by one: both copies of the weights exist when it starts;
    * the optimizer keeps fp32 master weights of 16-bit parameters (its shard of them when
      distributed); fp32 parameters are their own master copy.
    """
    p = DTYPE_BYTES[dtype]
    shard = shard if distributed_optimizer else 1
    master = params * 4 / shard if p < 4 else 0
    return [
        BuildStep(f"{role} weights", params * p, f"{params:,} params x {p} B ({dtype})", initial,
                  initial_note),
        BuildStep(f"{role} grads", params * 4, "fp32 DDP gradient buffer",
                  params * p if distributed_optimizer else 0,
                  f"{role} weights' old storage (DDP copies them into its parameter buffer)"),
        BuildStep(f"{role} optimizer (as built)", master,
                  (f"fp32 master weights / {shard} (distributed)" if shard > 1 else "fp32 master weights")
                  if master else "none before the first step (fp32 parameters)"),
    ]


def random_init_bytes(desc: ModelDescription) -> int:
    """Host bytes of a random initial state (:func:`hyflow.models.weights.random_full_state_dict`,
    what a job without a checkpoint draws on every rank): the whole unsharded model in fp32, plus
    one temporary of its largest tensor while a rank copies its shard."""
    h, f = desc.hidden_size, desc.ffn_hidden_size
    qkv = (desc.num_attention_heads + 2 * desc.num_query_groups) * desc.head_dim
    largest = max(desc.vocab_size * h, 2 * f * h, qkv * h)
    return 4 * (desc.num_parameters() + largest)


def startup_estimate(steps: Sequence[BuildStep], stage: Optional[int] = None) -> MemoryEstimate:
    """The start-up peak of a rank that runs ``steps`` in order: at the worst step, what earlier
    steps and that step keep plus that step's transient. Phase ``start-up, at <step>``."""
    kept: list[MemoryItem] = []
    best: Optional[MemoryEstimate] = None
    for step in steps:
        if step.kept:
            kept.append(MemoryItem(step.name, int(step.kept), step.note))
        here = MemoryEstimate(f"start-up, at {step.name}", list(kept), stage)
        if step.transient:
            here.add(step.transient_name or f"{step.name} (transient)", step.transient, step.transient_note)
        if best is None or here.total > best.total:
            best = here
    return best if best is not None else MemoryEstimate("start-up", [], stage)


def rl_startup_estimate(cfg: Any, actor: Any, device: str, generation_bytes: int,
                        staging: list[tuple[str, int, str]], others: list[tuple[Any, bool]]) -> MemoryEstimate:
    """The start-up of a colocated RL rank, in :func:`hyflow.rl.models.build_rl_models`' order: the
    actor (weights, DDP, optimizer), the hybrid engine (its generation buffer held only while the
    generation model's parameters are pointed at it; on CPU the reshard's shared-memory staging,
    mapped for the run), then the reference, critic and reward model; worst pipeline stage. ``actor``
    and ``others``: :class:`~hyflow.plan.role_plan.RolePlan` s (``others`` with whether each trains)."""
    dtype = actor.dtype
    shard = actor.layout.dp * actor.layout.cp
    random_init = device == "cpu" and not cfg.actor.checkpoint  # on GPU the draw is host memory
    after = [BuildStep(name, nbytes, note) for name, nbytes, note in staging]
    after.append(BuildStep("hybrid engine", transient=generation_bytes, transient_name="generation buffer",
                           transient_note="held while the generation model's parameters are pointed at it, "
                                          "then released"))
    for role, trained in others:  # resident roles: their worst stage (an upper bound, as in the other phases)
        n = max(role.stage_params)
        if trained:
            after += trainable_build_steps(role.name, n, dtype, cfg.critic.optim.distributed_optimizer,
                                           role.layout.dp * role.layout.cp)
        else:
            after.append(BuildStep(f"{role.name} weights", n * DTYPE_BYTES[dtype], f"frozen, {dtype}"))
    stages = []
    for q, n in enumerate(actor.stage_params):
        steps = trainable_build_steps(
            "actor", n, dtype, cfg.actor.optim.distributed_optimizer, shard,
            random_init_bytes(actor.model) if random_init else 0,
            "random initial weights: the whole model in fp32 on every rank (no actor.checkpoint)")
        stages.append(startup_estimate(steps + after, stage=q))
    return worst(stages)


def worst(estimates: Sequence[MemoryEstimate]) -> MemoryEstimate:
    """The estimate with the largest total."""
    return max(estimates, key=lambda e: e.total)
