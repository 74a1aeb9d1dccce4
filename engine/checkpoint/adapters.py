"""Checkpoints of LoRA models: the adapters are saved, the frozen base is referenced.

An adapted model's ``sharded_state_dict`` holds its trained parameters only (the adapters, and e.g.
a critic's value head: :mod:`hyflow.models.lora`), so a step checkpoint's ``actor/`` and
``actor_optimizer/`` hold the adapters and their Adam state (a few MiB where the weights are GiB).
Its ``hyflow_checkpoint.json`` records, under ``extra.lora``, the adapters' settings, the trained
parameters besides the adapters, and the base (:func:`base_reference`): the base checkpoint's
absolute path and a checksum of its files (the SHA-256 of its manifest entries: their sizes and
digests, which loading the base verifies against the files), or the seed of a random
initialisation. A Hugging Face base (``actor.checkpoint`` an HF directory or a ``.gguf`` file, read
directly) carries no checksums; it is identified by its files' names and sizes (``hf_files``), since
hashing its contents on every rank at every start would read the whole model again. Whatever loads the adapters compares that reference with the base it has
(:func:`check_base`): adapters trained on other weights fail with one error naming both.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import torch

from hyflow.checkpoint.errors import CheckpointError
from hyflow.checkpoint.manifest import file_digest, manifest_entries, read_manifest
from hyflow.models.lora import LoRAModel, has_adapters, lora_config_of
from hyflow.models.lora_config import LoRAConfig
from hyflow.models.sources.model_source import is_hf_model

#: the key of ``CheckpointInfo.extra`` that marks an adapter checkpoint
LORA_KEY = "lora"


def base_checksum(root: str, prefix: str = "") -> str:
    """SHA-256 of a model checkpoint's files as its manifest lists them (``root``'s manifest,
    entries under ``prefix``: a model inside a step checkpoint); without a manifest, of the files
    themselves."""
    manifest = read_manifest(root)
    if manifest is not None:
        entries = {rel[len(prefix):]: entry for rel, entry in manifest_entries(root, manifest).items()
                   if rel.startswith(prefix)}
    else:
        base = os.path.join(root, prefix)
        entries = {rel: {"size": os.path.getsize(os.path.join(base, rel)),
                         "sha256": file_digest(os.path.join(base, rel))} for rel in list_files(base)}
    if not entries:
        raise CheckpointError(f"{os.path.join(root, prefix)} holds no files to reference as a LoRA base")
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def base_reference(checkpoint: Optional[str], seed: int, manifest_at: Optional[tuple[str, str]] = None) -> dict:
    """What an adapter checkpoint records about its base: ``{"checkpoint": abs path, "sha256": ...}``
    (``manifest_at``: the manifest's directory and the checkpoint's prefix in it,
    :func:`hyflow.checkpoint.model.manifest_location`), or ``{"random_init_seed": seed}``."""
    if not checkpoint:
        return {"random_init_seed": int(seed)}
    if is_hf_model(checkpoint):
        return {"checkpoint": os.path.abspath(checkpoint), "hf_files": _hf_files_digest(checkpoint)}
    root, prefix = manifest_at or (checkpoint, "")
    return {"checkpoint": os.path.abspath(checkpoint), "sha256": base_checksum(root, prefix)}


def list_files(root: str) -> list[str]:
    """The regular files under ``root``, as sorted relative POSIX paths."""
    return sorted(os.path.relpath(os.path.join(d, name), root).replace(os.sep, "/")
                  for d, _, names in os.walk(root) for name in names if os.path.isfile(os.path.join(d, name)))


def _hf_files_digest(path: str) -> str:
    """SHA-256 of the names and sizes of an HF model's files (a directory's, or one ``.gguf``)."""
    folder, names = (path, list_files(path)) if os.path.isdir(path) else \
        (os.path.dirname(os.path.abspath(path)), [os.path.basename(path)])
    files = {name: os.path.getsize(os.path.join(folder, name)) for name in names}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def adapter_info(model: Optional[torch.nn.Module]) -> dict[str, Any]:
    """``{"lora": {...}}`` for the ``CheckpointInfo.extra`` of an adapted model, else ``{}``."""
    config = lora_config_of(model) if model is not None else None
    if config is None:
        return {}
    inner = model
    while not isinstance(inner, LoRAModel):
        inner = inner.module
    trained = sorted(n for n in inner.trained_names() if ".lora_" not in n)
    return {LORA_KEY: {**config.to_dict(), "trained": trained, "base": dict(getattr(inner, "lora_base", {}))}}


def adapter_settings(extra: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The ``lora`` entry of a checkpoint's ``extra`` (None: a full model checkpoint)."""
    entry = (extra or {}).get(LORA_KEY)
    return entry if isinstance(entry, dict) else None


def lora_config(settings: dict[str, Any]) -> LoRAConfig:
    """The :class:`LoRAConfig` an adapter checkpoint was trained with."""
    config = LoRAConfig(**{k: settings[k] for k in ("rank", "alpha", "dropout", "targets")})
    config.validate()
    return config


def check_base(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Adapters recorded with base ``saved`` loaded onto base ``current``: one error when they differ."""
    if saved == current:
        return
    raise CheckpointError(
        f"{where} holds LoRA adapters trained on the base {_describe(saved)}, but this model's base is "
        f"{_describe(current)}: load them onto the base they were trained on (actor.checkpoint)")


def find_base(saved: dict[str, Any], where: str) -> Optional[str]:
    """The base an adapter checkpoint references (a checkpoint directory, an HF directory or a
    ``.gguf`` file; None: a random init), checked to exist."""
    path = saved.get("checkpoint")
    if path is None:
        return None
    if not os.path.exists(path):
        raise CheckpointError(f"{where} holds LoRA adapters whose base checkpoint {path} does not exist (moved or "
                              "deleted?): put the base back there, then load the adapters again")
    return path


def _describe(ref: dict[str, Any]) -> str:
    if "hf_files" in ref:
        return f"{ref['checkpoint']} (HF files' names and sizes sha256 {str(ref['hf_files'])[:12]}...)"
    if "checkpoint" in ref:
        return f"{ref['checkpoint']} (files sha256 {str(ref.get('sha256'))[:12]}...)"
    if "random_init_seed" in ref:
        return f"a random initialisation with seed {ref['random_init_seed']}"
    return "unrecorded"


def check_adapter_checkpoint(extra: dict[str, Any], module: Optional[torch.nn.Module], ckpt_dir: str) -> None:
    """Before loading ``ckpt_dir`` (its info's ``extra``) into ``module``: adapters go into an adapted
    model on the base they were trained on, a whole model into a plain one; one error otherwise."""
    if module is None:
        return
    saved, adapted = adapter_settings(extra), has_adapters(module)
    if saved is not None and not adapted:
        raise CheckpointError(
            f"{ckpt_dir} holds LoRA adapters (on the base {_describe(saved.get('base', {}))}), not a whole model: "
            "load it with hyflow generate / hyflow export (which load the base and merge), or resume it with the "
            "run's actor.lora set")
    if saved is None and adapted:
        raise CheckpointError(f"{ckpt_dir} holds a whole model, not LoRA adapters: it cannot resume a run with "
                              "LoRA set (start the LoRA run from it instead: actor.checkpoint)")
    if saved is not None:
        inner = module
        while not isinstance(inner, LoRAModel):
            inner = inner.module
        check_base(saved.get("base", {}), inner.lora_base, ckpt_dir)
