"""Safetensors weights: one ``model.safetensors`` or shards listed in ``*.index.json``.

Headers are parsed directly (a little-endian u64 length, then JSON), so names,
shapes and dtypes are known without touching tensor data, and a truncated or
missing shard is detected before conversion starts. Data is read with
``safetensors.safe_open`` (row / column slices read only the bytes they need);
files are opened per read and closed on :meth:`release`, so mapped pages never
pile up in the converter's resident memory.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Optional

import torch
from safetensors import safe_open

from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.source import WeightSource

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024


def read_header(path: str) -> dict[str, Any]:
    """Parse a safetensors header and check the file holds all the data it declares."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"{path} is truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ConversionError(f"{path} is truncated or not a safetensors file "
                                      f"(header of {n} bytes, file of {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} has a damaged safetensors header: {e}") from None
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise ConversionError(
            f"{path} is truncated: its header declares {8 + n + end} bytes, the file has {size} "
            "(an interrupted download or copy?)")
    return header


class SafetensorsSource(WeightSource):
    """Tensors of one or several safetensors files.

    Args:
        weight_map: tensor name -> file (every tensor of one file, or an index's ``weight_map``).
    """

    def __init__(self, weight_map: dict[str, str]) -> None:
        self._file_of = dict(weight_map)
        files = sorted(set(self._file_of.values()))
        self.kind = "safetensors" + (f" ({len(files)} shards)" if len(files) > 1 else "")
        self._headers: dict[str, dict[str, Any]] = {}
        for path in files:
            if not os.path.exists(path):
                raise ConversionError(f"weight file {path} (listed in the index) is missing")
            self._headers[path] = read_header(path)
        for name, path in self._file_of.items():
            if name not in self._headers[path]:
                raise ConversionError(f"the index maps {name} to {os.path.basename(path)}, "
                                      "which does not contain it")
        self._open: dict[str, Any] = {}

    @classmethod
    def from_file(cls, path: str) -> "SafetensorsSource":
        return cls({name: path for name in read_header(path)})

    @classmethod
    def from_index(cls, index_path: str) -> "SafetensorsSource":
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"{index_path} is not a valid safetensors index: {e}") from None
        folder = os.path.dirname(index_path)
        return cls({name: os.path.join(folder, file) for name, file in weight_map.items()})

    def _meta(self, name: str) -> dict[str, Any]:
        return self._headers[self._file_of[name]][name]

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._meta(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self._meta(name)["dtype"]
        if code not in DTYPES:
            raise ConversionError(f"{name} has dtype {code}, which the converter does not read")
        return DTYPES[code]

    def _slice(self, name: str):
        path = self._file_of[name]
        handle = self._open.get(path)
        if handle is None:
            handle = self._open[path] = safe_open(path, framework="pt")
        return handle.get_slice(name)

    def read(self, name: str) -> torch.Tensor:
        return self._slice(name)[:]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[start:stop]

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[:, start:stop].contiguous()

    def release(self) -> None:
        self._open.clear()  # safe_open handles unmap when dropped


def find_safetensors(folder: str) -> Optional[SafetensorsSource]:
    """The safetensors weights of an HF directory, or None if it has none."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        return SafetensorsSource.from_index(index)
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return SafetensorsSource.from_file(single)
    return None
