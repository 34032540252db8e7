"""Pull a checkpoint's files into the page cache in parallel, hashing as it reads.

Started first thing on restore and overlapped with everything else: by the
time CRIU reads pages-*.img (or, with the mmap restore, faults its pages in),
they are already cached. The same read also proves the files intact and, with
a signed manifest, authentic (BLAKE3 by default against the manifest), so the
check costs no extra I/O.

Two groups, so that nothing of the checkpoint is used before it is checked
while the long pole still overlaps with CRIU: the small images CRIU parses
(every image but pages-*.img) are read first and awaited before CRIU runs
(result(paths=critical)); the memory pages, the /dev/shm files and other
files the tree maps or holds open, and the weight dump are only data for the
restored tree, which CRIU leaves stopped until they too are checked
(restore.py); on a mismatch the tree is killed and those files removed.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rekindle_contract.manifest import IMAGES_SUBDIR, WEIGHTS_SUBDIR, FileEntry
from rekindle_store import digests

# Each thread reads (and hashes) 1 MiB at a time: the buffer stays in the CPU's
# caches between the copy out of the page cache and the hash, where 8 MiB buffers
# (one per thread) spill to memory and hash measurably slower (docs/restore-profile.md).
CHUNK = 1 << 20
# Files this big (a weight dump, the largest pages images) are hashed on two
# threads: the smaller files finish first, and one thread would leave the tail
# of the check on one core.
SPLIT_HASH_BYTES = 256 << 20


def deferred(path: str) -> bool:
    """Content only the restored tree uses (checked before it runs): everything but the
    images CRIU parses. Memory pages, the /dev/shm and other files it maps or has
    open, the weight dump."""
    return not path.startswith(f"{IMAGES_SUBDIR}/") or path.startswith(f"{IMAGES_SUBDIR}/pages-")


def weight_file(path: str) -> bool:
    """The weight dump: only the reload reads it, after the restored tree runs, so its
    check gates the reload rather than the tree (and it is read last)."""
    return path.startswith(f"{WEIGHTS_SUBDIR}/")


def weight_paths(files: list[FileEntry]) -> set[str]:
    return {f["path"] for f in files if weight_file(f["path"])}


def tree_paths(files: list[FileEntry]) -> set[str]:
    """Everything the restored tree itself uses: checked before it resumes."""
    return {f["path"] for f in files if not weight_file(f["path"])}


def critical_paths(files: list[FileEntry]) -> set[str]:
    """Files checked before CRIU runs: the images it parses (all but pages-*.img)."""
    return {f["path"] for f in files if not deferred(f["path"])}


@dataclass
class PrefetchResult:
    bytes_read: int = 0
    seconds: float = 0.0
    bad: list[str] = field(default_factory=list)  # "path: reason"


def expected(entry: FileEntry, verify: str) -> tuple[str, str]:
    """(algorithm, digest) to check entry against ('size': checked by size only, elsewhere).

    The one asked for where the manifest has it, else the strongest it has:
    blake3 (what agents record now), else sha256 (older manifests). crc32 only
    where asked for and recorded (an older manifest, no signing key).
    """
    for algo in (verify, "blake3", "sha256"):
        value = entry.get(algo)
        if algo in digests.ALGORITHMS and isinstance(value, str) and value:
            return algo, value
    raise ValueError(f"{entry.get('path')}: no digest in the manifest")


def _read_file(
    path: Path, check: tuple[str, str] | None, chunk: int, split_hash: int = SPLIT_HASH_BYTES
) -> tuple[int, str | None]:
    """Read path once (WILLNEED first); return (bytes, problem or None)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return 0, f"{e.strerror}"
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        threads = 2 if size >= split_hash else 1
        h = digests.new(check[0], threads) if check else None
        buf = bytearray(chunk)
        view = memoryview(buf)
        total = 0
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            if h is not None:
                h.update(view[:n])
            total += n
    except OSError as e:
        return 0, f"{e.strerror or e}"
    finally:
        os.close(fd)
    if check is None or h is None:
        return total, None
    if h.hexdigest() != check[1]:
        return total, f"{check[0]} differs from the manifest"
    return total, None


class Prefetcher:
    """Runs in the background; .result() waits and says which files were bad."""

    def __init__(
        self,
        root: Path,
        files: list[FileEntry],
        threads: int = 8,
        verify: str = "blake3",
        chunk: int = CHUNK,
        split_hash: int = SPLIT_HASH_BYTES,
    ) -> None:
        self._t0 = time.monotonic()
        self.verify = verify
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="prefetch")
        # The small files CRIU needs checked first (they gate it), then what the
        # restored tree uses (it gates resuming), then the weight dump (it gates
        # only the reload); largest first in each: the long pole starts earliest.
        order = sorted(
            files,
            key=lambda f: (deferred(f["path"]), weight_file(f["path"]), -int(f["size"])),
        )
        self.order = [f["path"] for f in order]  # the order files are read in
        self._futures: list[tuple[str, Future[tuple[int, str | None]]]] = [
            (
                f["path"],
                self._pool.submit(
                    _read_file,
                    root / f["path"],
                    None if verify == "size" else expected(f, verify),
                    chunk,
                    split_hash,
                ),
            )
            for f in order
        ]
        self._last_done = self._t0
        self._lock = threading.Lock()
        for _path, fut in self._futures:
            fut.add_done_callback(self._finished)
        self._pool.shutdown(wait=False)

    def _finished(self, _fut: Future[tuple[int, str | None]]) -> None:
        with self._lock:
            self._last_done = max(self._last_done, time.monotonic())

    def result(self, timeout: float | None = None, paths: set[str] | None = None) -> PrefetchResult:
        """Wait for every file (or those in paths); TimeoutError after timeout seconds in all."""
        out = PrefetchResult()
        deadline = None if timeout is None else time.monotonic() + timeout
        for path, fut in self._futures:
            if paths is not None and path not in paths:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            n, problem = fut.result(timeout=left)
            out.bytes_read += n
            if problem:
                out.bad.append(f"{path}: {problem}")
        with self._lock:
            out.seconds = self._last_done - self._t0
        return out

    def cancel(self) -> None:
        for _path, fut in self._futures:
            fut.cancel()
