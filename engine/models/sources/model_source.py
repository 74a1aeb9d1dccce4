"""Open a source model: an HF directory or a ``.gguf`` file.

:func:`open_model_source` finds the config, the weights (safetensors, sharded or
not, preferred over ``pytorch_model.bin``) and the tokenizer files, and checks
the files are present and complete; no tensor data is read.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hyflow.config import ConfigError
from hyflow.models.description import ModelDescription
from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.source import WeightSource
from hyflow.models.hf_mapping import IGNORED_HF_TENSORS, description_from_hf_config, hf_parameter_shapes
from hyflow.models.sources.gguf_source import GGUFSource, is_gguf
from hyflow.models.sources.safetensors_source import find_safetensors
from hyflow.models.sources.torchbin_source import find_torch_bin

#: Files of an HF tokenizer (whichever exist are copied next to the checkpoint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"
DTYPE_CHOICES = ("auto", "fp32", "bf16")
CHECKPOINT_INFO = "hyflow_checkpoint.json"  # a hyflow checkpoint's marker (hyflow.checkpoint.model)


@dataclass
class ModelSource:
    """A model to convert.

    Attributes:
        path: the HF directory or ``.gguf`` file.
        format: ``hf`` or ``gguf``.
        config: HF ``config.json`` dict (built from metadata for GGUF).
        weights: the tensors by HF name.
        tokenizer_files: tokenizer files to copy (HF directories).
        generation_config: ``generation_config.json`` dict, if any.
    """

    path: str
    format: str
    config: dict[str, Any]
    weights: WeightSource
    tokenizer_files: list[str] = field(default_factory=list)
    generation_config: Optional[dict[str, Any]] = None

    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from config.json and generation_config.json, in order."""
        ids: list[int] = []
        for cfg in (self.config, self.generation_config or {}):
            eos = cfg.get("eos_token_id")
            for value in ([eos] if isinstance(eos, int) else list(eos or [])):
                if isinstance(value, int) and value not in ids:
                    ids.append(value)
        return ids

    def write_tokenizer(self, folder: str) -> bool:
        """Write the tokenizer into ``folder`` (created); False if the source has none.

        GGUF files embed their tokenizer; it is exported through transformers when
        installed (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``).
        """
        if self.format == "gguf":
            try:
                # optional dependency: transformers (tokenizers of HF folders only)
                from transformers import AutoTokenizer
            except ImportError:
                return False
            tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(self.path)),
                                                gguf_file=os.path.basename(self.path))
            tok.save_pretrained(folder)
            return True
        if not self.tokenizer_files:
            return False
        os.makedirs(folder, exist_ok=True)
        for path in self.tokenizer_files:
            shutil.copy2(path, os.path.join(folder, os.path.basename(path)))
        return True


def is_hf_model(path: str) -> bool:
    """An HF model directory (``config.json``, not a hyflow checkpoint) or a ``.gguf`` file."""
    if os.path.isfile(path):
        return path.endswith(".gguf")
    return os.path.isfile(os.path.join(path, "config.json")) and \
        not os.path.isfile(os.path.join(path, CHECKPOINT_INFO))


def hf_description(path: str) -> ModelDescription:
    """The architecture of the HF model at ``path`` (config.json or GGUF metadata), its EOS ids and
    its tokenizer (the directory itself, or the GGUF file). Reads headers only; raises
    :class:`~hyflow.models.sources.errors.ConversionError` naming the problem."""
    source = open_model_source(path)
    try:
        desc = description_from_hf_config(source.config)
    except ConfigError as e:
        raise ConversionError(f"{path}: {e}") from None
    desc.eos_token_ids = source.eos_token_ids()
    has_tokenizer = source.format == "gguf" or bool(source.tokenizer_files)
    desc.tokenizer = os.path.abspath(path) if has_tokenizer else None
    return desc


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    return data


def _open_hf_directory(path: str) -> ModelSource:
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ConversionError(f"{path} has no config.json; pass an HF model directory or a .gguf file")
    config = _read_json(config_path)
    weights = find_safetensors(path) or find_torch_bin(path)
    if weights is None:
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        hint = (f"; to convert a GGUF file pass it directly (--hf {os.path.join(path, ggufs[0])})"
                if ggufs else "")
        raise ConversionError(
            f"{path} has no weights: expected model.safetensors, model.safetensors.index.json, "
            f"pytorch_model.bin or pytorch_model.bin.index.json{hint}")
    tokenizer = [os.path.join(path, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
    gen_path = os.path.join(path, GENERATION_CONFIG)
    generation = _read_json(gen_path) if os.path.exists(gen_path) else None
    return ModelSource(path=path, format="hf", config=config, weights=weights,
                       tokenizer_files=tokenizer, generation_config=generation)


def open_model_source(path: str) -> ModelSource:
    """Open ``path`` (HF directory or ``.gguf`` file) and check its files."""
    if not os.path.exists(path):
        raise ConversionError(f"{path} does not exist")
    if os.path.isdir(path):
        return _open_hf_directory(path)
    if is_gguf(path):
        source = GGUFSource(path)
        return ModelSource(path=path, format="gguf", config=source.config, weights=source)
    raise ConversionError(f"{path} is neither an HF model directory nor a GGUF file")


def check_tensors(source: ModelSource, desc) -> None:
    """Every tensor the description needs exists with the right shape; nothing unexplained."""
    weights = source.weights
    expected = hf_parameter_shapes(desc)
    present = set(weights.names())
    missing = [n for n in expected if n not in present]
    if missing:
        raise ConversionError(
            f"{source.path}: {len(missing)} tensors that config.json implies are missing from the "
            f"weights ({weights.kind}), e.g. {missing[:3]}; the files are incomplete or do not "
            "match config.json")
    for name, shape in expected.items():
        got = weights.shape(name)
        if got != shape:
            raise ConversionError(
                f"{source.path}: tensor {name} has shape {list(got)} but config.json implies "
                f"{list(shape)}; the weights do not match the config")
        dtype = weights.dtype(name)
        if not dtype.is_floating_point:
            raise ConversionError(f"{source.path}: tensor {name} has dtype {dtype}; only float "
                                  "weights are converted (quantized HF checkpoints are not)")
    allowed = set(expected) | ({"lm_head.weight"} if desc.tied_embeddings else set())
    unexpected = sorted(n for n in present - allowed if not IGNORED_HF_TENSORS.match(n))
    if unexpected:
        raise ConversionError(
            f"{source.path}: {len(unexpected)} tensors are not described by config.json, e.g. "
            f"{unexpected[:3]}; the config and the weights disagree (or the model has parts "
            "hyflow does not support)")


def resolve_dtype(requested: str, source: ModelSource) -> str:
    """``auto`` -> bf16 for bf16 weights, fp32 otherwise (fp16 widens exactly)."""
    if requested not in DTYPE_CHOICES:
        raise ConversionError(f"--dtype {requested!r} is not one of {', '.join(DTYPE_CHOICES)}")
    if requested != "auto":
        return requested

    dtypes = {source.weights.dtype(n) for n in source.weights.names()}
    return "bf16" if dtypes == {torch.bfloat16} else "fp32"
