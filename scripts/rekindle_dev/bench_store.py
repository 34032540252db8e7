"""The object store pull: verified into a node cache vs a plain parallel reader.

A checkpoint-shaped set of files (one large pages file of random bytes, a few
small ones, a signed manifest) is published once, plain (one object per file:
random bytes do not compress), to a real S3-compatible
server on loopback (SeaweedFS, rekindle_dev.seaweedfs). Then, per trial, in an
order that alternates between trials, the same bytes are fetched three ways
with the same ranges (16 MiB) and the same number of requests in flight:

  plain   ranged GETs, bytes dropped: what the store and the network give here,
          the limit any pull meets (issue 24's yardstick)
  disk    ranged GETs written into a file with pwrite, nothing checked
  pull    the node agent's pull: NodeCache.get_from_store, each range written
          and hashed in file order (BLAKE3), the entry sealed into a new cache

Every arm reads the same objects from the same server; the residency of the
server's volume files in the page cache is recorded before each arm (the
server's reads come from there once warm, for every arm alike). Results:
results.json (every trial, medians, ratios within the run, the command, the
machine, load averages), results.md and results.png in --out.

    rekindle-dev bench store --size-mib 1024 --trials 5 --threads 8 --out docs/bench/store
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from rekindle_contract.manifest import MANIFEST_FORMAT, Manifest
from rekindle_store import manifest_io, object_copy, page_cache
from rekindle_store.node_cache import NodeCache
from rekindle_store.object_copy import PART_BYTES, StoreLocation
from rekindle_store.s3 import Bucket

from rekindle_dev import store_read
from rekindle_dev.bench_common import md_table, provenance, pyplot, save_figure
from rekindle_dev.bench_provenance import MEASURED_BY, provenance_line
from rekindle_dev.seaweedfs import SeaweedFS
from rekindle_dev.seaweedfs import build as build_seaweedfs

ARMS = ("plain", "disk", "pull")
KEY = os.urandom(32)


def log(msg: str) -> None:
    print(f"[bench store {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=1024, help="the pages file's size")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--threads", type=int, default=8, help="requests in flight, every arm")
    p.add_argument("--scratch", type=Path, default=Path("/var/tmp"), help="where files go")
    p.add_argument("--out", type=Path, default=Path("docs/bench/store"))


def make_checkpoint(root: Path, size: int) -> Path:
    """A signed checkpoint directory of the usual shape, its pages file size bytes."""
    (root / "images").mkdir(parents=True)
    with open(root / "images" / "pages-1.img", "wb") as fh:
        left = size
        while left:
            n = min(left, 64 << 20)
            fh.write(os.urandom(n))
            left -= n
    for name, n in (("core-1.img", 4096), ("mm-1.img", 65536), ("files.img", 8192)):
        (root / "images" / name).write_bytes(os.urandom(n))
    files = manifest_io.checksum_files(root, manifest_io.list_files(root), threads=2)
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "fingerprint": {},
        "criu": {},
        "vllm": {"root_pid": 1},
        "identity": {"namespace": "bench", "name": "/checkpoints/bench"},
        "files": files,
    }
    manifest_io.write(root, cast(Manifest, doc), KEY)
    return root


def _ranges(loc: StoreLocation, files: list[dict[str, Any]]) -> list[Any]:
    return [
        (loc.data_key(f["path"]), start, min(start + PART_BYTES, f["size"]))
        for f in sorted(files, key=lambda f: -f["size"])
        for start in range(0, f["size"], PART_BYTES)
    ]


def plain(bucket: Bucket, jobs: list[Any], threads: int) -> int:
    return store_read.read(bucket, jobs, threads)


def to_disk(bucket: Bucket, jobs: list[Any], threads: int, dest: Path) -> int:
    dest.mkdir(parents=True)
    fds: dict[str, int] = {}
    for key, _s, _e in jobs:
        if key not in fds:
            fds[key] = os.open(dest / key.replace("/", "_"), os.O_WRONLY | os.O_CREAT, 0o600)

    def one(job: Any) -> int:
        data = bucket.get(job[0], job[1], job[2])
        os.pwrite(fds[job[0]], data, job[1])
        return len(data)

    try:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(one, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def pull(loc: StoreLocation, threads: int, dest: Path) -> int:
    entry = NodeCache(dest, budget_bytes=1 << 40).get_from_store(loc, KEY, threads)
    assert entry.copied
    return entry.bytes


def store_residency(data_dir: Path) -> float:
    resident = total = 0
    for f in data_dir.rglob("*"):
        if f.is_file():
            r, t = page_cache.mincore_pages(f)
            resident, total = resident + r, total + t
    return round(100.0 * resident / total, 1) if total else 0.0


def run(args: argparse.Namespace) -> int:
    started, load0 = time.time(), os.getloadavg()
    size = args.size_mib << 20
    work = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.scratch))
    server = SeaweedFS(build_seaweedfs(), work / "s3")
    trials: list[dict[str, Any]] = []
    try:
        server.start()
        bucket = server.bucket("bench")
        bucket.create()
        src = make_checkpoint(work / "made", size)
        loc = StoreLocation.of(bucket, "rekindle", "bench", "/checkpoints/bench")
        log(f"publishing {size >> 20} MiB")
        # Plain objects: the random pages do not compress, and the arms share ranges of one
        # object per file (bench scale-out measures frames, on a real checkpoint).
        sent = object_copy.publish(src, loc, args.threads, encoding="plain")
        files = json.loads((src / "manifest.json").read_bytes())["files"]
        jobs = _ranges(loc, files)
        total = sum(f["size"] for f in files)
        log(f"published {sent.bytes} bytes in {sent.seconds:.1f} s; warming the store")
        plain(bucket, jobs, args.threads)  # the server's page cache, for every arm alike
        for t in range(args.trials):
            order = ARMS if t % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                dest = work / f"dest-{arm}-{t}"
                residency = store_residency(work / "s3" / "data")
                t0 = time.monotonic()
                if arm == "plain":
                    got = plain(bucket, jobs, args.threads)
                elif arm == "disk":
                    got = to_disk(bucket, jobs, args.threads, dest)
                else:
                    got = pull(loc, args.threads, dest)
                seconds = time.monotonic() - t0
                assert got == total, (arm, got, total)
                shutil.rmtree(dest, ignore_errors=True)
                os.sync()  # the next arm starts without this one's writeback
                row = {
                    "trial": t,
                    "arm": arm,
                    "seconds": round(seconds, 3),
                    "mib_per_s": round(total / seconds / 2**20, 1),
                    "store_resident_percent": residency,
                }
                trials.append(row)
                log(f"trial {t} {arm}: {seconds:.2f} s ({row['mib_per_s']} MiB/s)")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        arm: statistics.median(r["seconds"] for r in trials if r["arm"] == arm) for arm in ARMS
    }
    doc = {
        "what": "object store pull vs a plain parallel ranged reader, same bytes, same ranges",
        "bytes": total,
        "threads": args.threads,
        "range_bytes": PART_BYTES,
        "median_seconds": summary,
        "ratio_pull_to_plain": round(summary["pull"] / summary["plain"], 2),
        "ratio_disk_to_plain": round(summary["disk"] / summary["plain"], 2),
        "trials": trials,
        **provenance(
            " ".join(["rekindle-dev", "bench", "store", *sys.argv[3:]]),
            MEASURED_BY["store"],
            load0,
            started,
            str(args.scratch),
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "results.md").write_text(report(doc))
    plot(doc, args.out / "results.png")
    print(report(doc))
    return 0


def report(doc: dict[str, Any]) -> str:
    med = doc["median_seconds"]
    rows = []
    for arm in ARMS:
        per = [r["seconds"] for r in doc["trials"] if r["arm"] == arm]
        rows.append(
            [
                arm,
                f"{med[arm]:.2f}",
                f"{doc['bytes'] / med[arm] / 2**20:.0f}",
                f"{med[arm] / med['plain']:.2f}x",
                " / ".join(f"{x:.2f}" for x in per),
            ]
        )
    head = (
        f"{doc['bytes'] / 2**20:.0f} MiB in {doc['range_bytes'] >> 20} MiB ranges, "
        f"{doc['threads']} in flight; pull / plain = {doc['ratio_pull_to_plain']}x "
        f"(median of {len(rows[0][4].split(' / '))})\n\n"
    )
    return (
        head
        + md_table(["arm", "median s", "MiB/s", "vs plain", "per trial (s)"], rows)
        + "\n\n"
        + provenance_line(doc)
        + "\n"
    )


def plot(doc: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, arm in enumerate(ARMS):
        per = [r["mib_per_s"] for r in doc["trials"] if r["arm"] == arm]
        ax.scatter([i] * len(per), per, alpha=0.6)
        ax.hlines(statistics.median(per), i - 0.25, i + 0.25, color="black")
    ax.set_xticks(range(len(ARMS)), ARMS)
    ax.set_ylabel("MiB/s (higher is better)")
    ax.set_ylim(bottom=0)
    save_figure(fig, out, f"Object store: {doc['bytes'] >> 20} MiB, {doc['threads']} in flight")
