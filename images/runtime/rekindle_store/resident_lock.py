"""Keeping checkpoint files in the page cache: one `vmtouch -l` child, within a budget.

A restore from files in memory is several times faster than one that reads the
disk, and the kernel evicts whatever was not used lately. vmtouch -l maps the
files read-only and mlock(2)s them until it is killed; killing it unlocks (the
pages stay cached but become reclaimable). Locked page cache is charged to the
memory cgroup of whoever runs vmtouch and cannot be reclaimed: a budget, and
mlock needs CAP_IPC_LOCK (or a large enough RLIMIT_MEMLOCK).

Two users: the in-pod agent (its newest checkpoint, --keep-resident-mb) and the
node agent (the node cache's most recently used checkpoints, its resident budget).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rekindle_store.page_cache import PAGE

log = logging.getLogger("rekindle.resident")

# How long ResidentLock waits for vmtouch to have locked everything.
LOCK_WAIT_S = 120.0


def vmtouch_binary() -> str | None:
    """vmtouch on PATH, or None."""
    return shutil.which("vmtouch")


def within_budget(files: Iterable[tuple[str, int]], budget: int) -> tuple[list[str], int]:
    """The files to lock, in the order given, while their pages fit in budget bytes.

    Callers pass the order that matters most first (the agent: the images CRIU
    parses, then memory pages, then the weight dump, as the prefetcher reads
    them); a file that does not fit is skipped and smaller later ones still
    may. Returns (paths, bytes they take in whole pages).
    """
    chosen: list[str] = []
    used = 0
    for path, size in files:
        need = -(-int(size) // PAGE) * PAGE
        if used + need <= budget:
            chosen.append(path)
            used += need
    return chosen, used


def locked_bytes(pid: int) -> int:
    """VmLck of pid: what it has mlock()ed (0 when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class ResidentLock:
    """Keeps one set of files locked in the page cache by a `vmtouch -l` child.

    lock() replaces what was locked before (the newest checkpoint wins); the
    child holds its mlock()ed mappings until release() kills it. Killing it
    unlocks: the pages stay cached but become reclaimable again.
    """

    def __init__(
        self,
        budget_bytes: int,
        binary: str | None = None,
        on_spawn: Callable[[int], None] | None = None,
    ) -> None:
        self.budget = budget_bytes
        # Told the vmtouch child's pid (the in-pod agent's reaper leaves it to us).
        self.on_spawn = on_spawn
        self.binary = binary or vmtouch_binary()
        self.proc: subprocess.Popen[bytes] | None = None
        self.root: str | None = None
        self.files: list[str] = []
        self.want = 0  # bytes asked for
        self.why = ""  # what was left out, or why nothing is locked
        self._mu = threading.Lock()

    def lock(self, root: str, files: list[tuple[str, int]], wait: float = LOCK_WAIT_S) -> None:
        """Lock files (paths relative to root, sizes) that fit the budget; wait until
        they are locked (at most wait seconds; 0: do not wait)."""
        with self._mu:
            self._stop()
            self.root = root
            if self.binary is None:
                self.why = "vmtouch is not installed"
                return
            chosen, self.want = within_budget(files, self.budget)
            self.files = chosen
            left = len(files) - len(chosen)
            self.why = f"{left} file(s) over the budget left out" if left else ""
            if not chosen:
                self.why = f"nothing fits in the budget of {self.budget} bytes"
                return
            paths = [str(Path(root) / p) for p in chosen]
            self.proc = subprocess.Popen(
                [self.binary, "-l", "-q", "-F", *paths],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            if self.on_spawn is not None:
                self.on_spawn(self.proc.pid)
        self.wait_locked(wait)

    def wait_locked(self, timeout: float) -> bool:
        """True once the child has locked what it was asked to (its VmLck)."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.proc
            if proc is None:
                return False
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                self.why = f"vmtouch -l exited {proc.returncode}: {err.strip()[:300]}"
                log.warning("keep resident: %s (mlock needs CAP_IPC_LOCK)", self.why)
                self.proc = None
                return False
            if locked_bytes(proc.pid) >= self.want:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def doc(self) -> dict[str, Any]:
        """What is locked now, for the agent's status (a vmtouch that died says why)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.wait_locked(0)
        proc = self.proc
        alive = proc is not None and proc.poll() is None
        return {
            "budget_bytes": self.budget,
            "checkpoint": self.root,
            "files": len(self.files) if alive else 0,
            "locked_bytes": locked_bytes(proc.pid) if alive and proc else 0,
            "why": self.why,
        }

    def _stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            self.proc = None
        self.files = []
        self.want = 0

    def release(self) -> None:
        with self._mu:
            self._stop()
            self.root = None
