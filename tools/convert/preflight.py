"""Every converter input check, done before any heavy work.

:func:`plan_hf2mcore` and :func:`plan_mcore2hf` open the inputs (headers and
metadata only), validate them and return a plan; any problem is a
:class:`~hyflow.models.sources.errors.ConversionError` whose message names the file,
tensor or number at fault: unsupported architecture, missing or truncated weight
files, tensors whose shapes disagree with config.json, a TP that does not divide
the heads or key/value groups, a PP that does not divide the layers, an output
directory that exists and is not empty (unless ``force``).
"""

from __future__ import annotations

import math

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from hyflow.config import ConfigError
from hyflow.models.hf_mapping import description_from_hf_config, hf_config_warnings
from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.model_source import ModelSource, check_tensors, open_model_source, \
    resolve_dtype
from hyflow.parallel.layout import Layout

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def looks_like_hf_export(out_dir: str) -> bool:
    """What ``--force`` may replace for ``hyflow export``: a flat directory with config.json and
    safetensors files (a model directory as export writes it)."""
    entries = list(os.scandir(out_dir))
    names = {e.name for e in entries}
    return "config.json" in names and any(n.endswith(".safetensors") for n in names) and \
        not any(e.is_dir(follow_symlinks=False) for e in entries)


def looks_like_mcore_checkpoint(out_dir: str) -> bool:
    """What ``--force`` may replace for ``hyflow convert hf2mcore``: a hyflow model checkpoint."""
    names = set(os.listdir(out_dir))
    return bool(names & {"hyflow_checkpoint.json", ".metadata", "manifest.json"})


def check_output_dir(out_dir: str, force: bool, inputs: tuple[str, ...] = (), looks_like=None,
                     kind: str = "converted model") -> None:
    """``out_dir`` must be absent or empty, or ``force`` given and ``looks_like(out_dir)`` true
    (``--force`` replaces a previous output, never unrelated files); it may not hold an input."""
    out = os.path.realpath(out_dir)
    for path in inputs:
        src = os.path.realpath(path)
        if out == src or src.startswith(out + os.sep):
            raise ConversionError(f"output directory {out_dir} contains the input {path}; "
                                  "choose another output directory")
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ConversionError(f"output path {out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not force:
            raise ConversionError(f"output directory {out_dir} exists and is not empty; "
                                  "pass --force to replace its contents")
        if os.listdir(out_dir) and looks_like is not None and not looks_like(out_dir):
            raise ConversionError(f"output directory {out_dir} does not look like a {kind} (--force replaces "
                                  "only a previous output, never unrelated files): choose a new or empty "
                                  "directory")


@dataclass
class Hf2McorePlan:
    """A validated HF -> Megatron conversion.

    Attributes:
        source: the opened source model.
        desc: its description (tokenizer and eos ids filled in by the converter).
        tp: tensor-parallel size to write.
        pp: pipeline-parallel size to write.
        stage_layers: decoder layers per pipeline stage (None: even).
        ep: expert-parallel size to write (mixture-of-experts models).
        etp: expert tensor-parallel size to write (None: tp).
        dtype: ``fp32`` or ``bf16``.
        out_dir: output directory.
        force: replace a non-empty output directory.
        warnings: features that convert but that the engine does not reproduce.
    """

    source: ModelSource
    desc: object
    tp: int
    pp: int
    dtype: str
    out_dir: str
    force: bool = False
    warnings: list[str] = field(default_factory=list)
    stage_layers: Optional[tuple[int, ...]] = None
    ep: int = 1
    etp: Optional[int] = None

    @property
    def model_bytes(self) -> int:
        """Size of the model's parameters in the output dtype (unpadded)."""
        return self.desc.num_parameters() * _BYTES[self.dtype]

    @property
    def world_size(self) -> int:
        """Ranks that write the checkpoint: ``tp * pp``, or with experts enough data-parallel ranks
        per stage that ``etp * ep`` divides them (:func:`conversion_world`)."""
        return conversion_world(self.tp, self.pp, self.ep, self.etp)


def conversion_world(tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> int:
    """Ranks of a conversion layout: each pipeline stage needs a multiple of both ``tp`` and
    ``etp * ep`` ranks (the smallest one: their least common multiple)."""
    return pp * math.lcm(tp, (tp if etp is None else etp) * ep)


def plan_hf2mcore(hf_path: str, out_dir: str, tp: int = 1, pp: int = 1, dtype: str = "auto",
                  force: bool = False, stage_layers: Optional[Sequence[int]] = None, ep: int = 1,
                  etp: Optional[int] = None) -> Hf2McorePlan:
    """Open and validate everything an HF -> Megatron conversion needs."""
    check_output_dir(out_dir, force, (hf_path,), looks_like_mcore_checkpoint, "hyflow model checkpoint")
    source = open_model_source(hf_path)
    try:
        desc = description_from_hf_config(source.config)
        layout = Layout(tp=tp, pp=pp, ep=ep, etp=etp, stage_layers=stage_layers)
        layout.with_dp_for(conversion_world(tp, pp, ep, etp)).check_model(desc, training=False)
    except ConfigError as e:
        raise ConversionError(f"{hf_path}: {e}") from None
    desc.eos_token_ids = source.eos_token_ids()
    check_tensors(source, desc)
    return Hf2McorePlan(source=source, desc=desc, tp=tp, pp=pp, dtype=resolve_dtype(dtype, source),
                        out_dir=out_dir, force=force, warnings=hf_config_warnings(source.config),
                        stage_layers=layout.stage_layers, ep=ep, etp=etp)


@dataclass
class Mcore2HfPlan:
    """A validated Megatron -> HF export.

    Attributes:
        ckpt_dir: the hyflow checkpoint.
        out_dir: HF directory to write.
        desc: the checkpoint's description.
        info: the checkpoint's :class:`~hyflow.checkpoint.model.CheckpointInfo`.
        dtype: dtype of the written tensors (``fp32``, ``bf16``, ``fp16``).
        force: replace a non-empty output directory.
    """

    ckpt_dir: str
    out_dir: str
    desc: object
    info: object
    dtype: str
    force: bool = False

    @property
    def model_bytes(self) -> int:
        return self.desc.num_parameters() * _BYTES[self.dtype]


def plan_mcore2hf(ckpt_dir: str, out_dir: str, dtype: Optional[str] = None,
                  force: bool = False, warn=None) -> Mcore2HfPlan:
    """Validate a checkpoint export: the checkpoint is complete and intact (its files match its
    manifest, its pickles hold plain data: ``HYFLOW_NO_VERIFY=1`` skips the checksums), the
    output is free."""
    # Megatron (seconds) only when the command runs: `hyflow --help` imports this module
    from hyflow.checkpoint.model import CheckpointError, read_checkpoint_info, read_description, \
        verify_model_checkpoint

    check_output_dir(out_dir, force, (ckpt_dir,), looks_like_hf_export, "model directory hyflow export wrote")
    try:
        info = read_checkpoint_info(ckpt_dir)
        desc = read_description(ckpt_dir)
        verify_model_checkpoint(ckpt_dir, warn=warn)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if dtype not in (None, "auto", "fp32", "bf16"):
        raise ConversionError(f"--dtype {dtype!r} is not one of auto, fp32, bf16")
    return Mcore2HfPlan(ckpt_dir=ckpt_dir, out_dir=out_dir, desc=desc, info=info,
                        dtype=info.dtype if dtype in (None, "auto") else dtype, force=force)
