"""Pull a checkpoint's files into the page cache in parallel, hashing as it reads.

Started first thing on restore and overlapped with everything else: by the
time CRIU reads pages-*.img (or, with the mmap restore, faults its pages in),
they are already cached. The same read also proves the files intact (crc32 or sha256
against the manifest), so the integrity check costs no extra I/O.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rekindle_contract.manifest import FileEntry

CHUNK = 8 << 20


@dataclass
class PrefetchResult:
    bytes_read: int = 0
    seconds: float = 0.0
    bad: list[str] = field(default_factory=list)  # "path: reason"


def expected(entry: FileEntry, verify: str) -> tuple[str, str] | None:
    """(algorithm, digest) to check entry against, or None for no content check.

    crc32 is the default at restore: it catches damaged or truncated images at
    2-3x the speed of sha256, and sha256 would add no security here, since
    whoever can rewrite the images can rewrite the manifest next to them.
    """
    if verify == "size":
        return None
    if verify == "crc32" and "crc32" in entry:
        return "crc32", entry["crc32"]
    return "sha256", entry["sha256"]


def _read_file(path: Path, check: tuple[str, str] | None, chunk: int) -> tuple[int, str | None]:
    """Read path once (WILLNEED first); return (bytes, problem or None)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return 0, f"{e.strerror}"
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        algo = check[0] if check else None
        h = hashlib.sha256() if algo == "sha256" else None
        crc = 0
        buf = bytearray(chunk)
        view = memoryview(buf)
        total = 0
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            if h is not None:
                h.update(view[:n])
            elif algo == "crc32":
                crc = zlib.crc32(view[:n], crc)
            total += n
    finally:
        os.close(fd)
    if check is None:
        return total, None
    got = h.hexdigest() if h is not None else f"{crc:08x}"
    if got != check[1]:
        return total, f"{check[0]} differs from the manifest"
    return total, None


class Prefetcher:
    """Runs in the background; .result() waits and says which files were bad."""

    def __init__(
        self,
        root: Path,
        files: list[FileEntry],
        threads: int = 8,
        verify: str = "crc32",
        chunk: int = CHUNK,
    ) -> None:
        self._t0 = time.monotonic()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="prefetch")
        # Largest first: the long pole starts earliest.
        order = sorted(files, key=lambda f: -int(f["size"]))
        self._futures: list[tuple[str, Future[tuple[int, str | None]]]] = [
            (
                f["path"],
                self._pool.submit(_read_file, root / f["path"], expected(f, verify), chunk),
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

    def result(self, timeout: float | None = None) -> PrefetchResult:
        out = PrefetchResult()
        for path, fut in self._futures:
            n, problem = fut.result(timeout=timeout)
            out.bytes_read += n
            if problem:
                out.bad.append(f"{path}: {problem}")
        with self._lock:
            out.seconds = self._last_done - self._t0
        return out

    def cancel(self) -> None:
        for _path, fut in self._futures:
            fut.cancel()
