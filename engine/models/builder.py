"""Build Megatron-Core ``GPTModel``s from a :class:`ModelDescription` and a layout.

The description says *what* the model is; :class:`~hyflow.parallel.groups.ParallelGroups`
says how it is split. The builder picks a layer spec:

* ``te``: Transformer Engine's spec (fused kernels), when TE is installed and CUDA present;
* ``sdpa``: Megatron's local modules with :class:`SDPAttention` as core attention
  (default on GPU without TE);
* ``local``: Megatron's local spec unchanged (default on CPU).

With context parallelism (``layout.cp > 1``) the ``local`` and ``sdpa`` specs use
:class:`~hyflow.models.ulysses_attention.UlyssesAttention` as core attention (TE does CP itself).

Critic and reward models are the same trunk with a scalar :class:`ValueHead`
instead of the vocabulary projection.

Mixture-of-experts descriptions (``desc.moe``) get Megatron-Core's ``MoELayer`` as every layer's
MLP: its top-k router (softmax or sigmoid scores, load-balancing aux loss and z-loss), the
alltoall token dispatcher over the layout's expert-parallel group, ``SequentialMLP`` experts and
the optional (gated) shared expert; QK-norm (Qwen3) is Megatron's ``q_layernorm`` /
``k_layernorm``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from hyflow.models import embedding_grad, positions
from hyflow.models.description import ModelDescription
from hyflow.models.norms import RMSNorm
from hyflow.models.rope import softmax_scale as rope_softmax_scale
from hyflow.models.rotary import DescribedRotaryEmbedding
from hyflow.models.sdpa_attention import SDPAttention
from hyflow.models.ulysses_attention import UlyssesAttention
from hyflow.parallel.groups import ParallelGroups
from hyflow.parallel.layout import pad_vocab_size

SpecName = Literal["auto", "local", "sdpa", "te"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_spec(spec: SpecName = "auto") -> str:
    """The concrete layer spec for ``spec`` on this machine."""
    has_cuda = torch.cuda.is_available()
    has_te = importlib.util.find_spec("transformer_engine") is not None
    if spec == "auto":
        return "te" if (has_cuda and has_te) else ("sdpa" if has_cuda else "local")
    if spec == "te" and not (has_cuda and has_te):
        raise ValueError("model spec 'te' needs transformer-engine and CUDA; use 'sdpa' or 'local'")
    if spec not in ("local", "sdpa", "te"):
        raise ValueError(f"unknown model spec {spec!r}; one of auto, local, sdpa, te")
    return spec


def layer_spec(spec: SpecName = "auto", cp: int = 1, desc: Optional[ModelDescription] = None):
    """Megatron ``ModuleSpec`` for one transformer layer (of ``desc``: its MoE MLP and QK-norm).

    With ``cp > 1`` TE's attention does context parallelism itself; the local and sdpa specs
    get :class:`UlyssesAttention` (all-to-all over the CP group) as core attention."""
    name = resolve_spec(spec)
    # Experts run as SequentialMLP on every spec (one parameter name per expert everywhere:
    # conversion, resharding and routing replay read them); grouped GEMM would rename them.
    shape = dict(num_experts=desc.moe.num_experts if desc is not None and desc.moe is not None else None,
                 qk_layernorm=bool(desc is not None and desc.qk_layernorm), moe_grouped_gemm=False)
    if name == "te":
        return get_gpt_layer_with_transformer_engine_spec(**shape)
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm", **shape))
    spec.submodules.input_layernorm = RMSNorm  # sequence parallelism on the local spec too
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if shape["qk_layernorm"]:
        spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
    if cp > 1:
        spec.submodules.self_attention.submodules.core_attention = UlyssesAttention
    elif name == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def transformer_config(desc: ModelDescription, groups: ParallelGroups, dtype: str = "fp32",
                       **overrides) -> TransformerConfig:
    """``TransformerConfig`` for ``desc`` under the layout of ``groups``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; one of {sorted(DTYPES)}")
    layout = groups.layout
    layout.check_model(desc, training=False)  # also generation copies: no SP
    fused = groups.device.type == "cuda" and bool(fusion_backends())
    kwargs = dict(
        num_layers=desc.num_layers,
        hidden_size=desc.hidden_size,
        num_attention_heads=desc.num_attention_heads,
        num_query_groups=desc.num_query_groups,
        kv_channels=desc.head_dim,
        ffn_hidden_size=desc.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=desc.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=desc.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=desc.init_method_std,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=DTYPES[dtype],
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        # Megatron's own random init, when asked for, runs full-size on the host then slices, so
        # every layout starts from the same weights. Models whose weights are loaded afterwards
        # (perform_initialization=False: every job's) are allocated on the rank's device directly.
        use_cpu_initialization=groups.device.type == "cpu" or overrides.get("perform_initialization", True),
        # Megatron's fused SwiGLU (a TorchScript kernel) and fused masked softmax (TE/Apex kernels) on
        # GPUs that have TE or Apex; the other fusions stay off: rotary (hyflow's own tables, packed
        # positions), gradient accumulation (hyflow writes main_grad itself), persistent LayerNorm (RMSNorm here).
        bias_activation_fusion=fused,
        masked_softmax_fusion=fused,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        pipeline_dtype=DTYPES[dtype],
        deallocate_pipeline_outputs=True,  # a stage frees its output once sent (the backward needs only its grad_fn)
        # YaRN / LongRoPE attention factor: HF scales cos and sin (so q and k) by it.
        softmax_scale=rope_softmax_scale(desc),
        # An uneven pipeline split (layout.stage_layers): Megatron builds and numbers the layers.
        **layout.megatron_stage_kwargs(desc.num_layers),
        qk_layernorm=desc.qk_layernorm,
        **moe_config_kwargs(desc, layout),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_config_kwargs(desc: ModelDescription, layout) -> dict:
    """``TransformerConfig`` arguments of ``desc``'s experts under ``layout`` (none for a dense model)."""
    moe = desc.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff if moe.load_balancing != "none" else 0.0,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32",  # routing decisions in fp32 whatever the parameters' dtype
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )


def fusion_backends() -> tuple[str, ...]:
    """The fused-kernel libraries Megatron can use here: ``te`` (Transformer Engine), ``apex``."""
    return tuple(name for name, module in (("te", "transformer_engine"), ("apex", "apex"))
                 if importlib.util.find_spec(module) is not None)


def recompute_overrides(kind: str) -> dict:
    """``TransformerConfig`` overrides for activation recomputation ``none`` / ``selective`` /
    ``full``: selective recomputes core attention in the backward (Megatron's default
    ``recompute_modules``), full recomputes every layer from its input."""
    if kind == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if kind == "selective":
        return {"recompute_granularity": "selective"}
    if kind != "none":
        raise ValueError(f"recompute must be none, selective or full, got {kind!r}")
    return {}


class ValueHead(torch.nn.Module):
    """Scalar head replacing ``GPTModel.output_layer`` for critics and reward models.

    Called like Megatron's output layer: ``(hidden [s, b, h]) -> (values [s, b, 1], None)``.
    The weight is replicated over TP ranks (hidden states are complete after the
    last row-parallel all-reduce). Under sequence parallelism each TP rank scores its own
    slice of the sequence and the values ([s/tp, b, 1], not the hidden states) are gathered.
    The gather's backward hands each rank its slice of the (TP-identical) value gradient
    without summing it (summing would multiply every gradient by TP), and the weight, which
    then sees only its rank's tokens, is marked ``sequence_parallel`` so that Megatron's
    ``finalize_model_grads`` sums its gradient over TP.
    """

    def __init__(self, config: TransformerConfig, tp_group):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        torch.nn.init.normal_(self.weight, std=config.init_method_std)
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        values = F.linear(hidden, self.weight)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return values, None


def build_gpt_model(desc: ModelDescription, groups: ParallelGroups, *, dtype: str = "fp32",
                    spec: SpecName = "auto", value_head: bool = False,
                    vp_stage: Optional[int] = None, seed: Optional[int] = None,
                    config_overrides: Optional[dict] = None,
                    padded_vocab_size: Optional[int] = None, meta: bool = False) -> GPTModel:
    """Build this rank's part of the model (its pipeline stage and TP shard).

    Args:
        desc: architecture.
        groups: layout + process groups of this rank.
        dtype: ``fp32``, ``bf16`` or ``fp16`` parameters.
        spec: layer spec (see module docstring).
        value_head: build a critic / reward trunk with a scalar head.
        vp_stage: virtual pipeline chunk index when ``layout.vpp`` is set.
        seed: if given, reseed the CPU generator first so every layout draws the
            same full-size initial weights.
        padded_vocab_size: vocabulary rows including TP padding; default pads for this
            layout's TP. A generation-layout copy of a model keeps its training padding.
        meta: parameters without storage (on the ``meta`` device, Megatron's attributes set):
            the caller points every one at memory it owns (the hybrid engine's generation
            buffer), so building never holds a second copy of the weights. Buffers (RoPE) are
            on the rank's device as usual.
    """
    desc.validate()
    overrides = dict(config_overrides or {})
    if meta:  # Megatron's local layers allocate on the default device then; TE's on "meta"
        overrides.update(perform_initialization=False, use_cpu_initialization=True,
                         init_model_with_meta_device=True)
    cfg = transformer_config(desc, groups, dtype, **overrides)
    if desc.moe is not None:
        # Megatron's routers log their losses in one module-level tracker sized by the first
        # model's num_layers; a model with more layers built later in this process would index
        # past it. Entries are re-created at the next training forward.
        get_moe_layer_wise_logging_tracker().clear()
    layout = groups.layout
    vpp = layout.vpp or 1
    chunk = vp_stage or 0
    pre = groups.is_first_stage and chunk == 0
    post = groups.is_last_stage and chunk == vpp - 1
    if seed is not None:
        torch.manual_seed(seed)
    if not get_cuda_rng_tracker().is_initialized():
        # Groups built with build_groups() alone: Megatron's layers still fork this tracker.
        model_parallel_cuda_manual_seed(seed or 1234, tp_rank=groups.tp_rank, ep_rank=groups.ep_rank,
                                       etp_rank=groups.etp_rank)
    layer = layer_spec(spec, layout.cp, desc)
    if resolve_spec(spec) != "te":  # the final norm too (Megatron would pick WrappedTorchNorm)
        layer = TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(cfg, vp_stage if layout.vpp else None, groups.pp_rank),
            layer_norm=RMSNorm)
    pgs = groups.pgs
    if meta:  # no storage to agree on: Megatron's all-reduce of a tied embedding's copy is skipped
        pgs = copy.copy(pgs)
        pgs.embd = None
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = _gpt_model(desc, cfg, layer, pgs, layout, pre, post, value_head, padded_vocab_size, vp_stage)
    model.embd_group = groups.pgs.embd
    if not meta:
        _zero_vocab_padding(model, desc.vocab_size, groups)
        # Megatron builds on the host when asked (use_cpu_initialization; the local spec's norms and
        # our value head always); move to the rank's device as Megatron-LM's get_model does.
        model = model.to(groups.device)
    # RoPE frequencies stay float32 whatever params_dtype the cast gave the buffer.
    model.rotary_pos_emb.inv_freq = desc.inv_freq().to(device=groups.device, dtype=torch.float32)
    return model


def _gpt_model(desc: ModelDescription, cfg: TransformerConfig, layer, pgs, layout, pre: bool, post: bool,
               value_head: bool, padded_vocab_size: Optional[int], vp_stage: Optional[int]) -> GPTModel:
    """Megatron's ``GPTModel`` with hyflow's RoPE, positions, value head and dtype (on the default device)."""
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer,
        vocab_size=padded_vocab_size or pad_vocab_size(desc.vocab_size, layout.tp),
        max_sequence_length=desc.context_length,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=desc.tied_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_base=int(desc.rope_theta) if float(desc.rope_theta).is_integer() else desc.rope_theta,
        pg_collection=pgs,
        vp_stage=vp_stage if layout.vpp else None,
    )
    # RoPE frequencies from the description: every HF scaling family, bit-identical to HF's
    # (Megatron's module knows llama3 with fixed constants), CP slicing on any device.
    model.rotary_pos_emb = DescribedRotaryEmbedding(desc, cp_group=pgs.cp)
    positions.install(model)  # packed rows: rotary tables at each token's own position
    if value_head and post:
        model.output_layer = ValueHead(cfg, pgs.tp)
    if cfg.params_dtype != torch.float32:
        # The local spec's torch norms ignore params_dtype; Megatron-LM casts the whole
        # module the same way (Float16Module) so every parameter has one dtype.
        model.to(cfg.params_dtype)
    if not cfg.perform_initialization:
        mark_tensor_parallel_attributes(model)
    embedding_grad.install(model)
    return model


@torch.no_grad()
def _zero_vocab_padding(model: GPTModel, vocab_size: int, groups: ParallelGroups) -> None:
    """Padded vocabulary rows are zero (export strips them; sampling masks them)."""
    for module_name in ("embedding.word_embeddings", "output_layer"):
        module = model.get_submodule(module_name) if _has(model, module_name) else None
        weight = getattr(module, "weight", None)
        if weight is None or isinstance(module, ValueHead):
            continue
        rows = weight.shape[0]
        start = groups.tp_rank * rows
        first_pad = max(vocab_size - start, 0)
        if first_pad < rows:
            weight[first_pad:].zero_()


def _has(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def build_model_chunks(desc: ModelDescription, groups: ParallelGroups, **kwargs) -> list[GPTModel]:
    """This rank's model chunks: one, or ``layout.vpp`` for the interleaved pipeline."""
    if not groups.layout.vpp:
        return [build_gpt_model(desc, groups, **kwargs)]
    return [build_gpt_model(desc, groups, vp_stage=i, **kwargs) for i in range(groups.layout.vpp)]


def mark_tensor_parallel_attributes(model: torch.nn.Module) -> None:
    """Set Megatron's ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``.

    Megatron sets these only while randomly initialising a weight; a model built with
    ``perform_initialization=False`` (to be filled from a checkpoint) lacks them, but
    :mod:`hyflow.models.weights` and the optimizer read them. Same values as
    Megatron's initialisation: vocabulary and column-parallel weights split dim 0
    (``linear_fc1`` of a gated MLP with stride 2: each shard is ``[gate_r; up_r]``),
    row-parallel weights split dim 1.
    """
    def mark(param: Optional[torch.Tensor], dim: int, stride: int) -> None:
        if param is not None:
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride

    glu_fc1 = {id(m.linear_fc1) for m in getattr(model, 'module', model).modules()
               if isinstance(m, MLP) and m.config.gated_linear_unit}
    for module in getattr(model, 'module', model).modules():
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
            mark(module.weight, 0, 2 if id(module) in glu_fc1 else 1)
        elif isinstance(module, RowParallelLinear):
            mark(module.weight, 1, 1)
