"""Checksums of every file in a checkpoint: written before its completion marker, checked before
anything in it is read.

``manifest.json`` lists each file (path relative to the checkpoint directory) with its size and
SHA-256. SHA-256 because it is the fastest strong hash in the standard library where the CPU has
SHA instructions (every AMD EPYC, Intel since Ice Lake; about 1.5 GB/s per core here, twice
blake2b); it is written into the manifest, so another algorithm can follow.

Both directions are collective and split the work over the ranks: when saving, each rank hashes
the files it wrote itself (``__<rank>_<n>.distcp``, ``rng/rank_<rank>.pt``; rank 0 also the small
metadata files) while they are still in its page cache, and rank 0 writes the manifest (rank 0
lists the directory and sends each rank the names of its own files; each rank sends back their
entries: a rank other than 0 handles O(files it wrote), whatever the world size); when
verifying, each rank checks a share of the files and the ranks agree on the first damaged one,
so verifying a checkpoint costs ``size / ranks`` per rank. Without a process group (``hyflow
export``, tests) one process does everything.

Set ``HYFLOW_NO_VERIFY=1`` (``--no-verify`` on the command line) to skip the checksums; sizes
and presence are still checked.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Iterable, Optional, Sequence

from hyflow.checkpoint.errors import CheckpointDamaged
from hyflow.checkpoint.files import read_json, write_json

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "hyflow-manifest"
MANIFEST_VERSION = 1
ALGORITHM = "sha256"
NO_VERIFY_ENV = "HYFLOW_NO_VERIFY"
_CHUNK = 8 << 20
_WRITER = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")
#: Problem kinds, in the order the collective check encodes them.
_REASONS = ("missing", "size", "checksum")


def verification_enabled() -> bool:
    """False when ``HYFLOW_NO_VERIFY`` is set (``--no-verify``)."""
    return os.environ.get(NO_VERIFY_ENV, "").lower() not in ("1", "true", "yes")


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


def list_files(root: str, exclude: Iterable[str] = ()) -> list[str]:
    """Every file under ``root`` as a sorted relative POSIX path, except ``exclude`` (relative
    paths: the manifest and the completion markers) and leftovers of interrupted atomic writes."""
    skip = set(exclude) | {MANIFEST_FILE}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel not in skip and ".tmp" not in name:
                out.append(rel)
    return sorted(out)


def _owner(rel: str, world: int) -> int:
    """The rank that hashes / checks ``rel``: its writer when the name says, else rank 0."""
    match = _WRITER.search(rel)
    if match:
        rank = int(match.group(1) or match.group(2))
        if rank < world:
            return rank
    return 0


def _share(rels: Sequence[str], rank: int, world: int) -> list[int]:
    """Indices of ``rels`` this rank verifies, round robin (any rank may read any file; the load
    after it reads them all anyway)."""
    return list(range(rank, len(rels), world))


def _dist(group: Any = None):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(group), dist.get_world_size(group)
    return None, 0, 1


def write_manifest(root: str, exclude: Iterable[str] = (), group: Any = None) -> dict:
    """Hash every file under ``root`` (collective over ``group`` when a process group exists)
    and write ``root/manifest.json`` on rank 0. Call it when every file is written and before
    the completion marker. Returns the manifest on rank 0, ``{}`` elsewhere."""
    dist, rank, world = _dist(group)
    files: list[str] = list_files(root, exclude) if rank == 0 else []
    shares: list[list[str]] = [[] for _ in range(world)] if rank == 0 else []
    for rel in files:
        shares[_owner(rel, world)].append(rel)
    mine_rels = [shares[0] if rank == 0 else None]
    if dist is not None and world > 1:
        # each rank receives the names of its own files only (O(files it wrote), not the whole list)
        dist.scatter_object_list(mine_rels, shares if rank == 0 else None,
                                 src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    mine = {rel: _entry(os.path.join(root, rel)) for rel in mine_rels[0]}  # type: ignore[union-attr]
    parts = [mine]
    if dist is not None and world > 1:
        parts = [None] * world if rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, parts, dst=dist.get_global_rank(group, 0) if group is not None else 0,
                           group=group)
    if rank != 0:
        return {}
    entries: dict[str, dict] = {}
    for part in parts:
        entries.update(part or {})
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "algorithm": ALGORITHM,
                "files": {rel: entries[rel] for rel in files}}
    write_json(os.path.join(root, MANIFEST_FILE), manifest)
    return manifest


def _entry(path: str) -> dict:
    return {"size": os.path.getsize(path), ALGORITHM: file_digest(path)}


def read_manifest(root: str) -> Optional[dict]:
    """``root``'s manifest, or None when it has none (written by a hyflow without manifests)."""
    path = os.path.join(root, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    data = read_json(path, root)
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), dict):
        raise CheckpointDamaged(f"{path} is not a hyflow manifest", root, MANIFEST_FILE, "unreadable")
    if int(data.get("version", 0)) > MANIFEST_VERSION or data.get("algorithm") not in hashlib.algorithms_available:
        raise CheckpointDamaged(f"{path}: manifest version {data.get('version')} / algorithm "
                                f"{data.get('algorithm')!r} is newer than this hyflow reads; upgrade hyflow",
                                root, MANIFEST_FILE, "unreadable")
    return data


def _check(root: str, rel: str, entry: dict, algorithm: str, checksums: bool) -> Optional[str]:
    """The problem of one file (a :data:`_REASONS` entry) or None."""
    path = os.path.join(root, rel)
    try:
        size = os.path.getsize(path)
    except OSError:
        return "missing"
    if size != int(entry.get("size", -1)):
        return "size"
    if checksums and file_digest(path, algorithm) != entry.get(algorithm):
        return "checksum"
    return None


def damage_message(root: str, rel: str, reason: str) -> str:
    """The sentence naming a damaged file."""
    path = os.path.join(root, rel)
    return {
        "missing": f"{path} is missing (listed in {MANIFEST_FILE})",
        "size": f"{path} does not have the size it was written with (truncated or partly copied?)",
        "checksum": f"{path} does not match its checksum in {MANIFEST_FILE} (changed after it was "
                    "written: disk, transfer or storage damage)",
    }[reason]


def verify_manifest(root: str, prefix: str = "", group: Any = None, device: Any = None,
                    checksums: Optional[bool] = None) -> Optional[dict]:
    """Check the files of ``root``'s manifest (only those under ``prefix``, e.g. ``actor/``)
    against their sizes and checksums; collective over ``group`` when a process group exists.

    Raises :class:`CheckpointDamaged` naming the first damaged file (the same on every rank).
    Returns the manifest, or None when ``root`` has none (nothing could be checked).
    ``checksums`` defaults to :func:`verification_enabled`; sizes are always checked.
    """
    manifest = read_manifest(root)
    if manifest is None:
        return None
    checksums = verification_enabled() if checksums is None else checksums
    algorithm = manifest["algorithm"]
    rels = [rel for rel in manifest["files"] if rel.startswith(prefix)]
    dist, rank, world = _dist(group)
    first = len(rels) * len(_REASONS)  # "no problem"
    for i in _share(rels, rank, world):
        problem = _check(root, rels[i], manifest["files"][rels[i]], algorithm, checksums)
        if problem:
            first = i * len(_REASONS) + _REASONS.index(problem)
            break
    if dist is not None and world > 1:
        import torch

        if device is None:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        value = torch.tensor([first], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        first = int(value.item())
    if first < len(rels) * len(_REASONS):
        rel, reason = rels[first // len(_REASONS)], _REASONS[first % len(_REASONS)]
        raise CheckpointDamaged(damage_message(root, rel, reason), root, rel, reason)
    return manifest


def sizes_match(root: str, prefix: str = "") -> Optional[dict]:
    """Presence and sizes only, on this process alone (no reading, no process group): what a
    pre-flight check can afford. Raises :class:`CheckpointDamaged`; returns the manifest or None."""
    manifest = read_manifest(root)
    if manifest is None:
        return None
    for rel, entry in manifest["files"].items():
        if rel.startswith(prefix):
            problem = _check(root, rel, entry, manifest["algorithm"], checksums=False)
            if problem:
                raise CheckpointDamaged(damage_message(root, rel, problem), root, rel, problem)
    return manifest
