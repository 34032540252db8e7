"""NVIDIA device files a process holds open or mapped, named before CRIU meets them.

CRIU dumps the character devices it knows, and /dev/nvidia* are not among
them. cuda-checkpoint's checkpoint action releases CUDA's own descriptors
and mappings with the GPU memory; whatever else opened the driver (NVML
above all: nvmlInit opens /dev/nvidiactl and a GPU's /dev/nvidiaN and holds
them until nvmlShutdown) still holds them, and the dump fails on the first
one with a message about an unsupported file. Scanned once CUDA has
released the GPU, each leftover is named with its process, descriptor and
kind, so a refusal says what to close.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_KINDS = (
    (re.compile(r"/dev/nvidiactl"), "control"),
    (re.compile(r"/dev/nvidia\d+"), "gpu"),
    (re.compile(r"/dev/nvidia-uvm"), "uvm"),
    (re.compile(r"/dev/nvidia-uvm-tools"), "uvm-tools"),
    (re.compile(r"/dev/nvidia-modeset"), "modeset"),
    (re.compile(r"/dev/nvidia-caps/.+"), "capability"),
)


@dataclass(frozen=True)
class NvidiaHandle:
    """One open descriptor (fd set) or one mapping (fd None) of an NVIDIA device file."""

    pid: int
    fd: int | None
    path: str
    kind: str

    def __str__(self) -> str:
        where = f"fd {self.fd}" if self.fd is not None else "a mapping"
        return f"pid {self.pid} {where}: {self.path} ({self.kind})"


def kind_of(path: str) -> str | None:
    """What an NVIDIA device path is ('control', 'gpu', 'uvm', ...), None for anything else."""
    for pattern, kind in _KINDS:
        if pattern.fullmatch(path):
            return kind
    return None


def fd_targets(pid: int, proc: Path) -> dict[int, str]:
    """fd number -> readlink target for one process (a missing process: empty)."""
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


def mapped_paths(pid: int, proc: Path) -> set[str]:
    """Paths of one process's file-backed mappings."""
    out: set[str] = set()
    try:
        text = (proc / str(pid) / "maps").read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.add(parts[5])
    return out


def scan(pid: int, proc: str | Path = "/proc") -> list[NvidiaHandle]:
    """Every NVIDIA device descriptor and mapped device file of one process."""
    root = Path(proc)
    fds = fd_targets(pid, root).items()
    out = [NvidiaHandle(pid, fd, t, k) for fd, t in fds if (k := kind_of(t))]
    maps = mapped_paths(pid, root)
    out += [NvidiaHandle(pid, None, p, k) for p in maps if (k := kind_of(p))]
    return sorted(out, key=lambda h: (h.pid, h.fd is None, h.fd or 0, h.path))


def scan_tree(pids: Iterable[int], proc: str | Path = "/proc") -> list[NvidiaHandle]:
    """scan() over every process of a tree."""
    return [h for pid in pids for h in scan(pid, proc)]


def leftover_message(handles: list[NvidiaHandle]) -> str:
    """The refusal for handles still open once CUDA released the GPU: what, and what to do."""
    shown = "; ".join(str(h) for h in handles[:8])
    more = f" (and {len(handles) - 8} more)" if len(handles) > 8 else ""
    return (
        f"NVIDIA device files still open after CUDA released the GPU: {shown}{more}. "
        "CRIU cannot dump them: close them before the checkpoint (NVML: nvmlShutdown() "
        "after use)"
    )
