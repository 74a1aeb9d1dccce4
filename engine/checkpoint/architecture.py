"""The architecture a config gets from its checkpoint (a light module: no torch import, so a
config validates before anything heavy is loaded).

A job that starts from ``actor.checkpoint`` runs the architecture in the checkpoint's
``model.json``; the config's ``model:`` section is then only a fallback for tools that run where
the checkpoint is not (``hyflow plan`` on a laptop). :func:`adopt_checkpoint_architecture` puts
the checkpoint's architecture into the config, so ``hyflow config``, ``config.resolved.yaml``
and every check see what will run, and says so when a ``model:`` section disagreed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from hyflow.models.description import DESCRIPTION_FILE, ModelDescription, ModelDescriptionError
from hyflow.data.tasks import task_info
from hyflow.models.sources.model_source import hf_description, is_hf_model


def read_checkpoint_architecture(ckpt_dir: str) -> Optional[ModelDescription]:
    """``ckpt_dir``'s ``model.json`` (its relative tokenizer path made absolute), or None when
    the checkpoint is not on this machine. A malformed one raises :class:`ModelDescriptionError`.
    An HF model directory or ``.gguf`` file gives the architecture of its config."""
    if is_hf_model(ckpt_dir):
        try:
            return hf_description(ckpt_dir)
        except ValueError as e:  # ConversionError: a config hyflow cannot run
            raise ModelDescriptionError(str(e)) from None
    if not os.path.isfile(os.path.join(ckpt_dir, DESCRIPTION_FILE)):
        return None
    desc = ModelDescription.load(ckpt_dir)
    tok = desc.tokenizer
    if tok and tok != "char" and not os.path.isabs(tok):
        desc.tokenizer = os.path.abspath(os.path.join(ckpt_dir, tok))
    return desc


def differences(config_model: ModelDescription, ckpt_model: ModelDescription) -> list[str]:
    """``field: config X, checkpoint Y`` for every field that differs (the tokenizer path aside)."""
    out = []
    for f in dataclasses.fields(ModelDescription):
        if f.name == "tokenizer":
            continue
        a, b = getattr(config_model, f.name), getattr(ckpt_model, f.name)
        if a != b:
            out.append(f"{f.name}: config {a!r}, checkpoint {b!r}")
    return out


def adopt_model_tokenizer(data, model: ModelDescription) -> Optional[str]:
    """Without ``data.tokenizer`` (and a task that brings its own), the model's: sets it and returns
    a note, else None (verl's ``data.tokenizer: null`` takes the model path's tokenizer too)."""
    if data.tokenizer or not model.tokenizer:
        return None
    if getattr(data, "task", None):
        if task_info(data.task).tokenizer:
            return None
    data.tokenizer = model.tokenizer
    return f"data.tokenizer: the model's ({model.tokenizer})"


def adopt_checkpoint_architecture(ckpt_dir: str, model: ModelDescription,
                                  default: ModelDescription) -> tuple[ModelDescription, Optional[str]]:
    """(the architecture to run, a note or None): the checkpoint's when its ``model.json`` is
    here, else ``model``. The note says that a ``model:`` section (one that is not the schema's
    ``default``) disagrees with the checkpoint, and that the checkpoint wins."""
    try:
        ckpt_model = read_checkpoint_architecture(ckpt_dir)
    except ModelDescriptionError as e:
        return model, f"actor.checkpoint={ckpt_dir!r}: {e}; using the config's model section"
    if ckpt_model is None:
        return model, None
    diff = differences(model, ckpt_model)
    note = None
    if diff and model != default:
        note = (f"the config's model section differs from {os.path.join(ckpt_dir, DESCRIPTION_FILE)} "
                f"({'; '.join(diff)}): the checkpoint's architecture is used")
    return ckpt_model, note
