"""No code runs from a checkpoint: the pickles inside a distributed checkpoint are checked
before torch or Megatron unpickle them.

A Megatron ``torch_dist`` checkpoint holds three kinds of pickle:

* ``.metadata``, torch DCP's tensor index, which ``FileSystemReader.read_metadata`` reads with
  plain ``pickle.load``;
* byte items inside the ``.distcp`` files (Megatron's ``ShardedObject`` s, e.g. each layer's
  ``_extra_state``), which DCP's load planner reads with ``torch.load(weights_only=False)``;
* ``common.pt`` and object shards ``*.pt``, read by Megatron with ``torch.load``'s default.

:func:`check_dcp_pickles` opens ``.metadata`` with an unpickler that resolves only the classes a
DCP index is made of (dataclasses of ``torch.distributed.checkpoint``, ``torch.Size``, dtypes)
and every other pickle with ``torch.load(weights_only=True)`` (tensors, numbers, strings and
containers only). A pickle that names anything else - ``os.system``, ``builtins.eval``, any
class - is refused before the real load, so the later unrestricted unpickling of the *same
bytes* can only build what was checked. The manifest (:mod:`hyflow.checkpoint.manifest`) makes
sure the bytes checked are the bytes that were written.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from hyflow.checkpoint.errors import CheckpointError

_DCP = "torch.distributed.checkpoint"
#: (module, name) pairs a torch DCP ``.metadata`` pickle may reference.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    *((f"{_DCP}.metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                         "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                         "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", n) for n in ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType",
                                        "LoadPlan", "ReadItem", "LoadItemType", "BytesIOWriteData")),
}


class _IndexUnpickler(pickle.Unpickler):
    """Resolves only :data:`_METADATA_GLOBALS` and torch dtypes."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.source} references {module}.{name}, which a torch checkpoint index never holds: "
            "refusing to read it (the file was tampered with or is not a checkpoint index). hyflow "
            "never runs code from a checkpoint.")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source} holds a persistent reference, which a torch checkpoint "
                              "index never holds: refusing to read it")


def read_dcp_index(ckpt_dir: str) -> Any:
    """The torch DCP ``Metadata`` of ``ckpt_dir``, unpickled with the restricted unpickler.
    Raises :class:`CheckpointError` for a missing, damaged or untrusted index."""
    path = os.path.join(ckpt_dir, ".metadata")
    if not os.path.exists(path):
        raise CheckpointError(f"{ckpt_dir} is incomplete: the tensor index .metadata is missing")
    try:
        with open(path, "rb") as f:
            return _IndexUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure means a damaged index
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e})") from None


def unpickling_detail(e: BaseException) -> str:
    """What a ``weights_only`` load error refused (``GLOBAL builtins.exec``), without torch's advice
    to allow-list it: a checkpoint is never trusted with code."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    line = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line),
                lines[0] if lines else type(e).__name__)
    match = re.search(r"GLOBAL (\S+)", line)
    if match:
        return f"it references {match.group(1)}"
    return re.split(r"\. Please use `torch\.serialization|Please use `torch\.serialization", line)[0].strip()


def check_plain_pickle(data: bytes, source: str) -> None:
    """Raise :class:`CheckpointError` unless ``data`` (a ``torch.save`` payload) loads with
    ``weights_only=True``: tensors, numbers, strings and containers only."""
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{source} holds Python objects other than tensors and plain data "
                              f"({unpickling_detail(e)}): refusing to load it; hyflow never runs code from a "
                              "checkpoint") from None
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{source} cannot be read ({type(e).__name__}: {e})") from None


def check_dcp_pickles(ckpt_dir: str) -> Any:
    """Check every pickle of the distributed checkpoint in ``ckpt_dir`` (see the module
    docstring); returns its DCP ``Metadata``. Raises :class:`CheckpointError`."""
    metadata = read_dcp_index(ckpt_dir)
    storage = getattr(metadata, "storage_data", None) or {}
    for fqn, item in (getattr(metadata, "state_dict_metadata", None) or {}).items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = storage.get(MetadataIndex(fqn))
        if info is None:
            raise CheckpointError(f"{ckpt_dir}/.metadata lists {fqn} without a storage location")
        where = f"{ckpt_dir}/{info.relative_path} (item {fqn})"
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} is stored with transforms {info.transform_descriptors}, which "
                                  "hyflow does not read")
        try:
            with open(os.path.join(ckpt_dir, info.relative_path), "rb") as f:
                f.seek(int(info.offset))
                data = f.read(int(info.length))
        except OSError as e:
            raise CheckpointError(f"{where} cannot be read: {e.strerror}") from None
        if len(data) != int(info.length):
            raise CheckpointError(f"{where} is truncated")
        check_plain_pickle(data, where)
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".pt"):
            with open(os.path.join(ckpt_dir, name), "rb") as f:
                check_plain_pickle(f.read(), os.path.join(ckpt_dir, name))
    return metadata
