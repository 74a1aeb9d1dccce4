"""A tiny model for checkpoint tests, and the rank function that resumes it (shared by the
checkpoint trust and checkpoint fault tests)."""

from __future__ import annotations

import os
import shutil

import torch

from hyflow.checkpoint.discovery import step_dir_name
from hyflow.checkpoint.errors import CheckpointError
from hyflow.models.description import ModelDescription
from hyflow.parallel.layout import Layout


def tiny_description():
    """One layer, hidden 16, vocabulary 16: a checkpoint of a few hundred KB."""
    return ModelDescription(family="llama", vocab_size=16, hidden_size=16, num_layers=1, num_attention_heads=2,
                            num_query_groups=1, ffn_hidden_size=32, max_position_embeddings=32)


def build_tiny(dp: int = 1):
    """``(groups, model)``: the tiny model on this rank's training groups (seeded: same weights each time)."""
    # Megatron (seconds) only when a test builds the model: importing this helper stays light
    from hyflow.models.builder import build_gpt_model
    from hyflow.parallel.groups import init_training_groups

    torch.manual_seed(0)
    groups = init_training_groups(Layout(dp=dp))
    return groups, build_gpt_model(tiny_description(), groups)


def resume_tiny(out: str, resume: str, no_verify: bool = False, dp: int = 1) -> dict:
    """Rank function: find and load what ``trainer.resume=<resume>`` names in run directory ``out``
    (``no_verify``: as ``--no-verify``) into the tiny model; report what happened: ``error``, its
    ``type`` and ``tensor`` (a non-finite one), the resume ``warnings``, the ``path`` and ``job`` state."""
    # Megatron (seconds) only when a test builds the model: importing this helper stays light
    from hyflow.checkpoint.checkpointer import Checkpointer, TrainedModel

    if no_verify:
        os.environ["HYFLOW_NO_VERIFY"] = "1"  # the multirank pool restores the environment after the task
    groups, model = build_tiny(dp)
    ckpt = Checkpointer(out, groups, tiny_description(), log=lambda m: None)
    warnings: list[str] = []
    try:
        path = ckpt.find_resume(resume, warnings.append)
        state = ckpt.load(path, {"actor": TrainedModel([model])}) if path else None
    except CheckpointError as e:
        return {"error": str(e), "type": type(e).__name__, "tensor": getattr(e, "tensor", None), "warnings": warnings}
    return {"error": None, "path": path, "job": state and state["job"], "warnings": warnings}


def fresh_copy(saved, tmp_path):
    """A copy of the run directory ``saved`` (a module's fixture) under ``tmp_path``, for one test to damage."""
    target = tmp_path / "run"
    shutil.copytree(saved, target)
    return target


def step_path(run, step: int):
    """The checkpoint directory of ``step`` in run directory ``run`` (a Path)."""
    return run / "checkpoints" / step_dir_name(step)
