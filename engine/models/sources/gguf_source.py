"""GGUF (llama.cpp) files: metadata -> HF config, tensors -> dequantized HF tensors.

Facts of the format used here:

* tensor names: ``token_embd``, ``output_norm``, ``output`` (absent when the
  embeddings are tied), ``blk.N.{attn_norm, ffn_norm, attn_q, attn_k, attn_v,
  attn_output, ffn_gate, ffn_up, ffn_down}``;
* shapes are stored innermost-first (``[cols, rows]``); quantized data is stored
  row by row, so a row range dequantizes on its own;
* for ``llama`` files, llama.cpp's converter permuted the rows of ``attn_q`` /
  ``attn_k`` within each head (rotary pairs interleaved); the inverse is applied here.

Dequantization uses ``gguf.quants.dequantize`` (float32), as transformers does when
it loads a GGUF file, so both sides of a parity check see the same weights.
"""

from __future__ import annotations

import os
from typing import Any
import mmap

import torch

from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.source import WeightSource

_BLOCK_BYTES = 16 * 1024 * 1024  #: dequantize at most this much output at a time
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str:
    """HF tensor name of a GGUF tensor; ConversionError for tensors hyflow cannot use."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    if gguf_name == "rope_freqs.weight":
        raise ConversionError("this GGUF stores precomputed RoPE frequency factors (rope_freqs), "
                              "which the converter does not support; convert the HF checkpoint")
    raise ConversionError(f"GGUF tensor {gguf_name!r} has no HF Llama / Qwen2 equivalent")


def _open_reader(path: str):
    try:
        # optional dependency: gguf (GGUF files only)
        import gguf
    except ImportError:
        raise ConversionError("reading .gguf files needs the `gguf` package (pip install gguf)") from None
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - numpy raises ValueError / IndexError on short files
        raise ConversionError(f"{path} is truncated or not a GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def gguf_hf_config(reader, path: str) -> dict[str, Any]:
    """An HF ``config.json`` dict built from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConversionError(f"{path}: GGUF architecture {arch!r} is not supported; "
                              f"hyflow converts {', '.join(sorted(ARCHITECTURES))}")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensor_names = {t.name for t in reader.tensors}
    vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
    head_dim = key("attention.key_length") or (hidden // heads if hidden and heads else None)
    rotary = key("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ConversionError(f"{path}: partial rotary embeddings (rope.dimension_count={rotary}, "
                              f"head_dim={head_dim}) are not supported")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch][0]], "model_type": ARCHITECTURES[arch][1],
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "intermediate_size": key("feed_forward_length"),
        "max_position_embeddings": key("context_length", 4096), "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)), "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConversionError(f"{path}: GGUF rope scaling {scaling!r} is not supported (linear only)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    return cfg


class GGUFSource(WeightSource):
    """Dequantized float32 tensors of a GGUF file under their HF names.

    Row ranges dequantize only their own rows (for the permuted ``attn_q`` /
    ``attn_k`` when they cover whole heads, which is what the TP split asks for).
    :meth:`release` drops the file's pages from this process's resident set.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader = _open_reader(path)
        self.config = gguf_hf_config(self._reader, path)
        arch = _field(self._reader, "general.architecture")
        self._permute_qk = arch == "llama"
        self._tensors = {hf_name(t.name): t for t in self._reader.tensors}
        types = sorted({t.tensor_type.name for t in self._reader.tensors})
        self.kind = f"gguf ({', '.join(types)})"
        self._head_dim = int(self.config["head_dim"])
        # The parsed metadata (tokenizer vocabulary and merges: ~100k small arrays) is not
        # needed any more; drop it and the file pages it touched.
        self._reader.fields.clear()
        self.release()

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def _permuted(self, name: str) -> bool:
        return self._permute_qk and name.endswith(("q_proj.weight", "k_proj.weight"))

    def _dequantize(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` as float32, dequantized in blocks to bound temporaries."""
        # optional dependency: gguf (GGUF files only)
        from gguf.quants import dequantize

        t = self._tensors[name]
        shape = self.shape(name)
        if len(shape) == 1:
            return torch.tensor(dequantize(t.data, t.tensor_type), dtype=torch.float32)
        out = torch.empty((stop - start, *shape[1:]), dtype=torch.float32)
        step = max(1, _BLOCK_BYTES // (4 * max(1, out[0].numel())))
        for first in range(start, stop, step):
            last = min(first + step, stop)
            block = dequantize(t.data[first:last], t.tensor_type)
            if not block.flags.writeable:  # float32 data is a read-only view of the mapped file
                block = block.copy()
            out[first - start:last - start] = torch.from_numpy(block.reshape(last - first, *shape[1:]))
        if self._permuted(name):
            out = unpermute_rotary_rows(out, out.shape[0] // self._head_dim)
        return out

    def read(self, name: str) -> torch.Tensor:
        return self._dequantize(name, 0, self.shape(name)[0])

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        whole_heads = start % self._head_dim == 0 and stop % self._head_dim == 0
        if len(self.shape(name)) == 1 or (self._permuted(name) and not whole_heads):
            return self.read(name)[start:stop].clone()
        return self._dequantize(name, start, stop)

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.read(name)[:, start:stop].contiguous()

    def release(self) -> None:
        mapping = getattr(self._reader.data, "_mmap", None)
        if mapping is not None and hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED)


def unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of ``attn_q`` / ``attn_k``.

    llama.cpp stores, per head, rows ``(pair, half)`` where HF has ``(half, pair)``
    (rotate-half layout); reshaping to ``[heads, pairs, 2, ...]`` and swapping the
    last two row axes restores HF's order.
    """
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ConversionError(f"cannot unpermute a {tuple(weight.shape)} tensor over {heads} heads")
    rest = weight.shape[1:]
    return (weight.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2)
            .reshape(rows, *rest).contiguous())


def is_gguf(path: str) -> bool:
    """True for an existing file that starts with the GGUF magic."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
