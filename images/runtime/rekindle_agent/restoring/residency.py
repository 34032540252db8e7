"""How much of a checkpoint is in the page cache, and keeping it there.

A restore from a cached checkpoint is several times faster than one that has
to read the disk, so "is it cached on this node?" is the first question when a
cold start is slow. vmtouch (installed in the runtime images and on hosts by
scripts/python-env) answers it with mincore(2) and, with -l, keeps files in
memory by mlock(2)ing a read-only mapping of them until it is killed.

- residency(path): bytes of path (a file or a directory tree) in the page cache,
  by vmtouch where installed, else by mincore(2) here (same answer, slower on
  huge trees). Benches record it beside every timing; the agent reports it,
  through cached_residency() (one measurement reused for CACHE_S seconds, as
  the operator polls the status).
- follow(): keeps a ResidentLock (rekindle_store.resident_lock: one `vmtouch -l`
  child within a byte budget, the agent's --keep-resident-mb) on the newest
  checkpoint's files. Locked page cache is charged to the pod's memory cgroup
  and cannot be reclaimed: the budget counts against the pod's memory limit,
  and mlock needs CAP_IPC_LOCK (or a large enough RLIMIT_MEMLOCK).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rekindle_store.page_cache import PAGE, mincore_pages
from rekindle_store.resident_lock import ResidentLock, vmtouch_binary

from rekindle_agent.restoring.prefetch import deferred

log = logging.getLogger("rekindle.residency")

_RESIDENT = re.compile(r"Resident Pages:\s+(\d+)/(\d+)")
_FILES = re.compile(r"Files:\s+(\d+)")


def parse_vmtouch(text: str) -> tuple[int, int, int]:
    """(files, resident pages, total pages) from vmtouch's summary (no -v, no -q).

    Raises ValueError when the summary is not there (a vmtouch that failed).
    """
    res = _RESIDENT.search(text)
    files = _FILES.search(text)
    if res is None or files is None:
        raise ValueError(f"no 'Files:'/'Resident Pages:' summary in vmtouch's output: {text!r}")
    return int(files.group(1)), int(res.group(1)), int(res.group(2))


def regular_files(path: str | os.PathLike[str]) -> list[Path]:
    """path itself, or every regular file below it (links not followed), sorted."""
    root = Path(path)
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _by_mincore(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    files, resident, total = 0, 0, 0
    for f in regular_files(path):
        r, t = mincore_pages(f)
        files, resident, total = files + 1, resident + r, total + t
    return files, resident, total


def _by_vmtouch(binary: str, path: str | os.PathLike[str]) -> tuple[int, int, int]:
    out = subprocess.run(
        [binary, "-F", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    if out.returncode != 0:
        raise OSError(f"vmtouch {path}: exit {out.returncode}: {out.stderr.strip()[:300]}")
    return parse_vmtouch(out.stdout)


def residency(path: str | os.PathLike[str], tool: str = "auto") -> dict[str, Any]:
    """How much of path (a file or a directory tree) is in the page cache now.

    tool: "vmtouch", "mincore", or "auto" (vmtouch where installed). The result
    is plain JSON: path, files, bytes (the files' size in whole pages),
    resident_bytes, percent, tool, seconds (the cost of asking).
    """
    t0 = time.monotonic()
    binary = vmtouch_binary() if tool in ("auto", "vmtouch") else None
    if tool == "vmtouch" and binary is None:
        raise FileNotFoundError("vmtouch is not installed: apt-get install vmtouch")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    files, resident, total = _by_vmtouch(binary, path) if binary else _by_mincore(path)
    return {
        "path": str(path),
        "files": files,
        "bytes": total * PAGE,
        "resident_bytes": resident * PAGE,
        "percent": round(100.0 * resident / total, 1) if total else 100.0,
        "tool": "vmtouch" if binary else "mincore",
        "seconds": round(time.monotonic() - t0, 4),
    }


# How long cached_residency() answers from its last measurement of a path.
CACHE_S = 5.0


class ResidencyCache:
    """residency() of recent paths, reused for a few seconds.

    The agent's /v1/status measures its whole checkpoint, and the operator
    (and `kubectl rekindle status`) poll it: without a cache every poll walks
    every page of a many-GB tree. Ages come from the monotonic clock, so a
    wall-clock step never serves a stale answer for long nor hides a fresh one.
    """

    def __init__(self, max_age: float = CACHE_S, clock: Callable[[], float] = time.monotonic):
        self.max_age = max_age
        self.clock = clock
        self._mu = threading.Lock()
        self._last: dict[str, tuple[float, dict[str, Any]]] = {}

    def get(self, path: str | os.PathLike[str], tool: str = "auto") -> dict[str, Any]:
        """residency(path, tool), or the answer measured less than max_age seconds ago.

        Errors are not cached: the next call measures again.
        """
        key = f"{tool}:{os.fspath(path)}"
        now = self.clock()
        with self._mu:
            hit = self._last.get(key)
        if hit is None or not 0 <= now - hit[0] < self.max_age:
            hit = (now, residency(path, tool))
            with self._mu:
                # Only the newest path or two are asked about: keep the map tiny.
                self._last = {k: v for k, v in self._last.items() if now - v[0] < self.max_age}
                self._last[key] = hit
        return dict(hit[1])


_CACHE = ResidencyCache()


def cached_residency(path: str | os.PathLike[str]) -> dict[str, Any]:
    """residency(path) measured at most CACHE_S seconds ago (the agent's status uses it)."""
    return _CACHE.get(path)


def checkpoint_files(ckpt: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """ckpt's regular files (relative path, size) in the order worth keeping first:
    the images CRIU parses, then the rest largest first (the prefetcher's order)."""
    root = Path(ckpt)
    out = [(str(p.relative_to(root)), p.stat().st_size) for p in regular_files(root)]
    return sorted(out, key=lambda f: (deferred(f[0]), -f[1]))


def follow(
    lock: ResidentLock,
    newest: Callable[[], tuple[str, list[tuple[str, int]]] | None],
    stop: threading.Event,
    every: float = 2.0,
) -> None:
    """Lock what newest() names whenever it changes, until stop is set.

    newest() returns (checkpoint dir, files in lock order) or None while there
    is nothing to keep (the agent is still booting or restoring).
    """
    while not stop.is_set():
        try:
            cur = newest()
            if cur is not None and cur[0] != lock.root:
                log.info("keep resident: locking %s (budget %d bytes)", cur[0], lock.budget)
                lock.lock(cur[0], cur[1], wait=0)
        except Exception:  # never take the agent down for a cache hint
            log.exception("keep resident: locking failed")
        stop.wait(every)
    lock.release()
