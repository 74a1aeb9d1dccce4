"""``hyflow bench manifest``: what checkpoint checksums cost (hyflow.checkpoint.manifest).

Writes synthetic checkpoints of the given sizes (four ``.distcp`` shards of random bytes plus
small metadata files, as a 4-rank save leaves them) and times writing the manifest (hashing
every file) and verifying it, on one process; ``--dir`` adds an existing checkpoint (e.g. a
quickstart ``step_*`` directory, verified against its own manifest). Files are read from the page
cache (they were just written, as when a save hashes them): this measures the hash, not the
disk. A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from hyflow.checkpoint.manifest import MANIFEST_FILE, verify_manifest, write_manifest

DEFAULT_SIZES_MB = (2, 540, 1620)  # quickstart step; SmolLM2-135M fp32 weights; + Adam moments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=float, nargs="*", default=list(DEFAULT_SIZES_MB),
                        help="synthetic checkpoint sizes in MB (default: 2 = a quickstart step checkpoint, "
                             "540 = SmolLM2-135M weights in fp32, 1620 = with Adam moments)")
    parser.add_argument("--dir", action="append", default=[], help="also verify this checkpoint (repeatable)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (the median is reported)")


def _synthetic(root: str, size: int) -> None:
    os.makedirs(os.path.join(root, "actor"))
    shard = size // 4
    for rank in range(4):
        with open(os.path.join(root, "actor", f"__{rank}_0.distcp"), "wb") as f:
            left = shard
            while left:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
    for name in (".metadata", "common.pt", "metadata.json", "model.json"):
        with open(os.path.join(root, "actor", name), "wb") as f:
            f.write(os.urandom(4096))


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _size(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def run(args: argparse.Namespace) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="hyflow-bench-manifest-") as tmp:
        for mb in args.size_mb:
            root = os.path.join(tmp, f"ckpt_{mb:g}MB")
            _synthetic(root, int(mb * 1e6))
            size = _size(root)
            write_s = _median_s(lambda root=root: write_manifest(root), args.repeats)
            verify_s = _median_s(lambda root=root: verify_manifest(root, checksums=True), args.repeats)
            rows.append({"checkpoint": f"synthetic {mb:g} MB", "bytes": size, "write_s": write_s,
                         "verify_s": verify_s})
            for d, _, files in os.walk(root, topdown=False):
                for f in files:
                    os.remove(os.path.join(d, f))
    for path in args.dir:
        if not os.path.exists(os.path.join(path, MANIFEST_FILE)):
            print(f"hyflow bench manifest: {path} has no {MANIFEST_FILE}; skipped")
            continue
        size = _size(path) - os.path.getsize(os.path.join(path, MANIFEST_FILE))
        verify_s = _median_s(lambda path=path: verify_manifest(path, checksums=True), args.repeats)
        rows.append({"checkpoint": path, "bytes": size, "write_s": None, "verify_s": verify_s})
    print(f"{'checkpoint':40s} {'MB':>9s} {'hash+write s':>13s} {'verify s':>9s} {'verify MB/s':>12s}")
    for r in rows:
        r["verify_mb_s"] = r["bytes"] / 1e6 / r["verify_s"] if r["verify_s"] else None
        write = f"{r['write_s']:.3f}" if r["write_s"] is not None else "-"
        print(f"{r['checkpoint'][-40:]:40s} {r['bytes'] / 1e6:9.1f} {write:>13s} {r['verify_s']:9.3f} "
              f"{r['verify_mb_s']:12.0f}")
    print(json.dumps({"benchmark": "manifest", "algorithm": "sha256", "repeats": args.repeats, "rows": rows}))
    return 0
