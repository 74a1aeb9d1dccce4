"""HF (safetensors / .bin / GGUF) -> hyflow model checkpoint (Megatron dist checkpoint).

:func:`hf2mcore` runs the pre-flight checks, prepares the output directory
(tokenizer, source config), then starts ``tp * pp`` ranks. Each rank
(:func:`convert_rank`) builds its part of the Megatron model without random
initialisation, fills every parameter with just its shard read from the source
(see :mod:`.shard_reader`), and the ranks save together with
:func:`hyflow.checkpoint.model.save_model_checkpoint`. Host memory per rank is its
shard of the model, one read block (16 MiB) or one parameter's columns, and the
copies Megatron's save makes of views (the gated ``linear_fc1``'s gate / up halves);
the launching process holds no tensors and does not load Megatron (its pre-flight
reads headers only): 1.45-1.51x the model in all at TP=2 in tests/test_convert_cli.py.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from hyflow.tools.convert.launch import run_ranks
from hyflow.tools.convert.memory import MemoryReport, PeakMemory, ProcessMemory, Stopwatch
from hyflow.tools.convert.preflight import Hf2McorePlan, plan_hf2mcore

HF_DIR = "hf"  #: source config.json / generation_config.json, kept for the export
TOKENIZER_DIR = "tokenizer"


@dataclass
class RankJob:
    """What one rank needs (picklable; sent to spawned ranks).

    Attributes:
        source_path: HF directory or GGUF file.
        desc: the model description as a dict.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        dtype: ``fp32`` or ``bf16``.
        out_dir: checkpoint directory.
        extra: recorded in ``hyflow_checkpoint.json``.
        stage_layers: decoder layers per pipeline stage (None: even).
        ep: expert-parallel size.
        etp: expert tensor-parallel size (None: tp).
    """

    source_path: str
    desc: dict[str, Any]
    tp: int
    pp: int
    dtype: str
    out_dir: str
    extra: dict[str, Any] = field(default_factory=dict)
    stage_layers: Optional[tuple[int, ...]] = None
    ep: int = 1
    etp: Optional[int] = None


def convert_rank(job: RankJob) -> ProcessMemory:
    """This rank's part of the conversion (collective over the plan's ranks: ``tp * pp``, more
    with experts, see :func:`~hyflow.tools.convert.preflight.conversion_world`)."""
    # Megatron and the model code only in the ranks: the launching process imports this module and stays small
    import torch

    from hyflow.checkpoint.model import build_model_for_loading, save_model_checkpoint
    from hyflow.models.description import ModelDescription
    from hyflow.models.hf_mapping import name_map
    from hyflow.models.weights import expert_offset, global_name, layer_offset, split_of
    from hyflow.parallel.groups import init_training_groups
    from hyflow.parallel.layout import Layout
    from hyflow.models.sources.model_source import open_model_source
    from hyflow.models.sources.shard_reader import fill_shard
    from hyflow.tools.convert.preflight import conversion_world

    with PeakMemory() as memory:
        desc = ModelDescription.from_dict(job.desc)
        layout = Layout(tp=job.tp, pp=job.pp, ep=job.ep, etp=job.etp, stage_layers=job.stage_layers)
        groups = init_training_groups(layout.with_dp_for(conversion_world(job.tp, job.pp, job.ep, job.etp)))
        model = build_model_for_loading(desc, groups, dtype=job.dtype, spec="local")
        source = open_model_source(job.source_path).weights
        names = name_map(desc)
        offset, experts = layer_offset(desc, groups), expert_offset(desc, groups)
        with torch.no_grad():
            for name, param in model.named_parameters():
                key = global_name(name, offset, experts)
                if key == "output_layer.weight" and desc.tied_embeddings:
                    key = "embedding.word_embeddings.weight"  # last stage's copy of the tied table
                fill_shard(source, key, names[key], desc, param, *split_of(name, groups))
        save_model_checkpoint(model, job.out_dir, groups, desc, extra=job.extra, overwrite=True)
        del model
    return memory.result


def _prepare_output(plan: Hf2McorePlan) -> Optional[str]:
    """Create the output directory with the tokenizer and source configs; tokenizer path."""
    if os.path.exists(plan.out_dir) and plan.force:
        shutil.rmtree(plan.out_dir)
    os.makedirs(os.path.join(plan.out_dir, HF_DIR), exist_ok=True)
    source = plan.source
    with open(os.path.join(plan.out_dir, HF_DIR, "config.json"), "w") as f:
        json.dump(source.config, f, indent=2, sort_keys=True)
    if source.generation_config is not None:
        with open(os.path.join(plan.out_dir, HF_DIR, "generation_config.json"), "w") as f:
            json.dump(source.generation_config, f, indent=2, sort_keys=True)
    if source.write_tokenizer(os.path.join(plan.out_dir, TOKENIZER_DIR)):
        return TOKENIZER_DIR  # relative: resolved against the checkpoint directory
    return None


def _rank_job(plan: Hf2McorePlan) -> RankJob:
    return RankJob(
        source_path=os.path.abspath(plan.source.path), desc=plan.desc.to_dict(), tp=plan.tp,
        pp=plan.pp, dtype=plan.dtype, out_dir=os.path.abspath(plan.out_dir), stage_layers=plan.stage_layers,
        ep=plan.ep, etp=plan.etp,
        extra={"converted_from": os.path.abspath(plan.source.path), "source_format": plan.source.format,
               "source_weights": plan.source.weights.kind})


def prepare_conversion(hf_path: str, out_dir: str, *, tp: int = 1, pp: int = 1,
                       dtype: str = "auto", force: bool = False,
                       stage_layers: Optional[Sequence[int]] = None, ep: int = 1,
                       etp: Optional[int] = None) -> tuple[Hf2McorePlan, RankJob]:
    """Validate the inputs, then create ``out_dir`` with the tokenizer and source configs.

    Returns the plan and the job every rank runs (:func:`convert_rank`).
    """
    plan = plan_hf2mcore(hf_path, out_dir, tp=tp, pp=pp, dtype=dtype, force=force, stage_layers=stage_layers,
                         ep=ep, etp=etp)
    plan.desc.tokenizer = _prepare_output(plan)
    return plan, _rank_job(plan)


def hf2mcore(hf_path: str, out_dir: str, *, tp: int = 1, pp: int = 1, dtype: str = "auto",
             force: bool = False, log=print, stage_layers: Optional[Sequence[int]] = None, ep: int = 1,
             etp: Optional[int] = None) -> MemoryReport:
    """Convert ``hf_path`` into a checkpoint at ``out_dir`` laid out for ``tp`` x ``pp`` (the
    decoder layers per stage ``stage_layers``, default even; the checkpoint loads in any layout).

    Raises :class:`~hyflow.models.sources.errors.ConversionError` (before writing
    anything) for bad inputs. Returns the memory / time report.
    """
    with Stopwatch() as clock, PeakMemory() as parent:
        plan, job = prepare_conversion(hf_path, out_dir, tp=tp, pp=pp, dtype=dtype, force=force,
                                       stage_layers=stage_layers, ep=ep, etp=etp)
        for warning in plan.warnings:
            log(f"hyflow convert: warning: {warning}")
        log(f"hyflow convert: {plan.desc.family} model, {plan.desc.num_parameters():,} parameters, "
            f"{plan.source.weights.kind} -> tp={tp} pp={pp}{f' ep={ep}' if ep > 1 else ''} {plan.dtype} in {out_dir}")
        ranks = run_ranks(convert_rank, plan.world_size, job)
    # One rank runs in this process and measures itself; otherwise add the parent.
    processes = ranks if plan.world_size == 1 else [parent.result] + ranks
    names = [f"rank {r}" for r in range(plan.world_size)]
    return MemoryReport(direction="hf2mcore", model_bytes=plan.model_bytes, processes=processes,
                        names=names if plan.world_size == 1 else ["launcher"] + names, seconds=clock.seconds,
                        details={"source": f"{hf_path} ({plan.source.weights.kind})",
                                 "layout": f"tp={tp} pp={pp} ep={ep}", "dtype": plan.dtype})
