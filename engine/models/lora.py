"""LoRA on the Megatron linear layers: ``y = W x + s B A x`` with ``s = alpha / rank``.

:func:`apply_lora` adapts a built ``GPTModel`` in place (a post-build swap: each targeted
``ColumnParallelLinear`` / ``RowParallelLinear`` becomes its LoRA subclass and gains two
parameters, so every base weight keeps its name, its tensor-parallel attributes and its
checkpoint key). Megatron-Core 0.16 has no LoRA of its own; the adapters shard with the base:

* column-parallel base ``W`` [out/TP, in] (``linear_qkv``, ``linear_fc1``): ``A`` [r, in] is
  replicated, ``B`` [out/TP, r] is split like ``W``'s rows, so ``B``'s local rows follow ``W``'s
  fused layouts (query groups of ``linear_qkv``, ``[gate_k; up_k]`` of ``linear_fc1``, partition
  stride 2). The branch computes ``h = A x`` (under sequence parallelism on this rank's tokens,
  then an all-gather of the small [s, b, r] ``h``, whose backward reduce-scatters), then ``B h``;
  without sequence parallelism ``h`` enters the TP region (backward all-reduce of ``dh``);
* row-parallel base ``W`` [out, in/TP] (``linear_proj``, ``linear_fc2``): ``A`` [r, in/TP] is split
  like ``W``'s columns and ``B`` [out, r] replicated; the partial ``A x`` products are summed over
  TP (all-reduce of [s, b, r], or a reduce-scatter over the sequence under sequence parallelism)
  before ``B``.

A replicated adapter whose gradient is a sum over this rank's tokens (``A`` of a column layer,
``B`` of a row layer, under sequence parallelism) is marked ``sequence_parallel`` so Megatron's
``finalize_model_grads`` all-reduces it over TP as it does the norms.

Every base parameter is frozen (Megatron's DDP gives gradient buffers and the optimizer state
only to ``requires_grad`` parameters, and the frozen linears run Megatron's
``linear_with_frozen_weight``). ``B`` starts at zero and ``A`` is drawn full-size from a generator
seeded by the run's seed and the layer's global name, so every layout starts from the same
adapters and step 0 is the base model bit for bit.

The model's ``sharded_state_dict`` (what checkpoints save and load) holds only the trained
parameters; :func:`adapters_disabled` / :class:`BaseModelView` run the base model (the frozen
reference of RL and DPO without a second copy of the weights); :func:`merge_adapters` folds
``s B A`` into the weights with an exact unmerge (:class:`MergedWeight`), for generation.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_data_parallel_rng_tracker_name
from megatron.core.transformer.mlp import MLP, apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from hyflow.models.builder import resolve_spec
from hyflow.models.lora_config import LORA_TARGETS, LoRAConfig
from hyflow.models.weights import _stable_hash

#: target -> (submodule of a TransformerLayer, parameter path inside the layer)
TARGET_PATHS = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
                "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
assert set(TARGET_PATHS) == set(LORA_TARGETS)


class LoRAError(ValueError):
    """A model LoRA cannot adapt (the message names the layer and what to change)."""


# --------------------------------------------------------------------------- the layers


class _Adapter:
    """What the two LoRA linears share: the switches and the dropout of the adapter input."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter
    lora_scale: float
    lora_dropout: float
    #: False inside :func:`adapters_disabled` and while the product is merged into the weight
    lora_active: bool

    def _dropout(self, x: torch.Tensor, replicated_over_tp: bool) -> torch.Tensor:
        """Dropout of the adapter input; a TP-replicated input gets the same mask on every TP rank
        (Megatron's data-parallel stream), a TP-split one its own (the model-parallel stream)."""
        if not (self.training and self.lora_dropout > 0):
            return x
        name = get_data_parallel_rng_tracker_name() if replicated_over_tp else None
        with get_cuda_rng_tracker().fork(*([name] if name else [])):
            return F.dropout(x, self.lora_dropout, training=True)


class LoRAColumnParallelLinear(ColumnParallelLinear, _Adapter):
    """``ColumnParallelLinear`` plus ``s B A x`` (``A`` replicated, ``B`` split along the output)."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.lora_active:
            return output, bias
        h = F.linear(self._dropout(input_, replicated_over_tp=not self.sequence_parallel), self.lora_A)
        if self.sequence_parallel:  # this rank's tokens -> all tokens (backward: reduce-scatter of dh)
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
        elif self.tp_group.size() > 1:  # backward: dh from every rank's B rows, all-reduced
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return output + F.linear(h, self.lora_B) * self.lora_scale, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0, "bias": 0, "lora_B": 0},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if getattr(self.lora_B, "partition_stride", 1) == 2:  # a GLU fc1: [gate_k; up_k] like its weight
            key = f"{prefix}lora_B"
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets,
                                                      (metadata or {}).get("singleton_local_shards", False))
        return state


class LoRARowParallelLinear(RowParallelLinear, _Adapter):
    """``RowParallelLinear`` plus ``s B A x`` (``A`` split along the input, ``B`` replicated)."""

    def forward(self, input_):
        output, bias = super().forward(input_)
        if not self.lora_active:
            return output, bias
        h = F.linear(self._dropout(input_, replicated_over_tp=False), self.lora_A)  # partial over TP
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif self.tp_group.size() > 1:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return output + F.linear(h, self.lora_B) * self.lora_scale, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 1, "lora_A": 1},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


_ADAPTED = {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear}


class LoRAModel:
    """Mixed into an adapted ``GPTModel``'s class: checkpoints hold its trained parameters only
    (the adapters, and e.g. a critic's value head), the frozen base is referenced, not copied."""

    lora_config: LoRAConfig
    lora_base: dict  # the frozen weights' reference that checkpoints record

    def trained_names(self) -> set[str]:
        return {n for n, p in self.named_parameters() if p.requires_grad}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        full = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        keep = {prefix + n for n in self.trained_names()}
        return {k: v for k, v in full.items() if k in keep}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        trained = self.trained_names()
        missing = sorted(k for k in result.missing_keys if k in trained)
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"LoRA state dict: missing trained parameters {missing[:4]}, unexpected keys "
                               f"{sorted(result.unexpected_keys)[:4]}")
        return result


_MODEL_CLASSES: dict[type, type] = {}


def _adapted_model_class(cls: type) -> type:
    if issubclass(cls, LoRAModel):
        return cls
    if cls not in _MODEL_CLASSES:
        _MODEL_CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRAModel, cls), {})
    return _MODEL_CLASSES[cls]


# --------------------------------------------------------------------------- adapting a model


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not isinstance(model, BaseModelView):  # DDP, Float16Module
        model = model.module
    return model


def lora_modules(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[_Adapter]:
    """Every adapted linear of ``model`` (or of a list of model chunks), in module order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in _unwrap(chunk).modules() if isinstance(m, _Adapter)]


def has_adapters(model: torch.nn.Module | Sequence[torch.nn.Module]) -> bool:
    """Whether ``model`` was adapted by :func:`apply_lora`."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return any(isinstance(_unwrap(c), LoRAModel) for c in chunks)


def lora_config_of(model: torch.nn.Module) -> Optional[LoRAConfig]:
    """The adapters' settings of an adapted model, else None."""
    inner = _unwrap(model)
    return inner.lora_config if isinstance(inner, LoRAModel) else None


def _mark(param: torch.nn.Parameter, split_dim: Optional[int], stride: int = 1, sequence_parallel: bool = False):
    """Megatron's tensor-parallel attributes (read by DDP, the optimizer's grad norm, the full
    state dict helpers)."""
    param.tensor_model_parallel = split_dim is not None
    param.partition_dim = split_dim if split_dim is not None else -1
    param.partition_stride = stride
    param.sequence_parallel = sequence_parallel


def initial_a(rank: int, fan_in: int, seed: int, name: str) -> torch.Tensor:
    """The full ``A`` [rank, fan_in] of the adapter called ``name`` (global layer numbering): PEFT's
    Kaiming-uniform draw (bound ``1/sqrt(fan_in)``) from a generator of its own, so it does not
    depend on the layout or the order of the layers."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name + ".lora_A")) % (2**63))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _target(layer: torch.nn.Module, target: str, index: int) -> torch.nn.Module:
    path = TARGET_PATHS[target]
    if target.startswith("linear_fc") and not isinstance(layer.mlp, MLP):
        raise LoRAError(f"decoder layer {index}: {target} sits in a {type(layer.mlp).__name__} (mixture of "
                        "experts), which LoRA does not adapt; target linear_qkv / linear_proj only")
    module = layer.get_submodule(path)
    if type(module) not in _ADAPTED:
        raise LoRAError(
            f"decoder layer {index}: {path} is a {type(module).__name__}; LoRA adapts Megatron's "
            "ColumnParallelLinear / RowParallelLinear (the local and sdpa layer specs): set the model spec "
            "to sdpa or local (Transformer Engine's fused layer-norm linear hides the normalised input)")
    if getattr(module, "gather_output", False):
        raise LoRAError(f"decoder layer {index}: {path} gathers its output; LoRA adapts layers that keep it split")
    return module


@torch.no_grad()
def apply_lora(model: torch.nn.Module, config: LoRAConfig, seed: int,
               trainable: Iterable[str] = (), base: Optional[dict] = None) -> int:
    """Adapt ``model`` (one built, not yet DDP-wrapped ``GPTModel`` chunk) in place: freeze every
    parameter except those named in ``trainable`` (e.g. a critic's ``output_layer.weight``) and add
    adapters to ``config.targets`` of each decoder layer. ``base``: what checkpoints record about
    the frozen weights (:func:`hyflow.checkpoint.adapters.base_reference`). Returns the number of
    adapted linears."""
    config.validate()
    model = _unwrap(model)
    keep = set(trainable)
    for name, param in model.named_parameters():
        param.requires_grad_(name in keep)
    count = 0
    for layer in model.decoder.layers:
        index = layer.layer_number - 1  # Megatron's global (1-based) layer number
        for target in config.targets:
            module = _target(layer, target, index)
            _adapt(module, config, seed, f"decoder.layers.{index}.{TARGET_PATHS[target]}")
            count += 1
    model.__class__ = _adapted_model_class(type(model))
    model.lora_config, model.lora_base = config, dict(base or {})
    if model.pre_process and model.config.recompute_granularity == "full":
        # Megatron's (reentrant) recomputation only differentiates a block whose input needs a
        # gradient; the frozen embedding's output does not, so the first block's adapters would
        # get none.
        model.embedding.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True) if
                                              torch.is_grad_enabled() else out)
    return count


def _adapt(module: torch.nn.Module, config: LoRAConfig, seed: int, name: str) -> None:
    weight = module.weight
    out_local, in_local = weight.shape
    tp, tp_rank = module.tp_group.size(), module.tp_group.rank()
    column = isinstance(module, ColumnParallelLinear)
    sp = bool(module.sequence_parallel)
    a_full = initial_a(config.rank, in_local * (1 if column else tp), seed, name)
    if column:
        a = a_full
        b = torch.zeros(out_local, config.rank)
    else:
        a = a_full[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        b = torch.zeros(out_local, config.rank)
    kwargs = dict(device=weight.device, dtype=weight.dtype)
    module.lora_A = torch.nn.Parameter(a.to(**kwargs).contiguous())
    module.lora_B = torch.nn.Parameter(b.to(**kwargs))
    if column:
        _mark(module.lora_A, None, sequence_parallel=sp)
        _mark(module.lora_B, 0, getattr(weight, "partition_stride", 1))
    else:
        _mark(module.lora_A, 1)
        _mark(module.lora_B, None, sequence_parallel=sp)
    module.__class__ = _ADAPTED[type(module)]
    module.lora_scale, module.lora_dropout, module.lora_active = config.scale, config.dropout, True


# --------------------------------------------------------------------------- the base model


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module | Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within the block ``model`` (a model, or a list of chunks) computes its base model: every
    adapter is skipped (the RL / DPO reference, without a second copy of the weights)."""
    modules = lora_modules(model)
    saved = [m.lora_active for m in modules]
    for m in modules:
        m.lora_active = False
    try:
        yield
    finally:
        for m, active in zip(modules, saved):
            m.lora_active = active


class BaseModelView(torch.nn.Module):
    """The base model of an adapted ``model``, as a model chunk: its forward is ``model``'s with
    the adapters off. It owns no parameters (``model`` is not registered as a submodule), so it is
    the frozen reference for free; other attributes (``config``, ``set_input_tensor``, ...) are
    ``model``'s, as a pipeline schedule expects of a model chunk."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "module", _unwrap(model))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "module"), name)

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.module):
            return self.module(*args, **kwargs)


# --------------------------------------------------------------------------- merging


#: elements of one block of the merge's temporary (the delta of a few rows at a time)
MERGE_BLOCK_ELEMENTS = 1 << 22


class MergedWeight:
    """``weight += scale * B @ A`` in place, undone exactly by :meth:`unmerge`.

    ``(w + d) - d`` is ``w`` in floating point except where the sum rounded across a binade or to a
    tie; those few elements are found when merging (the rows' delta is at hand) and their
    original values kept, so the unmerge restores every bit. The delta is recomputed for the
    unmerge (same inputs, same shapes, same device: the same bits), in blocks of rows, so the
    temporaries stay one block of the weight whatever its size.
    """

    def __init__(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        if weight.shape != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
            raise LoRAError(f"merge: weight {tuple(weight.shape)} does not match B {tuple(b.shape)} @ "
                            f"A {tuple(a.shape)}")
        self.weight, self.a, self.b, self.scale = weight, a, b, scale
        self.rows = max(1, MERGE_BLOCK_ELEMENTS // max(1, weight.shape[1]))
        self.fix_index: Optional[torch.Tensor] = None
        self.fix_value: Optional[torch.Tensor] = None

    def _delta(self, r0: int) -> torch.Tensor:
        b = self.b[r0:r0 + self.rows]
        return (b.float() @ self.a.float()).mul_(self.scale).to(self.weight.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        w = self.weight.detach()
        index, value = [], []
        for r0 in range(0, w.shape[0], self.rows):
            block = w[r0:r0 + self.rows]
            delta = self._delta(r0)
            merged = block + delta
            wrong = ((merged - delta) != block).flatten().nonzero().squeeze(-1)
            if wrong.numel():
                index.append(wrong + r0 * w.shape[1])
                value.append(block.flatten()[wrong])
            block.copy_(merged)
        self.fix_index = torch.cat(index) if index else None
        self.fix_value = torch.cat(value) if value else None

    @torch.no_grad()
    def unmerge(self) -> None:
        w = self.weight.detach()
        for r0 in range(0, w.shape[0], self.rows):
            w[r0:r0 + self.rows].sub_(self._delta(r0))
        if self.fix_index is not None:
            w.view(-1)[self.fix_index] = self.fix_value
        self.fix_index = self.fix_value = None

    @property
    def kept_bytes(self) -> int:
        """Memory the exact unmerge keeps (indices and values of the elements it fixes)."""
        if self.fix_index is None:
            return 0
        return self.fix_index.numel() * self.fix_index.element_size() + self.fix_value.numel() * \
            self.fix_value.element_size()


def merge_adapters(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[MergedWeight]:
    """Fold every adapter of ``model`` into its weight (in ``model``'s own layout: the shards are
    local) and switch the adapters off; returns the merges, which :func:`unmerge_adapters` undoes
    exactly."""
    merges = []
    for m in lora_modules(model):
        if not m.lora_active:
            raise LoRAError("merge: the adapters are off or merged already")
        merge = MergedWeight(m.weight, m.lora_A.detach(), m.lora_B.detach(), m.lora_scale)
        merge.merge()
        m.lora_active = False
        merges.append(merge)
    return merges


def unmerge_adapters(model: torch.nn.Module | Sequence[torch.nn.Module], merges: list[MergedWeight]) -> None:
    """Undo :func:`merge_adapters` bit for bit and switch the adapters back on."""
    for m, merge in zip(lora_modules(model), merges, strict=True):
        merge.unmerge()
        m.lora_active = True


@contextlib.contextmanager
def adapters_merged(model: torch.nn.Module | Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within the block ``model``'s weights hold ``W + s B A`` (a plain forward, or full-weight
    sync to a generation pool); restored exactly afterwards."""
    merges = merge_adapters(model)
    try:
        yield
    finally:
        unmerge_adapters(model, merges)


@torch.no_grad()
def merge_and_unload(model: torch.nn.Module) -> torch.nn.Module:
    """Merge the adapters into the weights for good and turn ``model`` back into the plain
    ``GPTModel`` it was (inference and export of a LoRA checkpoint)."""
    inner = _unwrap(model)
    for m in lora_modules(inner):
        MergedWeight(m.weight, m.lora_A.detach(), m.lora_B.detach(), m.lora_scale).merge()
        del m.lora_A, m.lora_B
        for attr in ("lora_scale", "lora_dropout", "lora_active"):
            delattr(m, attr)
        m.__class__ = next(base for base, adapted in _ADAPTED.items() if isinstance(m, adapted))
    if isinstance(inner, LoRAModel):
        inner.__class__ = next(c for c in type(inner).__mro__[1:] if not issubclass(c, LoRAModel))
        del inner.lora_config, inner.lora_base
    return inner


def adapter_numel(model: torch.nn.Module | Sequence[torch.nn.Module]) -> int:
    """Elements of this rank's adapters."""
    return sum(m.lora_A.numel() + m.lora_B.numel() for m in lora_modules(model))


def lora_spec(spec: str, *loras: Optional[LoRAConfig]) -> str:
    """The layer spec of a run's models when any of them has adapters (``loras``: their settings, None
    where a model has none): ``auto`` never picks Transformer Engine's fused layers then (sdpa instead on
    GPU; ``te`` itself is refused by the config). One spec for all the run's models: the critic and the
    generation model take the actor's weights by parameter name."""
    adapted = any(lora is not None for lora in loras)
    return "sdpa" if adapted and spec == "auto" and resolve_spec("auto") == "te" else spec
