"""The machine a benchmark ran on, described once for every results.json and the report."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _disk(path: str) -> str:
    """The block device under path and whether the kernel calls it rotational."""
    try:
        dev = os.stat(path).st_dev
        sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        name = sys_dev.resolve().name
        queue = sys_dev / "queue"
        if not queue.exists():  # a partition: its parent disk has the queue
            queue = sys_dev.resolve().parent / "queue"
        rota = (queue / "rotational").read_text().strip()
        return f"{name} ({'rotational' if rota == '1' else 'non-rotational'} per the kernel)"
    except OSError:
        return "unknown"


def machine(scratch: str = "/var/tmp") -> dict[str, Any]:
    """CPU model, cores, memory, kernel, the disk under scratch, and the load average now."""
    return {
        "node": platform.node(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": round(_mem_total() / 2**30, 1),
        "kernel": platform.release(),
        "disk": _disk(scratch),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
