"""Model checkpoints: Megatron-Core distributed checkpoints plus hyflow's metadata.

A hyflow model checkpoint is a directory holding

* a Megatron-Core ``dist_checkpointing`` checkpoint (``torch_dist`` format: one
  ``__<rank>_<n>.distcp`` file per writing rank, ``.metadata``, ``metadata.json``,
  ``common.pt``) of ``model.sharded_state_dict()``; it can be loaded under any
  other TP / PP layout (dist_checkpointing reslices every tensor, and the vocabulary
  padding, which depends on TP, is re-padded with zeros);
* ``model.json``: the :class:`~hyflow.models.description.ModelDescription`. A
  relative ``tokenizer`` path in it is relative to the checkpoint directory;
* ``manifest.json``: size and SHA-256 of every other file (:mod:`.manifest`), checked
  before a load (``--no-verify`` / ``HYFLOW_NO_VERIFY=1`` skips the checksums);
* ``hyflow_checkpoint.json``: :class:`CheckpointInfo` (format version, dtype, the
  layout it was written with). It is written *last*, so a directory without it is
  an interrupted save.

Nothing is unpickled before :mod:`.trust` has checked it holds only tensors and plain data.
A model checkpoint inside a step checkpoint (``step_*/actor``) has no manifest of its own:
the step's ``manifest.json`` lists its files.

Entry points (all collective over the model's ranks): :func:`save_model_checkpoint`,
:func:`load_model_checkpoint` into an existing model, and
:func:`load_model_from_checkpoint`, which builds the model from ``model.json``
(without a random initialisation) and loads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import __version__ as mcore_version, dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.utils import unwrap_model  # Megatron DDP / Float16Module wrappers

from hyflow.checkpoint.adapters import (adapter_info, adapter_settings, base_reference, check_adapter_checkpoint,
                                        check_base, find_base, lora_config)
from hyflow.checkpoint.agree import any_rank
from hyflow.checkpoint.errors import CheckpointDamaged, CheckpointError  # noqa: F401 - re-exported
from hyflow.checkpoint.files import write_json
from hyflow.checkpoint.finite import check_finite
from hyflow.checkpoint.manifest import MANIFEST_FILE, PARTS_DIR, sizes_match, verify_manifest, write_manifest
from hyflow.checkpoint.megatron_io import quiet_dist_checkpointing
from hyflow.checkpoint.trust import check_dcp_pickles, read_dcp_index
from hyflow.models.builder import build_gpt_model
from hyflow.models.description import DESCRIPTION_FILE, ModelDescription, ModelDescriptionError
from hyflow.models.lora import apply_lora, lora_spec, merge_and_unload
from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.hf_weights import load_hf_weights
from hyflow.models.sources.model_source import is_hf_model
from hyflow.models.weights import load_full_state_dict, random_full_state_dict
from hyflow.parallel.groups import ParallelGroups
from hyflow.parallel.layout import pad_vocab_size

CHECKPOINT_INFO_FILE = "hyflow_checkpoint.json"
CHECKPOINT_FORMAT = "hyflow-mcore-dist"
FORMAT_VERSION = 1
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: Fields that must agree between the checkpoint's description and the model's.
_ARCH_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "ffn_hidden_size", "head_dim", "qkv_bias", "tied_embeddings")


@dataclass
class CheckpointInfo:
    """Contents of ``hyflow_checkpoint.json``.

    Attributes:
        format: always :data:`CHECKPOINT_FORMAT`.
        format_version: :data:`FORMAT_VERSION` of the writer.
        dtype: parameter dtype of the saved model (``fp32``, ``bf16``, ``fp16``).
        tp: tensor-parallel size it was written with.
        pp: pipeline-parallel size it was written with.
        num_layers: transformer layers.
        vocab_size: unpadded vocabulary.
        padded_vocab_size: vocabulary rows stored (padded for ``tp``).
        megatron_core: Megatron-Core version of the writer.
        extra: free-form writer details (e.g. the converter's source).
    """

    format: str = CHECKPOINT_FORMAT
    format_version: int = FORMAT_VERSION
    dtype: str = "fp32"
    tp: int = 1
    pp: int = 1
    num_layers: int = 0
    vocab_size: int = 0
    padded_vocab_size: int = 0
    megatron_core: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def model_dtype_name(model: torch.nn.Module) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` of the model's parameters."""
    dtype = next(unwrap_model(model).parameters()).dtype
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"unsupported parameter dtype {dtype}")
    return _DTYPE_NAMES[dtype]


# --------------------------------------------------------------------------- building


def build_model_for_loading(desc: ModelDescription, groups: ParallelGroups, *, dtype: str = "fp32",
                            spec: str = "auto") -> torch.nn.Module:
    """This rank's ``GPTModel`` with uninitialised weights, ready to be loaded into.

    Skips Megatron's random initialisation (which draws every full-size matrix on
    every rank), so building a large model for a checkpoint load is cheap.
    """
    return build_gpt_model(desc, groups, dtype=dtype, spec=spec,
                           config_overrides={"perform_initialization": False})


@torch.no_grad()
def zero_vocab_padding(model: torch.nn.Module, vocab_size: int, groups: ParallelGroups) -> None:
    """Zero the padded vocabulary rows of the embedding and output layer of this rank."""
    for name, param in unwrap_model(model).named_parameters():
        if name not in ("embedding.word_embeddings.weight", "output_layer.weight") or param.dim() != 2:
            continue
        start = groups.tp_rank * param.shape[0]
        first_pad = max(vocab_size - start, 0)
        if first_pad < param.shape[0]:
            param[first_pad:].zero_()


# --------------------------------------------------------------------------- metadata


def read_checkpoint_info(ckpt_dir: str) -> CheckpointInfo:
    """Read and check ``hyflow_checkpoint.json`` and the files the checkpoint needs.

    Raises :class:`CheckpointError` for a missing directory, a save that did not
    finish, missing or truncated ``.distcp`` files, or a newer format.
    """
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    info_path = os.path.join(ckpt_dir, CHECKPOINT_INFO_FILE)
    if not os.path.exists(info_path):
        if os.path.exists(os.path.join(ckpt_dir, "metadata.json")) or os.path.exists(
                os.path.join(ckpt_dir, ".metadata")):
            raise CheckpointError(
                f"{ckpt_dir} is incomplete: it has Megatron checkpoint files but no "
                f"{CHECKPOINT_INFO_FILE}, which hyflow writes last (the save was interrupted, or "
                "the checkpoint was not written by hyflow)")
        raise CheckpointError(
            f"{ckpt_dir} is not a hyflow model checkpoint (no {CHECKPOINT_INFO_FILE}); create one "
            "with `hyflow convert hf2mcore`")
    try:
        with open(info_path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{info_path} is not valid JSON: {e}") from None
    if data.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{info_path}: format {data.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
    if int(data.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt_dir} has checkpoint format version {data['format_version']}, newer than this "
            f"hyflow reads ({FORMAT_VERSION}); upgrade hyflow")
    known = {f.name for f in fields(CheckpointInfo)}
    info = CheckpointInfo(**{k: v for k, v in data.items() if k in known})
    _check_dcp_files(ckpt_dir)
    root, prefix = manifest_location(ckpt_dir)
    # every other file: path, presence and size (checksums: verify_model_checkpoint); the parts of the
    # other ranks' files only without a process group (the ranks of a job read them collectively)
    sizes_match(root, prefix, all_parts=not (dist.is_available() and dist.is_initialized()))
    return info


def manifest_location(ckpt_dir: str) -> tuple[str, str]:
    """(directory holding the manifest that lists ``ckpt_dir``'s files, their prefix there):
    the checkpoint itself, or the step checkpoint a model directory sits in."""
    if os.path.exists(os.path.join(ckpt_dir, MANIFEST_FILE)):
        return ckpt_dir, ""
    parent = os.path.dirname(os.path.normpath(os.path.abspath(ckpt_dir)))
    if os.path.exists(os.path.join(parent, MANIFEST_FILE)):
        return parent, os.path.basename(os.path.normpath(ckpt_dir)) + "/"
    return ckpt_dir, ""


def adapter_base(checkpoint: Optional[str], seed: int) -> dict:
    """What a LoRA checkpoint records about its frozen base: ``checkpoint`` (path and checksum of its
    files, :func:`hyflow.checkpoint.adapters.base_reference`), or the random initialisation's ``seed``."""
    return base_reference(checkpoint, seed, manifest_location(checkpoint) if checkpoint else None)


def verify_model_checkpoint(ckpt_dir: str, groups: Optional[ParallelGroups] = None,
                            warn=None) -> bool:
    """Check ``ckpt_dir`` before a load: every file against the manifest (collective over all
    ranks when a process group exists: each rank checks a share), and every pickle in it
    (:func:`hyflow.checkpoint.trust.check_dcp_pickles`). Raises :class:`CheckpointError`
    (:class:`CheckpointDamaged` naming the file for damage, ``ManifestMissing`` without a
    manifest). Returns False, after ``warn`` (default: a logged warning), when the checkpoint has
    no manifest and verification is off (``--no-verify``)."""
    root, prefix = manifest_location(ckpt_dir)
    manifest = verify_manifest(root, prefix, device=getattr(groups, "device", None))
    check_dcp_pickles(ckpt_dir)
    if manifest is None:
        (warn or logging.getLogger(__name__).warning)(
            f"{ckpt_dir} has no {MANIFEST_FILE}: its files cannot be checked for damage (loaded because "
            "verification is off)")
        return False
    return True


def _check_dcp_files(ckpt_dir: str) -> None:
    """Every data file named by the torch_dist ``.metadata`` exists and is long enough (the
    index is read with hyflow's restricted unpickler: :mod:`hyflow.checkpoint.trust`)."""
    metadata = read_dcp_index(ckpt_dir)
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        end = int(item.offset) + int(item.length)
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{ckpt_dir} is incomplete: data file {name} is missing")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(
                f"{ckpt_dir} is damaged: {name} has {size} bytes but the index needs {end} "
                "(truncated copy?)")


def resolve_tokenizer(ckpt_dir: str, tokenizer: Optional[str]) -> Optional[str]:
    """A description's tokenizer path, relative paths taken from the checkpoint directory
    (the built-in ``char`` tokenizer is a name, not a path)."""
    if not tokenizer or tokenizer == "char" or os.path.isabs(tokenizer):
        return tokenizer
    return os.path.abspath(os.path.join(ckpt_dir, tokenizer))


def store_tokenizer(spec: Optional[str], directory: str, name: str = "tokenizer") -> Optional[str]:
    """Make a checkpoint self-contained: copy a tokenizer *directory* (HF files: small) to
    ``directory/name`` and return ``name``; a file (sentencepiece ``.model``, ``.gguf``) is
    referenced by its absolute path rather than copied, ``char`` and hub names are kept as
    they are. The result is what ``model.json``'s ``tokenizer`` should hold, relative to
    ``directory``."""
    if not spec or spec == "char":
        return spec
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        target = os.path.join(directory, name)
        if os.path.abspath(target) != os.path.abspath(path):
            shutil.copytree(path, target, dirs_exist_ok=True)
        return name
    return os.path.abspath(path) if os.path.exists(path) else spec


def read_description(ckpt_dir: str) -> ModelDescription:
    """The checkpoint's ``model.json`` with the tokenizer path made absolute."""
    try:
        desc = ModelDescription.load(os.path.join(ckpt_dir, DESCRIPTION_FILE))
    except ModelDescriptionError as e:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {e}") from None
    desc.tokenizer = resolve_tokenizer(ckpt_dir, desc.tokenizer)
    return desc


def check_compatible(model_desc: ModelDescription, ckpt_desc: ModelDescription, ckpt_dir: str) -> None:
    """Raise :class:`CheckpointError` naming every architecture field that differs."""
    diffs = [f"{name}: checkpoint {getattr(ckpt_desc, name)!r} vs model {getattr(model_desc, name)!r}"
             for name in _ARCH_FIELDS if getattr(ckpt_desc, name) != getattr(model_desc, name)]
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not fit the model: " + "; ".join(diffs))


# --------------------------------------------------------------------------- save / load


def save_model_checkpoint(model: Optional[torch.nn.Module], ckpt_dir: str, groups: ParallelGroups,
                          desc: ModelDescription, *, extra: Optional[dict[str, Any]] = None,
                          overwrite: bool = False,
                          write_extra: Optional[Callable[[], None]] = None) -> CheckpointInfo:
    """Save ``model`` (every rank's part) to ``ckpt_dir``; collective over all ranks.

    ``model`` is this rank's model (one chunk; virtual-pipeline chunk lists are not
    handled). Other files already in ``ckpt_dir`` (a tokenizer, say) are kept and listed in
    the manifest; an existing checkpoint there is an error unless ``overwrite``, which
    deletes its files first (a layout with fewer ranks leaves no stale ``.distcp`` behind).
    ``write_extra`` runs on rank 0 after ``model.json`` is written and before the manifest
    (to add or rewrite files the manifest must cover). ``model=None``: this rank holds no part
    of it (a rank of another pool, ``trainer.mode: one_step_off``) and joins the collectives
    with nothing to write; rank 0 must hold it.
    """
    if model is None and dist.get_rank() == 0:
        raise CheckpointError("rank 0 must hold the model it saves")
    check_finite({"model": model}, f"saving {ckpt_dir}", device=groups.device)
    info = CheckpointInfo(
        dtype=model_dtype_name(model) if model is not None else "", tp=groups.layout.tp, pp=groups.layout.pp,
        num_layers=desc.num_layers, vocab_size=desc.vocab_size,
        padded_vocab_size=pad_vocab_size(desc.vocab_size, groups.layout.tp),
        megatron_core=mcore_version, extra=dict(extra or {}, **adapter_info(model)))
    info_path = os.path.join(ckpt_dir, CHECKPOINT_INFO_FILE)
    error = None
    if dist.get_rank() == 0:
        if os.path.exists(info_path) or os.path.exists(os.path.join(ckpt_dir, ".metadata")):
            if overwrite:  # marker first: the directory is incomplete until rewritten
                for name in [CHECKPOINT_INFO_FILE, MANIFEST_FILE, ".metadata", "metadata.json", "common.pt"] + [
                        f for f in os.listdir(ckpt_dir) if f.endswith(".distcp")]:
                    if os.path.exists(os.path.join(ckpt_dir, name)):
                        os.remove(os.path.join(ckpt_dir, name))
                shutil.rmtree(os.path.join(ckpt_dir, PARTS_DIR), ignore_errors=True)
            else:
                error = f"{ckpt_dir} already holds a checkpoint; pass overwrite=True to replace it"
        if error is None:
            os.makedirs(ckpt_dir, exist_ok=True)
    if any_rank(error is not None, groups.device):
        raise CheckpointError(error or f"{ckpt_dir} cannot be saved (see rank 0's error)")
    with quiet_dist_checkpointing():
        dist_checkpointing.save({} if model is None else unwrap_model(model).sharded_state_dict(), ckpt_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        desc.save(ckpt_dir)
        if write_extra is not None:
            write_extra()
    dist.barrier()
    write_manifest(ckpt_dir, exclude=(CHECKPOINT_INFO_FILE,))  # collective: each rank hashes its files
    if dist.get_rank() == 0:
        write_json(info_path, asdict(info))
    dist.barrier()
    return info


def load_model_checkpoint(model: Optional[torch.nn.Module], ckpt_dir: str, groups: ParallelGroups,
                          desc: Optional[ModelDescription] = None, *, verify: bool = True) -> CheckpointInfo:
    """Load ``ckpt_dir`` into this rank's ``model`` (any layout); collective.

    ``desc`` (the model's description) is checked against the checkpoint's
    ``model.json`` first, so an architecture mismatch is reported by field name.
    ``verify``: check the files first (:func:`verify_model_checkpoint`); pass False only when
    the caller has just verified them. ``model=None``: this rank holds no part of it and joins
    the collectives with nothing to read.
    """
    info = read_checkpoint_info(ckpt_dir)
    ckpt_desc = read_description(ckpt_dir)
    if desc is not None:
        check_compatible(desc, ckpt_desc, ckpt_dir)
    if verify:
        verify_model_checkpoint(ckpt_dir, groups)
    module = unwrap_model(model) if model is not None else None
    check_adapter_checkpoint(info.extra, module, ckpt_dir)  # LoRA adapters: onto their own base only
    try:
        with quiet_dist_checkpointing():
            state = dist_checkpointing.load(module.sharded_state_dict() if module is not None else {}, ckpt_dir,
                                            strict=StrictHandling.RAISE_UNEXPECTED)
    except CheckpointingException as e:
        raise CheckpointError(f"cannot load {ckpt_dir} into this model: {e}") from None
    if module is not None:
        module.load_state_dict(state, strict=True)
        zero_vocab_padding(module, ckpt_desc.vocab_size, groups)
    check_finite({"model": module}, f"loading {ckpt_dir}", device=groups.device)
    return info


def load_model_from_checkpoint(
        ckpt_dir: str, groups: ParallelGroups, *, dtype: Optional[str] = None,
        spec: str = "auto", verify: bool = True) -> tuple[torch.nn.Module, ModelDescription, CheckpointInfo]:
    """Build this rank's model from the checkpoint's ``model.json`` and load it (after
    verifying its files: :func:`verify_model_checkpoint`; ``verify=False`` only when the
    caller just did).

    ``dtype`` defaults to the checkpoint's. Returns (model, description, info).
    """
    info = read_checkpoint_info(ckpt_dir)
    desc = read_description(ckpt_dir)
    if verify:
        verify_model_checkpoint(ckpt_dir, groups)  # before building: a damaged checkpoint fails fast
    saved = adapter_settings(info.extra)
    if saved is not None:  # LoRA adapters: their base, then the adapters, merged
        return _load_adapted(ckpt_dir, saved, groups, dtype or info.dtype, spec, verify, desc, info)
    model = build_model_for_loading(desc, groups, dtype=dtype or info.dtype, spec=spec)
    load_model_checkpoint(model, ckpt_dir, groups, desc, verify=False)
    return model, desc, info


def _load_adapted(ckpt_dir: str, saved: dict, groups: ParallelGroups, dtype: str, spec: str, verify: bool,
                  desc: ModelDescription, info: CheckpointInfo):
    """A LoRA checkpoint as a plain model: the base it references (checked against the recorded
    checksum), the adapters onto it, merged for good (:func:`hyflow.models.lora.merge_and_unload`)."""
    config = lora_config(saved)
    spec = lora_spec(spec, config)
    base_dir = find_base(saved.get("base", {}), ckpt_dir)
    if base_dir is None:  # a random initialisation
        model = build_model_for_loading(desc, groups, dtype=dtype, spec=spec)
        load_full_state_dict(model, random_full_state_dict(desc, saved["base"]["random_init_seed"]), desc, groups)
    elif is_hf_model(base_dir):  # a Hugging Face base read directly (actor.checkpoint an HF dir or .gguf)
        check_base(saved["base"], base_reference(base_dir, 0), ckpt_dir)
        model = build_model_for_loading(desc, groups, dtype=dtype, spec=spec)
        try:
            load_hf_weights(model, base_dir, desc, groups)
        except ConversionError as e:
            raise CheckpointError(f"the LoRA base of {ckpt_dir}: {e}") from None
    else:
        check_base(saved["base"], base_reference(base_dir, 0, manifest_location(base_dir)), ckpt_dir)
        model, _, _ = load_model_from_checkpoint(base_dir, groups, dtype=dtype, spec=spec, verify=verify)
    apply_lora(model, config, seed=0, trainable=saved.get("trained", ()), base=saved["base"])
    load_model_checkpoint(model, ckpt_dir, groups, desc, verify=False)
    return merge_and_unload(model), desc, info
