"""hyflow model checkpoint (any layout) -> HF directory that transformers loads.

One rank loads the checkpoint at TP=1 x PP=1 (dist_checkpointing reslices it from
whatever layout it was written with), then writes the HF tensors in file order,
one safetensors shard at a time, releasing each Megatron parameter as soon as
its HF tensors are written: host memory stays near one model plus one shard.
Vocabulary padding is stripped; ``config.json`` keeps the source model's extra
keys (token ids...) when the checkpoint has them; the tokenizer files and
``generation_config.json`` are copied.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from hyflow.models.hf_mapping import hf_config_from_description, megatron_to_hf_tensors, name_map
from hyflow.models.weights import full_parameter_shapes
from hyflow.tools.convert.hf2mcore import HF_DIR, TOKENIZER_DIR
from hyflow.tools.convert.launch import run_ranks
from hyflow.tools.convert.memory import MemoryReport, PeakMemory, ProcessMemory, Stopwatch
from hyflow.tools.convert.preflight import check_output_dir, looks_like_hf_export, plan_mcore2hf

DEFAULT_SHARD_BYTES = 2 * 1024**3
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class ExportJob:
    """What the export rank needs (picklable).

    Attributes:
        ckpt_dir: hyflow checkpoint.
        out_dir: HF directory (created by the caller).
        dtype: dtype of the written tensors.
        max_shard_bytes: split the safetensors files at about this size.
    """

    ckpt_dir: str
    out_dir: str
    dtype: str
    max_shard_bytes: int = DEFAULT_SHARD_BYTES


def _plan_shards(desc, dtype: str, max_bytes: int) -> list[list[str]]:
    """Megatron names grouped into consecutive shards of at most ``max_bytes`` (HF order)."""
    size = 2 if dtype in ("bf16", "fp16") else 4
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in full_parameter_shapes(desc).items():
        numel = 1
        for d in shape:
            numel *= d
        if shards[-1] and used + numel * size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += numel * size
    return shards


def export_rank(job: ExportJob) -> ProcessMemory:
    """Load the checkpoint on this single rank and write the HF safetensors files."""
    # Megatron and the model code only in the ranks: the launching process imports this module and stays small
    import torch
    from safetensors.torch import save_file

    from hyflow.models.builder import DTYPES
    from hyflow.checkpoint.model import load_model_from_checkpoint
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout

    with PeakMemory() as memory:
        groups = init_training_groups(Layout(tp=1, pp=1))
        # prepare_export verified the files in the parent process
        model, desc, _ = load_model_from_checkpoint(job.ckpt_dir, groups, spec="local", verify=False)
        params = dict(model.named_parameters())
        hf_names = name_map(desc)
        shards = _plan_shards(desc, job.dtype, job.max_shard_bytes)
        files = [("model.safetensors" if len(shards) == 1 else
                  f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors") for i in range(len(shards))]
        weight_map: dict[str, str] = {}
        total = 0
        for names, file in zip(shards, files, strict=True):
            tensors: dict[str, torch.Tensor] = {}
            for mc_name in names:
                param = params.pop(mc_name)
                full = param.detach()
                if mc_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    full = full[: desc.vocab_size]
                pieces = megatron_to_hf_tensors(mc_name, full, desc)
                for hf, tensor in zip(hf_names[mc_name], pieces, strict=True):
                    tensors[hf] = tensor.to(DTYPES[job.dtype]).contiguous()
                    weight_map[hf] = file
                    total += tensors[hf].numel() * tensors[hf].element_size()
                param.data = torch.empty(0, dtype=param.dtype)  # release as we go
            save_file(tensors, os.path.join(job.out_dir, file), metadata={"format": "pt"})
            _readable_like_config(os.path.join(job.out_dir, file))
            del tensors
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(os.path.join(job.out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        del model, params
    return memory.result


def _readable_like_config(path: str) -> None:
    """safetensors writes through a 0600 temporary file: give the weights config.json's mode (the
    umask's), so whoever may read the config (a serving user) may read the model too."""
    config = os.path.join(os.path.dirname(path), "config.json")
    mode = os.stat(config).st_mode & 0o777 if os.path.exists(config) else 0o644
    os.chmod(path, mode)


def write_hf_metadata(ckpt_dir: str, out_dir: str, desc, dtype: str, log=print) -> None:
    """config.json (from the description and the source config), generation config, tokenizer;
    ``log`` says when there is no tokenizer to export."""
    base = None
    source_cfg = os.path.join(ckpt_dir, HF_DIR, "config.json")
    if os.path.exists(source_cfg):
        with open(source_cfg) as f:
            base = json.load(f)
    config = hf_config_from_description(desc, base, dtype=_TORCH_DTYPES[dtype])
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    generation = os.path.join(ckpt_dir, HF_DIR, "generation_config.json")
    if os.path.exists(generation):
        shutil.copy2(generation, os.path.join(out_dir, "generation_config.json"))
    tokenizer = desc.tokenizer or os.path.join(ckpt_dir, TOKENIZER_DIR)
    if os.path.isdir(tokenizer):
        for name in sorted(os.listdir(tokenizer)):
            path = os.path.join(tokenizer, name)
            if os.path.isfile(path):
                shutil.copy2(path, os.path.join(out_dir, name))
    elif desc.tokenizer == "char":
        log("hyflow export: note: the model uses hyflow's built-in character tokenizer ('char'), which has no "
            f"Hugging Face tokenizer files: {out_dir} has none (transformers' AutoTokenizer cannot load it; "
            "encode text as the char tokenizer does, or train with a HF tokenizer)")
    else:
        log(f"hyflow export: note: no tokenizer directory to copy ({desc.tokenizer or 'model.json names none'}): "
            f"{out_dir} has the model only; copy the tokenizer files there yourself")


def prepare_export(ckpt_dir: str, out_dir: str, *, dtype: str | None = None, force: bool = False,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, log=print):
    """Validate (the checkpoint's files included), create ``out_dir`` and write the non-tensor
    files; returns (plan, job)."""
    plan = plan_mcore2hf(ckpt_dir, out_dir, dtype=dtype, force=force, warn=log)
    if os.path.exists(out_dir) and force:
        shutil.rmtree(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    write_hf_metadata(ckpt_dir, out_dir, plan.desc, plan.dtype, log=log)
    job = ExportJob(ckpt_dir=os.path.abspath(ckpt_dir), out_dir=os.path.abspath(out_dir),
                    dtype=plan.dtype, max_shard_bytes=max_shard_bytes)
    return plan, job


def mcore2hf(ckpt_dir: str, out_dir: str, *, dtype: str | None = None, force: bool = False,
             max_shard_bytes: int = DEFAULT_SHARD_BYTES, log=print) -> MemoryReport:
    """Export ``ckpt_dir`` as an HF directory at ``out_dir``; returns the memory / time report.

    Raises :class:`~hyflow.models.sources.errors.ConversionError` before writing
    anything for a missing or incomplete checkpoint or a non-empty ``out_dir``.
    """
    # Written into a sibling directory and moved into place at the end: a failure (a non-finite
    # tensor, a full disk) leaves ``out_dir`` as it was, and --force replaces a previous export only
    # once the new one is complete.
    check_output_dir(out_dir, force, (ckpt_dir,), looks_like_hf_export, "model directory hyflow export wrote")
    staging = f"{os.path.normpath(out_dir)}.partial-{os.getpid()}"
    with Stopwatch() as clock:
        try:
            plan, job = prepare_export(ckpt_dir, staging, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                       log=lambda message: log(message.replace(staging, out_dir)))
            log(f"hyflow convert: {plan.desc.family} checkpoint written at tp={plan.info.tp} "
                f"pp={plan.info.pp} -> HF {plan.dtype} in {out_dir}")
            ranks = run_ranks(export_rank, 1, job)
            if os.path.exists(out_dir):
                shutil.rmtree(out_dir)
            os.rename(staging, out_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return MemoryReport(direction="mcore2hf", model_bytes=plan.model_bytes, processes=ranks,
                        names=["rank 0"], seconds=clock.seconds,
                        details={"checkpoint": f"{ckpt_dir} (tp={plan.info.tp} pp={plan.info.pp} "
                                               f"{plan.info.dtype})", "dtype": plan.dtype})
