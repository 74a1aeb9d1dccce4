"""``pytorch_model.bin`` weights (one file, or shards listed in ``*.bin.index.json``).

Files are opened with ``torch.load(mmap=True, weights_only=True)``: unpickling maps
the storages without reading them, so only the tensors (or slices) actually used
are paged in, and :meth:`release` unmaps everything between parameters.
Truncated zip archives are caught up front from their central directory. Legacy
(pre-zip) files cannot be mapped and are read whole.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Optional

import torch

from hyflow.models.sources.errors import ConversionError
from hyflow.models.sources.source import WeightSource


def _load(path: str) -> dict[str, torch.Tensor]:
    mmap = zipfile.is_zipfile(path)
    try:
        data = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for damaged files
        raise ConversionError(f"cannot read {path} ({type(e).__name__}: {e}); the file is "
                              "damaged or truncated") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ConversionError(f"{path} does not hold a state dict of tensors")
    return data


def _check_archive(path: str) -> None:
    if not os.path.exists(path):
        raise ConversionError(f"weight file {path} is missing")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic.startswith(b"PK"):  # a zip archive whose central directory (at the end) is gone
            raise ConversionError(f"{path} is truncated or damaged (its zip directory is missing)")
        if not magic.startswith(b"\x80\x02"):  # a legacy pickle starts with protocol 2
            raise ConversionError(f"{path} is truncated or not a PyTorch checkpoint")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            for item in archive.infolist():
                if item.header_offset + item.compress_size > os.path.getsize(path):
                    raise ConversionError(f"{path} is truncated ({item.filename} runs past the end)")
    except zipfile.BadZipFile as e:
        raise ConversionError(f"{path} is truncated or damaged: {e}") from None


class TorchBinSource(WeightSource):
    """Tensors of one or several ``pytorch_model*.bin`` files."""

    def __init__(self, files: list[str]) -> None:
        self.kind = "pytorch .bin" + (f" ({len(files)} shards)" if len(files) > 1 else "")
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._file_of: dict[str, str] = {}
        for path in files:
            _check_archive(path)
            for name, tensor in _load(path).items():
                self._meta[name] = (tuple(tensor.shape), tensor.dtype)
                self._file_of[name] = path
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def from_index(cls, index_path: str) -> "TorchBinSource":
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"{index_path} is not a valid weight index: {e}") from None
        folder = os.path.dirname(index_path)
        source = cls(sorted({os.path.join(folder, f) for f in weight_map.values()}))
        missing = sorted(set(weight_map) - set(source._file_of))
        if missing:
            raise ConversionError(f"{index_path} lists tensors its files do not contain, e.g. {missing[:3]}")
        return source

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def _tensor(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        if path not in self._loaded:
            self._loaded[path] = _load(path)
        return self._loaded[path][name]

    def read(self, name: str) -> torch.Tensor:
        return self._tensor(name).clone()

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._tensor(name)[start:stop].clone()

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._tensor(name)[:, start:stop].contiguous()

    def release(self) -> None:
        self._loaded.clear()


def find_torch_bin(folder: str) -> Optional[TorchBinSource]:
    """The ``.bin`` weights of an HF directory, or None if it has none."""
    index = os.path.join(folder, "pytorch_model.bin.index.json")
    if os.path.exists(index):
        return TorchBinSource.from_index(index)
    single = os.path.join(folder, "pytorch_model.bin")
    if os.path.exists(single):
        return TorchBinSource([single])
    return None


