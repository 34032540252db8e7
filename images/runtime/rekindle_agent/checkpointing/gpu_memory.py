"""How much device memory the pod's GPUs still hold, read with nvidia-smi.

After vLLM's level-2 sleep, what is left on the GPU (CUDA context, NCCL and
cuBLAS workspaces, whatever the allocator kept) is what cuda-checkpoint copies
into the process's host memory at the dump, and what the pod's memory limit
must hold on top of vLLM. Measured on an H100: the checkpoint action moved all
13 GB a PyTorch process held into its RSS. The pod owns its GPUs (the device
plugin allocates whole GPUs), so the GPU's used memory is the tree's.

nvidia-smi runs in its own short process: NVML is never opened in the agent
or in vLLM's tree (an NVML handle left open there is a descriptor CRIU must
not meet).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence

MIB = 1 << 20
QUERY = ["--query-gpu=uuid,memory.used", "--format=csv,noheader,nounits"]

Runner = Callable[[list[str]], str]


class Unmeasured(RuntimeError):
    """nvidia-smi is missing, failed, or does not list one of the GPUs."""


def run_nvidia_smi(argv: list[str]) -> str:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        raise Unmeasured(
            "nvidia-smi not found: the NVIDIA runtime injects it with the 'utility' driver "
            "capability (NVIDIA_DRIVER_CAPABILITIES=compute,utility)"
        )
    try:
        res = subprocess.run(
            [binary, *argv], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unmeasured(f"nvidia-smi: {e}") from e
    if res.returncode != 0:
        raise Unmeasured(f"nvidia-smi exited {res.returncode}: {res.stderr.strip()[-300:]}")
    return res.stdout


def parse(output: str) -> dict[str, int]:
    """GPU UUID -> bytes in use, from `nvidia-smi --query-gpu=uuid,memory.used` (MiB)."""
    out = {}
    for line in output.splitlines():
        uuid, sep, used = line.partition(",")
        if not sep:
            continue
        try:
            out[uuid.strip()] = int(float(used.strip())) * MIB
        except ValueError as e:
            raise Unmeasured(f"nvidia-smi answered {line.strip()!r}") from e
    return out


def used_bytes(gpus: Sequence[str], run: Runner = run_nvidia_smi) -> int:
    """Device memory in use on these GPUs (by UUID), summed. Raises Unmeasured."""
    per_gpu = parse(run(QUERY))
    missing = [g for g in gpus if g not in per_gpu]
    if missing or not gpus:
        raise Unmeasured(
            f"nvidia-smi does not list {', '.join(missing) or 'any GPU of this pod'} "
            f"(it lists {', '.join(sorted(per_gpu)) or 'none'})"
        )
    return sum(per_gpu[g] for g in gpus)
