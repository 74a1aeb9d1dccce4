"""``hyflow export --adapter``: a LoRA checkpoint's adapters as a PEFT adapter directory.

    hyflow export --ckpt DIR --out ADAPTER_DIR --adapter

writes ``adapter_config.json`` and ``adapter_model.safetensors`` that ``peft`` loads onto the
Hugging Face base model (``PeftModel.from_pretrained(base, ADAPTER_DIR)``), with PEFT's key names
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``, ...). Megatron fuses q/k/v
into ``linear_qkv`` and gate/up into ``linear_fc1``, each with one adapter: its ``B`` rows split like
the fused weight's (:func:`hyflow.models.hf_mapping.megatron_to_hf_tensors`: per query group for
qkv, halves for gate/up), and its ``A``, shared by the parts, is copied to each (the same
``s B_part A`` per projection). The adapters are read at TP=1 x PP=1 on one process, whatever the
layout they were trained in (dist_checkpointing reslices them); the base is not loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from hyflow.checkpoint.adapters import adapter_settings, lora_config
from hyflow.checkpoint.model import (CheckpointError, build_model_for_loading, load_model_checkpoint,
                                     read_checkpoint_info, read_description, verify_model_checkpoint)
from hyflow.models.builder import DTYPES
from hyflow.models.hf_mapping import megatron_to_hf_tensors, name_map
from hyflow.models.lora import TARGET_PATHS, apply_lora, lora_modules
from hyflow.models.sources.errors import ConversionError
from hyflow.parallel.groups import init_training_groups
from hyflow.parallel.layout import Layout
from hyflow.tools.convert.launch import run_ranks

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Megatron target -> the HF (PEFT) modules its adapter becomes
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


@dataclass
class AdapterJob:
    """What the export rank needs (picklable)."""

    ckpt_dir: str
    out_dir: str
    dtype: str


def peft_tensors(adapters: dict, desc, targets) -> dict:
    """PEFT's tensors from the full adapters ``{"decoder.layers.N.<path>.lora_A" / "lora_B": tensor}``
    (Megatron's layout, global layer numbering)."""
    names = name_map(desc)
    out = {}
    for i in range(desc.num_layers):
        for target in targets:
            prefix = f"decoder.layers.{i}.{TARGET_PATHS[target]}"
            a, b = adapters[prefix + ".lora_A"], adapters[prefix + ".lora_B"]
            parts = megatron_to_hf_tensors(prefix + ".weight", b, desc)  # B's rows split like the fused weight
            for hf_name, b_part in zip(names[prefix + ".weight"], parts, strict=True):
                module = "base_model.model." + hf_name[:-len(".weight")]
                out[module + ".lora_A.weight"] = a.clone()  # one A per projection (PEFT has no sharing)
                out[module + ".lora_B.weight"] = b_part.contiguous()
    return out


def adapter_config(settings: dict, base: str) -> dict:
    """PEFT's ``adapter_config.json`` for adapters trained with ``settings``."""
    config = lora_config(settings)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
        "target_modules": sorted({m for t in config.targets for m in HF_MODULES[t]}),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
        "modules_to_save": None, "init_lora_weights": True,
    }


def export_adapter_rank(job: AdapterJob) -> int:
    """Load the adapters on this single rank (at TP=1 x PP=1) and write the PEFT tensors; returns
    their bytes."""
    info = read_checkpoint_info(job.ckpt_dir)
    settings = adapter_settings(info.extra)
    desc = read_description(job.ckpt_dir)
    groups = init_training_groups(Layout(tp=1, pp=1))
    model = build_model_for_loading(desc, groups, dtype=info.dtype, spec="local")
    with torch.no_grad():  # the base is never read: zeros instead of its (uninitialised, maybe non-finite)
        for p in model.parameters():  # memory, which the load's finite-weights check would refuse
            p.zero_()
    config = lora_config(settings)
    apply_lora(model, config, seed=0, trainable=settings.get("trained", ()), base=settings.get("base"))
    load_model_checkpoint(model, job.ckpt_dir, groups, desc, verify=False)
    adapted = {id(m) for m in lora_modules(model)}
    adapters = {}
    for name, module in model.named_modules():
        if id(module) in adapted:
            adapters[name + ".lora_A"] = module.lora_A.detach()
            adapters[name + ".lora_B"] = module.lora_B.detach()
    tensors = {k: v.to(DTYPES[job.dtype]).contiguous() for k, v in peft_tensors(adapters, desc, config.targets).items()}
    save_file(tensors, os.path.join(job.out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def export_adapter(model_dir: str, out_dir: str, *, dtype: str = "auto", force: bool = False, log=print) -> int:
    """Write ``model_dir``'s adapters (a LoRA model checkpoint) as a PEFT directory at ``out_dir``;
    returns the adapter bytes written. Raises :class:`ConversionError` before writing anything for a
    checkpoint without adapters or a non-empty ``out_dir``."""
    info = read_checkpoint_info(model_dir)
    settings = adapter_settings(info.extra)
    if settings is None:
        raise ConversionError(f"{model_dir} holds a whole model, not LoRA adapters: export it without --adapter")
    if os.path.exists(out_dir) and os.listdir(out_dir) and not force:
        raise ConversionError(f"{out_dir} is not empty; pass --force to replace its contents")
    try:
        verify_model_checkpoint(model_dir)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if os.path.exists(out_dir) and force:
        shutil.rmtree(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    base = settings.get("base", {})
    described = base.get("checkpoint") or f"random init (seed {base.get('random_init_seed')})"
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config(settings, described), f, indent=2, sort_keys=True)
    job = AdapterJob(os.path.abspath(model_dir), os.path.abspath(out_dir), info.dtype if dtype == "auto" else dtype)
    nbytes = run_ranks(export_adapter_rank, 1, job)[0]
    log(f"hyflow export: LoRA adapters (rank {settings['rank']}, {', '.join(settings['targets'])}) of base "
        f"{described} -> PEFT {out_dir} ({nbytes / 2**20:.2f} MiB)")
    return nbytes
