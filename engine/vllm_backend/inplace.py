"""The generation shards written straight into vLLM's live weights: the fast half of a transition.

vLLM's in-place reload (``reload_weights``, the engine's fallback) rebuilds every layer on the
meta device, allocates it anew, copies the checkpoint-format tensors in through the weight
loaders, re-runs the post-load processing (on CPU: the GEMM weight packing) and copies the result
back into the old storage: per weight, fresh pages and three passes besides the packing (measured
in BENCHMARKS.md, issue #31). :class:`InPlaceLoader` plans once where each generation-model
parameter goes in vLLM's model and then writes it there, every transition:

* a linear layer whose weight vLLM keeps (GPU, CPU with ``rollout.vllm.cpu_gemm: plain``; biases
  everywhere): in place. Q/K/V rows go from Megatron's per-group order to vLLM's ``[q; k; v]`` by
  one ``index_select`` into vLLM's storage;
  ``[gate; up]`` and the row-parallel weights are one copy each (a TP shard of Megatron's is
  vLLM's shard, :mod:`hyflow.vllm_backend.weights`);
* a linear layer whose weight vLLM's CPU build packed for its GEMM (``cpu_gemm: packed``: oneDNN
  or sgl kernels keep only the packed copy): the layer's own post-load processing packs again,
  reading the generation shard in place (Q/K/V through one reused staging buffer): the packing is
  the pass;
* embedding, output layer and norms: vLLM's weight loader on the live parameter (its vocabulary
  shard and padding), then, if the output layer holds a packed copy (CPU, packed), its post-load
  processing. The input embedding's own packed copy is never used as a GEMM, so it is not rebuilt.

:func:`plan_in_place` refuses (with the reason, and the engine takes vLLM's reload path) unless
every vLLM parameter is written this way by vLLM's unquantized methods: online quantization
(fp8), LoRA, other layer types, or a CPU GEMM that would keep a view of our buffer (zentorch)
go through vLLM's reload.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Union

import torch
import torch.distributed as dist

from hyflow.kernels.reshard_reference import qkv_regroup
from hyflow.models.description import ModelDescription
from hyflow.models.hf_mapping import name_map
from hyflow.models.weights import canonical_name
from hyflow.vllm_backend.cpu_gemm import holds_packed_copy
from hyflow.vllm_backend.weights import VOCAB_NAMES, gather_vocab


def qkv_rows(heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Row indices into Megatron's per-group ``[q_g; k_g; v_g]`` (one TP shard: ``heads`` and
    ``groups`` are this shard's) in vLLM's ``[q; k; v]`` order: the kernels' regrouping applied to
    the row numbers, so one ``index_select`` writes it into vLLM's storage."""
    return qkv_regroup(torch.arange((heads + 2 * groups) * head_dim), heads, groups, head_dim)


@dataclasses.dataclass
class _Write:
    """Where one generation-model parameter goes in vLLM's model."""

    layer: torch.nn.Module  # the vLLM module
    param: str  # its parameter: "weight" or "bias"
    kind: str  # "linear" (one of vLLM's linear layers) or "loader" (norm, embedding, output layer)
    rows: Optional[torch.Tensor] = None  # Q/K/V: vLLM's row order as indices into ours
    vocab: bool = False  # a vocabulary matrix: whole over the TP group, cut to vLLM's vocabulary


class InPlaceLoader:
    """A planned writer of the generation model's shards into one vLLM model (module docstring).

    Args:
        writes: canonical Megatron name -> its :class:`_Write`.
        skipped: Megatron names with no write (the tied output layer: vLLM shares the embedding).
        head: vLLM's output-layer module if it holds a packed copy (re-processed after every load).
        vocab_rows: the vocabulary vLLM's config declares.
        tp_group: the generation TP group.
    """

    def __init__(self, writes: dict[str, _Write], skipped: set[str], head: Optional[torch.nn.Module],
                 vocab_rows: int, tp_group) -> None:
        self.writes, self.skipped, self.head = writes, skipped, head
        self.vocab_rows, self.tp_group = vocab_rows, tp_group
        self._staging: Optional[torch.Tensor] = None
        self.pack_seconds = 0.0

    def _stage(self, like: torch.Tensor) -> torch.Tensor:
        """A reused buffer shaped like ``like`` (no fresh pages per layer and per transition)."""
        n = like.numel()
        if self._staging is None or self._staging.numel() < n or self._staging.dtype != like.dtype:
            self._staging = torch.empty(n, dtype=like.dtype, device=like.device)
        return self._staging[:n].view(like.shape)

    @torch.no_grad()
    def load(self, gen_model: torch.nn.Module) -> None:
        """Write every parameter of ``gen_model`` (the generation layout's) into vLLM's model."""
        self.pack_seconds = 0.0
        module = getattr(gen_model, "module", gen_model)
        seen = set()
        for raw_name, param in module.named_parameters():
            name = canonical_name(raw_name)
            if name in self.skipped:
                continue
            write = self.writes.get(name)
            if write is None:
                raise KeyError(f"{raw_name}: not in the planned vLLM weight writes (the generation model "
                               "changed after the plan)")
            seen.add(name)
            tensor = param.detach()
            if write.kind == "linear":
                self._write_linear(write, tensor)
                continue
            if write.vocab:
                if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
                    tensor = gather_vocab(tensor, self.tp_group)
                tensor = tensor[:self.vocab_rows]
            target = getattr(write.layer, write.param)
            _loader(target)(target, tensor)
        missing = set(self.writes) - seen
        if missing:
            raise KeyError(f"the generation model lacks {sorted(missing)[:3]}: vLLM's weights would be partly stale")
        if self.head is not None:
            start = time.perf_counter()
            self.head.quant_method.process_weights_after_loading(self.head)
            self.pack_seconds += time.perf_counter() - start

    def _write_linear(self, write: _Write, tensor: torch.Tensor) -> None:
        layer = write.layer
        target = getattr(layer, write.param)
        if target.numel() == tensor.numel():  # vLLM keeps this tensor: write in place
            if write.rows is None:
                target.data.copy_(tensor)
            elif target.dtype == tensor.dtype and target.is_contiguous():
                torch.index_select(tensor, 0, write.rows, out=target.data)
            else:  # a bias the CPU build keeps in fp32 beside bf16 weights, a weight kept transposed
                target.data.copy_(tensor.index_select(0, write.rows))
            return
        # vLLM's CPU build packed this weight and dropped the plain one: pack again from ours
        source = tensor if write.rows is None else torch.index_select(tensor, 0, write.rows,
                                                                        out=self._stage(tensor))
        start = time.perf_counter()
        layer.weight = torch.nn.Parameter(source, requires_grad=False)
        layer.quant_method.process_weights_after_loading(layer)
        if layer.weight.numel() and layer.weight.data_ptr() == source.data_ptr():
            # a GEMM that kept the plain weight: it must own it, not view our (reused) buffers
            layer.weight = torch.nn.Parameter(source.clone(), requires_grad=False)
        self.pack_seconds += time.perf_counter() - start


def _loader(param: torch.Tensor):
    """vLLM's weight loader of ``param`` (its default one if the layer set none; without the
    wrappers of vLLM's layerwise reload, which would defer the copy)."""
    # optional dependency (loaded by then)
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(param, "weight_loader", default_weight_loader)
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _vllm_target(hf_names: list[str], packed: dict[str, list[str]]) -> tuple[str, str]:
    """(vLLM module name, parameter name) of the Megatron tensor made of ``hf_names``: fused
    tensors (q/k/v, gate/up) go to the module vLLM's ``packed_modules_mapping`` fuses them into."""
    module, _, param = hf_names[0].rpartition(".")
    if len(hf_names) > 1:
        prefix, _, leaf = module.rpartition(".")
        fused = [k for k, parts in packed.items() if list(parts) == [n.rsplit(".", 2)[-2] for n in hf_names]]
        if len(fused) != 1:
            raise LookupError(f"no fused vLLM module for {hf_names}")
        module = f"{prefix}.{fused[0]}"
    return module, param


def plan_in_place(vllm_model: torch.nn.Module, vllm_config, gen_model: torch.nn.Module, desc: ModelDescription,
                  vocab_rows: int, tp_group=None) -> Union[InPlaceLoader, str]:
    """The :class:`InPlaceLoader` of ``gen_model`` into ``vllm_model``, or why vLLM's own reload
    must do it (a one-line reason)."""
    # optional dependency (loaded by then)
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)
    from vllm.platforms import current_platform

    if vllm_config.model_config.quantization is not None:
        return f"online quantization ({vllm_config.model_config.quantization}) repacks through vLLM's loaders"
    if vllm_config.lora_config is not None:
        return "LoRA layers wrap vLLM's linear layers"
    if current_platform.is_cpu() and current_platform.is_zen_cpu():
        return "zentorch GEMMs keep a view of the loaded weight"
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    heads, groups = desc.num_attention_heads // tp, desc.num_query_groups // tp
    rows = qkv_rows(heads, groups, desc.head_dim)
    packed = getattr(vllm_model, "packed_modules_mapping", {})
    hf_names = name_map(desc)
    module = getattr(gen_model, "module", gen_model)
    writes: dict[str, _Write] = {}
    skipped: set[str] = set()
    written: set[int] = set()
    head = None
    for raw_name, param in module.named_parameters():
        name = canonical_name(raw_name)
        if name == "output_layer.weight" and desc.tied_embeddings:
            skipped.add(name)  # Megatron's last-stage copy of the tied embedding: vLLM shares the module
            continue
        if name not in hf_names:
            return f"{raw_name} has no Hugging Face name"
        try:
            module_name, pname = _vllm_target(hf_names[name], packed)
            layer = vllm_model.get_submodule(module_name)
        except (LookupError, AttributeError) as e:
            return f"{raw_name}: no vLLM module ({e})"
        target = getattr(layer, pname, None)
        if not isinstance(target, torch.Tensor):
            return f"{module_name} has no {pname}"
        if isinstance(layer, LinearBase):
            if type(layer.quant_method) is not UnquantizedLinearMethod:
                return f"{module_name} runs {type(layer.quant_method).__name__}"
            out_rows = sum(layer.output_partition_sizes)
            want = (out_rows, layer.input_size_per_partition) if pname == "weight" else (out_rows,)
            if tuple(param.shape) != want or target.numel() not in (0, param.numel()):
                return f"{raw_name} {tuple(param.shape)} does not fit {module_name}.{pname} {want}"
            if target.numel() == 0 and pname != "weight":
                return f"{module_name}.{pname} was dropped by vLLM"
            fused = name.endswith(("linear_qkv.weight", "linear_qkv.bias"))
            writes[name] = _Write(layer, pname, "linear", rows=rows.to(param.device) if fused else None)
        elif isinstance(layer, VocabParallelEmbedding):
            if type(layer.quant_method) is not UnquantizedEmbeddingMethod:
                return f"{module_name} runs {type(layer.quant_method).__name__}"
            writes[name] = _Write(layer, pname, "loader", vocab=True)
        else:
            if name in VOCAB_NAMES or tuple(target.shape) != tuple(param.shape):
                return f"{raw_name} {tuple(param.shape)} does not fit {module_name}.{pname} {tuple(target.shape)}"
            writes[name] = _Write(layer, pname, "loader")
        written.add(id(target))
        if module_name == "lm_head" or (desc.tied_embeddings and name == "embedding.word_embeddings.weight"):
            head = getattr(vllm_model, "lm_head", None)
    for vname, vparam in vllm_model.named_parameters():
        if id(vparam) not in written:
            return f"vLLM's {vname} would not be written"
    if head is not None and type(getattr(head, "quant_method", None)) is not UnquantizedEmbeddingMethod:
        return f"vLLM's output layer runs {type(getattr(head, 'quant_method', None)).__name__}"
    embed = next((w.layer for w in writes.values() if w.vocab and w.layer is not head), None)
    if embed is not None and callable(getattr(embed, "cpu_linear", None)):
        # the CPU build packed the input embedding for a GEMM it never runs (the lookup reads the
        # plain weight; the output layer has its own packed copy): a vocabulary matrix freed
        embed.cpu_linear = None
    return InPlaceLoader(writes, skipped, head if head is not None and holds_packed_copy(head) else None,
                         vocab_rows, tp_group)
