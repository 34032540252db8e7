"""Will a checkpoint fit? Checked before anything is drained or dumped.

A dump that runs out of space fails late: after the weights are released and
written, minutes in, with vLLM to be brought back. So the agent estimates
what the checkpoint will take and compares it with the free space of the
file system it goes to, and refuses at once (serving untouched) when it does
not fit.

The estimate: CRIU writes the anonymous memory of vLLM's process tree (its
file-backed pages are not dumped); the weights dump holds the weights, which
on CPU are part of that anonymous memory (released from it before CRIU runs,
so counted once) and on GPU live in device memory (counted from the model's
weight files); the /dev/shm files the tree maps are copied. Plus a margin for
what the estimate cannot see (allocator growth, CRIU's own metadata). It is
low for a tree restored with the mmap restore: the pages it still maps from
its old image are file-backed to the kernel, yet the patched CRIU writes them
too; a dump that then fills the volume fails as volume_full, as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

MARGIN_FRACTION = 0.10
MARGIN_BYTES = 64 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def anonymous_bytes(pids: Iterable[int], proc: str = "/proc") -> int:
    """The anonymous memory of pids (smaps_rollup's Anonymous), in bytes."""
    total = 0
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Anonymous:"):
                        total += int(line.split()[1]) << 10
        except (OSError, ValueError, IndexError):
            continue  # gone, or not readable: the margin covers it
    return total


def weight_file_bytes(model_dir: str) -> int:
    """The model's weight files (what a GPU server holds in device memory)."""
    root = Path(model_dir)
    if not root.is_dir():
        return 0
    return sum(
        p.stat().st_size for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES
    )


def needed_bytes(anonymous: int, shm: int, device_weights: int) -> int:
    base = anonymous + shm + device_weights
    return base + int(base * MARGIN_FRACTION) + MARGIN_BYTES


def free_bytes(target: Path) -> int:
    """Free space for an unprivileged writer where target will be (its nearest existing
    ancestor: the directory itself is made by the dump)."""
    here = target
    while not here.exists() and here != here.parent:
        here = here.parent
    st = os.statvfs(here)
    return st.f_bavail * st.f_frsize


def problem(target: Path, needed: int, free: int) -> str | None:
    """Why a checkpoint of needed bytes does not fit in free bytes at target, or None."""
    if free >= needed:
        return None
    return (
        f"{target}: about {needed / 2**30:.2f} GiB needed (vLLM's memory, weights and "
        f"/dev/shm files, plus {MARGIN_FRACTION:.0%}), {free / 2**30:.2f} GiB free; free "
        "space on the checkpoint volume (delete old checkpoints) or give it more"
    )
