"""Process trees from /proc: who is in vLLM's tree, what it maps, and killing it.

CRIU dumps a tree by its root PID; the agent needs the same view to find the
/dev/shm files the tree uses, to detect io_uring before a dump, and to kill a
half-restored tree completely.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

PROC = Path("/proc")


def parse_stat(text: str) -> tuple[int, str, int]:
    """(pid, state, ppid) from /proc/PID/stat; comm may hold spaces and parens."""
    pid = int(text.split(" ", 1)[0])
    rest = text[text.rindex(")") + 2 :].split()
    return pid, rest[0], int(rest[1])


def parent_map(proc: Path = PROC) -> dict[int, int]:
    """pid -> ppid for every process we can see."""
    out: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pid, _state, ppid = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        out[pid] = ppid
    return out


def zombie_children(parent: int, proc: Path = PROC) -> set[int]:
    """The children of parent that have exited and wait to be reaped."""
    out: set[int] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pid, state, ppid = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and state == "Z":
            out.add(pid)
    return out


def descendants(root: int, parents: dict[int, int]) -> list[int]:
    """root and every process below it, root first, parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        if pid not in parents:
            continue
        out.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return out


def tree(root: int, proc: Path = PROC) -> list[int]:
    return descendants(root, parent_map(proc))


def alive(pid: int, proc: Path = PROC) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        _pid, state, _ppid = parse_stat((proc / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return False
    return state not in ("Z", "X")


def fd_targets(pid: int, proc: Path = PROC) -> dict[int, str]:
    """fd number -> readlink target for one process (missing process: empty)."""
    out: dict[int, str] = {}
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(fd_dir / name)
        except (OSError, ValueError):
            continue
    return out


def mapped_paths(pid: int, proc: Path = PROC) -> set[str]:
    """Paths of file-backed mappings, with any ' (deleted)' suffix kept."""
    out: set[str] = set()
    try:
        text = (proc / str(pid) / "maps").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.add(parts[5])
    return out


def kill_tree(pids: list[int], timeout: float = 10.0, proc: Path = PROC) -> None:
    """SIGKILL every pid (stopped ones too) and wait until none is alive."""
    for pid in pids:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            except PermissionError:
                break
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p, proc) for p in pids):
            return
        time.sleep(0.02)
    left = [p for p in pids if alive(p, proc)]
    if left:
        raise TimeoutError(f"processes {left} still alive {timeout:.0f}s after SIGKILL")
