"""Detect io_uring in a process tree before dumping it.

CRIU fails on io_uring instances with an obscure message ("Unknown shit 600
(anon_inode:[io_uring])"). The agent prevents them (seccomp.py) and checks
anyway, so a tree that still has one fails the checkpoint early with a message
that names the fix.
"""

from __future__ import annotations

from pathlib import Path

from rekindle_agent.process_tree import proctree

MARK = "io_uring"

FIX = (
    "io_uring instances cannot be checkpointed. Keep the agent's seccomp filter on "
    "(drop --no-seccomp-io-uring) so vLLM's tree cannot create them, or set "
    "sysctl kernel.io_uring_disabled=2 on the node"
)


def find(pids: list[int], proc: Path = proctree.PROC) -> list[tuple[int, str]]:
    """(pid, where) for every io_uring fd or mapping in the processes."""
    out: list[tuple[int, str]] = []
    for pid in pids:
        for fd, target in proctree.fd_targets(pid, proc).items():
            if MARK in target:
                out.append((pid, f"fd {fd} -> {target}"))
        try:
            maps = (proc / str(pid) / "maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            if MARK in line:
                out.append((pid, "mapping " + line.split()[-1]))
                break
    return out


def error_message(found: list[tuple[int, str]]) -> str:
    where = "; ".join(f"pid {pid}: {what}" for pid, what in found[:5])
    return f"{FIX}. Found: {where}"
