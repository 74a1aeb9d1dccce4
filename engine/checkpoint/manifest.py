"""Checksums of every file in a checkpoint: written before its completion marker, checked before
anything in it is read.

A manifest lists each file (path relative to the checkpoint directory) with its size and SHA-256.
SHA-256 because it is the fastest strong hash in the standard library where the CPU has SHA
instructions (every AMD EPYC, Intel since Ice Lake; about 1.5 GB/s per core here, twice blake2b);
it is written into the manifest, so another algorithm can follow.

It is written in parts, one per saving rank, so that a save costs each rank only its own files:
rank ``r > 0`` hashes the files it wrote itself (``<dir>/__<r>_<n>.distcp`` and
``<dir>/rank_<r>.pt`` in the checkpoint or one of its folders) while they are still in its page
cache and writes ``manifest.parts/rank_<r>.json``; a scalar all-reduce tells rank 0 that every
part is on disk; rank 0 then writes ``manifest.json`` with the other files (the metadata and its
own shards) and the number of parts. No file list or hash crosses the network.

Verifying reads the parts: part ``p`` is checked by rank ``p mod ranks`` (the one that wrote it
when the layout is unchanged), so it costs about ``size / ranks`` per rank, and the ranks agree
on the first problem with scalar all-reduces. Every listed path must stay inside the checkpoint
and be a regular file (no ``..``, no symlink, no device), its size is compared before it is
hashed, and every file in the checkpoint must be listed (a file the manifest does not know is
refused: torch reads any file ``.metadata`` names). Without a process group (``hyflow export``,
the pre-flight check, tests) one process does everything.

A checkpoint without a manifest is refused (:class:`ManifestMissing`) unless verification is off:
``--no-verify`` (``HYFLOW_NO_VERIFY=1``) or ``trainer.verify_checkpoints=false``, which also
skip the checksums (sizes, presence and paths are still checked).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from hyflow.checkpoint.errors import CheckpointDamaged, CheckpointError
from hyflow.checkpoint.files import read_json, write_json

MANIFEST_FILE = "manifest.json"
PARTS_DIR = "manifest.parts"
MANIFEST_FORMAT = "hyflow-manifest"
MANIFEST_VERSION = 2
ALGORITHM = "sha256"
NO_VERIFY_ENV = "HYFLOW_NO_VERIFY"
_CHUNK = 8 << 20
_DISTCP = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_RANK_FILE = re.compile(r"^rank_(\d+)\.pt$")
#: Files a version-1 manifest (one file, no parts) leaves out: the markers written after it.
_V1_UNLISTED = ("COMPLETE", "hyflow_checkpoint.json")
#: Problem kinds, in the order the collective check encodes them (earlier = reported first).
_REASONS = ("outside", "not-a-file", "missing", "size", "checksum", "part", "unlisted")
_FILES_PER_PART = 1 << 24


class ManifestMissing(CheckpointError):
    """A checkpoint without ``manifest.json`` while verification is on (not damage: it is not set aside)."""


def verification_enabled() -> bool:
    """False when ``HYFLOW_NO_VERIFY`` is set (``--no-verify``, ``trainer.verify_checkpoints=false``)."""
    return os.environ.get(NO_VERIFY_ENV, "").lower() not in ("1", "true", "yes")


def apply_verify_setting(cfg: Any) -> None:
    """``trainer.verify_checkpoints=false`` as ``HYFLOW_NO_VERIFY=1`` (ranks inherit the environment)."""
    if getattr(getattr(cfg, "trainer", None), "verify_checkpoints", True) is False:
        os.environ[NO_VERIFY_ENV] = "1"


def file_digest(path: str, algorithm: str = ALGORITHM) -> str:
    """Hex digest of a file (read in 8 MiB chunks; hashlib releases the GIL while hashing)."""
    h = hashlib.new(algorithm)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _dist(group: Any = None):
    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(group), dist.get_world_size(group)
    return None, 0, 1


def _part_path(root: str, part: int) -> str:
    return os.path.join(root, PARTS_DIR, f"rank_{part:05d}.json")


def _owner(rel: str, parts: int) -> int:
    """The part a file belongs in: its writer ``r`` for ``[<dir>/]__<r>_<n>.distcp`` and
    ``[<dir>/]rank_<r>.pt`` (canonical names, at most one folder deep, ``0 < r < parts``), else 0."""
    pieces = rel.split("/")
    if len(pieces) <= 2:
        name = pieces[-1]
        m = _DISTCP.match(name)
        if m and name == f"__{int(m.group(1))}_{int(m.group(2))}.distcp":
            rank = int(m.group(1))
        else:
            m = _RANK_FILE.match(name)
            rank = int(m.group(1)) if m and name == f"rank_{int(m.group(1)):05d}.pt" else 0
        if 0 < rank < parts:
            return rank
    return 0


def _own_files(root: str, rank: int) -> list[str]:
    """Rank ``rank``'s files (see :func:`_owner`), found without listing other ranks' files:
    Megatron numbers a rank's ``.distcp`` files from 0 without gaps."""
    dirs = [""] + sorted(e.name + "/" for e in os.scandir(root) if e.is_dir(follow_symlinks=False)
                         and e.name != PARTS_DIR)
    out = []
    for d in dirs:
        n = 0
        while os.path.isfile(os.path.join(root, d, f"__{rank}_{n}.distcp")):
            out.append(f"{d}__{rank}_{n}.distcp")
            n += 1
        if os.path.isfile(os.path.join(root, d, f"rank_{rank:05d}.pt")):
            out.append(f"{d}rank_{rank:05d}.pt")
    return out


def _walk(root: str, prefix: str = "") -> Iterable[str]:
    """Every entry under ``root/prefix`` that is not a directory (symlinks and special files
    included), as relative POSIX paths; symlinked directories are not followed."""
    top = os.path.join(root, prefix) if prefix else root
    if not os.path.isdir(top):
        return
    todo = [top]
    while todo:
        d = todo.pop()
        with os.scandir(d) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                else:
                    yield os.path.relpath(e.path, root).replace(os.sep, "/")


def _rank0_files(root: str, parts: int, unlisted: Iterable[str]) -> list[str]:
    skip = set(unlisted) | {MANIFEST_FILE}
    return sorted(rel for rel in _walk(root) if rel not in skip and not rel.startswith(PARTS_DIR + "/")
                  and _owner(rel, parts) == 0)


def _entry(path: str) -> dict:
    return {"size": os.path.getsize(path), ALGORITHM: file_digest(path)}


def write_manifest(root: str, exclude: Iterable[str] = (), group: Any = None) -> dict:
    """Hash every file under ``root`` and write the manifest (collective over ``group`` when a
    process group exists: each rank hashes and writes its own files' part; see the module
    docstring). ``exclude``: relative paths left out (markers written after the manifest). Call
    it when every file is written and before the completion marker. Returns the manifest on
    rank 0 (its own entries; the other ranks' are in their parts), ``{}`` elsewhere."""
    dist, rank, parts = _dist(group)
    exclude = sorted(set(exclude))
    failure: Optional[BaseException] = None
    files: dict[str, dict] = {}
    try:
        if rank == 0:
            for path in (os.path.join(root, MANIFEST_FILE),):  # an older manifest of a rewritten directory
                if os.path.exists(path):
                    os.remove(path)
            _remove_stale_parts(root, parts)
            rels = _rank0_files(root, parts, exclude)
        else:
            rels = _own_files(root, rank)
        files = {rel: _entry(os.path.join(root, rel)) for rel in rels}
        if rank > 0:
            os.makedirs(os.path.join(root, PARTS_DIR), exist_ok=True)
            write_json(_part_path(root, rank), {"format": MANIFEST_FORMAT + "-part", "version": MANIFEST_VERSION,
                                                "part": rank, "algorithm": ALGORITHM, "files": files})
    except OSError as e:
        failure = e
    if dist is not None and parts > 1:  # every part is on disk (or some rank failed): one scalar
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        if device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([0 if failure is None else rank + 1], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = int(flag.item()) - 1
        if failure is not None:
            raise failure
        if failed >= 0:
            raise CheckpointError(f"rank {failed} could not write its part of {root}/{MANIFEST_FILE} (see its error)")
    elif failure is not None:
        raise failure
    if rank != 0:
        return {}
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "algorithm": ALGORITHM, "parts": parts,
                "unlisted": exclude, "files": files}
    write_json(os.path.join(root, MANIFEST_FILE), manifest)
    return manifest


def _remove_stale_parts(root: str, parts: int) -> None:
    """Parts a save with more ranks left in a directory that is being rewritten."""
    folder = os.path.join(root, PARTS_DIR)
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        m = re.match(r"^rank_(\d+)\.json$", name)
        if m and int(m.group(1)) >= parts:
            os.remove(os.path.join(folder, name))


def read_manifest(root: str) -> Optional[dict]:
    """``root``'s ``manifest.json`` (version 1: every file; version 2: rank 0's files and the
    number of parts), or None when it has none."""
    path = os.path.join(root, MANIFEST_FILE)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path) or os.path.islink(path):
        raise CheckpointDamaged(f"{path} is not a regular file", root, MANIFEST_FILE, "unreadable")
    data = read_json(path, root)
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), dict):
        raise CheckpointDamaged(f"{path} is not a hyflow manifest", root, MANIFEST_FILE, "unreadable")
    try:
        version, parts = int(data.get("version", 0)), int(data.get("parts", 1))
    except (TypeError, ValueError):
        raise CheckpointDamaged(f"{path} is not a hyflow manifest (version / parts)", root, MANIFEST_FILE,
                                "unreadable") from None
    if version > MANIFEST_VERSION or data.get("algorithm") not in hashlib.algorithms_available:
        raise CheckpointDamaged(f"{path}: manifest version {data.get('version')} / algorithm "
                                f"{data.get('algorithm')!r} is newer than this hyflow reads; upgrade hyflow",
                                root, MANIFEST_FILE, "unreadable")
    if parts < 1 or parts >= 1 << 20 or not isinstance(data.get("unlisted", []), list):
        raise CheckpointDamaged(f"{path} is not a hyflow manifest (parts {parts})", root, MANIFEST_FILE, "unreadable")
    data["parts"] = parts
    data.setdefault("unlisted", list(_V1_UNLISTED) if version < 2 else [])
    return data


def _read_part(root: str, manifest: dict, part: int) -> Optional[dict]:
    """Part ``part``'s ``files`` (part 0: the manifest's own), or None when it is missing or damaged."""
    if part == 0:
        return manifest["files"]
    path = _part_path(root, part)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None
        data = read_json(path, root)
    except (OSError, CheckpointError):
        return None
    if not isinstance(data, dict) or data.get("part") != part or not isinstance(data.get("files"), dict):
        return None
    return data["files"]


def manifest_entries(root: str, manifest: dict) -> dict:
    """Every file's entry of ``root``'s ``manifest`` (:func:`read_manifest`), its parts merged; a
    missing or damaged part raises :class:`CheckpointDamaged`. Reads every part: for a caller that
    needs the whole list once (a LoRA base's checksum), not for the per-rank verification."""
    files: dict = {}
    for part in range(manifest["parts"]):
        entries = _read_part(root, manifest, part)
        if entries is None:
            rel = os.path.relpath(_part_path(root, part), root).replace(os.sep, "/")
            raise CheckpointDamaged(f"{os.path.join(root, rel)} is missing or damaged", root, rel, "unreadable")
        files.update(entries)
    return files


def _confined(root: str, rel: str) -> bool:
    """``rel`` is a plain relative path that resolves inside ``root``."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    if any(piece in ("", ".", "..") for piece in rel.split("/")):
        return False
    real_root = os.path.realpath(root)
    folder = os.path.realpath(os.path.join(root, os.path.dirname(rel)))
    return folder == real_root or folder.startswith(real_root + os.sep)


def _check(root: str, rel: str, entry: Any, algorithm: str, checksums: bool, part: int, parts: int) -> Optional[str]:
    """The problem of one listed file (a :data:`_REASONS` entry) or None. The path is checked
    before anything is opened, the size before anything is read."""
    if not _confined(root, rel) or _owner(rel, parts) != part or not isinstance(entry, dict):
        return "outside"
    try:
        st = os.lstat(os.path.join(root, rel))
    except OSError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return "not-a-file"
    try:
        if st.st_size != int(entry.get("size", -1)):
            return "size"
    except (TypeError, ValueError):
        return "size"
    if checksums and file_digest(os.path.join(root, rel), algorithm) != entry.get(algorithm):
        return "checksum"
    return None


def damage_message(root: str, rel: str, reason: str) -> str:
    """The sentence naming a damaged file."""
    path = os.path.join(root, rel)
    return {
        "outside": f"{MANIFEST_FILE} of {root} lists {rel!r}, which is not a file path inside the checkpoint "
                   "(or not one this part may list): refusing to read it",
        "not-a-file": f"{path} is not a regular file (a symlink, directory or device where "
                      f"{MANIFEST_FILE} lists a file): refusing to read it",
        "missing": f"{path} is missing (listed in {MANIFEST_FILE})",
        "size": f"{path} does not have the size it was written with (truncated or partly copied?)",
        "checksum": f"{path} does not match its checksum in {MANIFEST_FILE} (changed after it was "
                    "written: disk, transfer or storage damage)",
        "part": f"{path} (a part of {root}/{MANIFEST_FILE}) is missing or unreadable",
        "unlisted": f"{path} is not listed in {MANIFEST_FILE}: refusing a checkpoint holding files it was not "
                    "written with (remove the file if you added it)",
    }[reason]


def _key(part: int, index: int, reason: str) -> int:
    return (part * _FILES_PER_PART + index) * len(_REASONS) + _REASONS.index(reason)


def _check_parts(root: str, manifest: dict, mine: Iterable[int], prefix: str,
                 checksums: bool) -> tuple[Optional[int], int]:
    """(first problem key among parts ``mine``, files they list under ``prefix``)."""
    algorithm, parts = manifest["algorithm"], manifest["parts"]
    listed = 0
    for part in mine:
        files = _read_part(root, manifest, part)
        if files is None:
            return _key(part, 0, "part"), listed
        rels = sorted(rel for rel in files if isinstance(rel, str) and rel.startswith(prefix))
        listed += len(rels)
        for i, rel in enumerate(rels):
            problem = _check(root, rel, files[rel], algorithm, checksums, part, parts)
            if problem:
                return _key(part, i, problem), listed
    return None, listed


def _on_disk(root: str, manifest: dict, prefix: str) -> list[str]:
    """The entries under ``prefix`` a complete manifest must list."""
    skip = set(manifest["unlisted"]) | {MANIFEST_FILE}
    skip |= {f"{PARTS_DIR}/rank_{p:05d}.json" for p in range(1, manifest["parts"])}
    return sorted(rel for rel in _walk(root, prefix) if rel not in skip)


def _first_unlisted(root: str, manifest: dict, prefix: str) -> str:
    """The first file under ``prefix`` that no part lists (the error path: reads every part)."""
    listed: set[str] = set()
    for part in range(manifest["parts"]):
        listed |= set(_read_part(root, manifest, part) or {})
    return next((rel for rel in _on_disk(root, manifest, prefix) if rel not in listed), "?")


def _raise(root: str, manifest: dict, key: int, rank: int, prefix: str) -> None:
    reason = _REASONS[key % len(_REASONS)]
    part, index = divmod(key // len(_REASONS), _FILES_PER_PART)
    if reason == "unlisted":
        rel = _first_unlisted(root, manifest, prefix) if rank == 0 else None
        if rel is None:
            raise CheckpointDamaged(f"{root} holds a file not listed in {MANIFEST_FILE} (named on rank 0)", root,
                                    None, reason)
        raise CheckpointDamaged(damage_message(root, rel, reason), root, rel, reason)
    if reason == "part":
        rel = os.path.relpath(_part_path(root, part), root)
        raise CheckpointDamaged(damage_message(root, rel, reason), root, rel, "unreadable")
    files = _read_part(root, manifest, part) or {}
    rels = sorted(r for r in files if isinstance(r, str) and r.startswith(prefix))
    rel = rels[index] if index < len(rels) else "?"
    raise CheckpointDamaged(damage_message(root, rel, reason), root, rel, reason)


def verify_manifest(root: str, prefix: str = "", group: Any = None, device: Any = None,
                    checksums: Optional[bool] = None, collective: bool = True) -> Optional[dict]:
    """Check the files of ``root`` (only those under ``prefix``, e.g. ``actor/``) against its
    manifest: paths, sizes, checksums, and that no file is unlisted; collective over ``group``
    when a process group exists and ``collective`` (see the module docstring).

    Raises :class:`CheckpointDamaged` naming the first problem (on every rank), or
    :class:`ManifestMissing` when ``root`` has no manifest while verification is on. Returns
    the manifest, or None when there is none and verification is off (nothing could be checked).
    ``checksums`` defaults to :func:`verification_enabled`; paths and sizes are always checked.
    """
    enabled = verification_enabled()
    checksums = enabled if checksums is None else checksums
    manifest = read_manifest(root)
    dist, rank, world = _dist(group) if collective else (None, 0, 1)
    if manifest is None:
        if enabled:
            raise ManifestMissing(f"{root} has no {MANIFEST_FILE}, so its files cannot be checked for damage or "
                                  "tampering: refusing to load it (written by an older hyflow, or the manifest was "
                                  "removed). Pass --no-verify (trainer.verify_checkpoints=false) to load it anyway")
        return None
    parts = manifest["parts"]
    first, listed = _check_parts(root, manifest, range(rank, parts, world), prefix, checksums)
    if dist is not None and world > 1:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
                else "cpu"
        count = torch.tensor([listed], dtype=torch.int64, device=device)
        dist.all_reduce(count, group=group)
        listed = int(count.item())
    none = _key(parts + 1, 0, "outside")
    if rank == 0 and first is None and len(_on_disk(root, manifest, prefix)) > listed:
        first = _key(parts, 0, "unlisted")
    if dist is not None and world > 1:
        value = torch.tensor([none if first is None else first], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        first = None if int(value.item()) == none else int(value.item())
    if first is not None:
        _raise(root, manifest, first, rank, prefix)
    return manifest


def sizes_match(root: str, prefix: str = "", all_parts: bool = True) -> Optional[dict]:
    """Paths, presence and sizes only, on this process alone (no hashing, no process group):
    what a pre-flight check can afford. ``all_parts=False`` checks only ``manifest.json``'s own
    entries (each rank of a job calls this; the collective :func:`verify_manifest` reads the
    parts). Raises :class:`CheckpointDamaged`; returns the manifest or None (no manifest: the
    loader's :func:`verify_manifest` decides)."""
    manifest = read_manifest(root)
    if manifest is None:
        return None
    mine = range(manifest["parts"]) if all_parts else range(1)
    first, _ = _check_parts(root, manifest, mine, prefix, checksums=False)
    if first is not None:
        _raise(root, manifest, first, 0, prefix)
    return manifest
