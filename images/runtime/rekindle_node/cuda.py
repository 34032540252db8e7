"""The node agent's own cuda-checkpoint, run around its CRIU for a tree that uses a GPU.

Why not CRIU's CUDA plugin: the node agent runs CRIU inside the pod's mount
namespace (criu_run), where the plugin would exec the `cuda-checkpoint` it finds
on the pod's PATH, which loads the pod's libcuda: binaries the tenant controls,
run as root. So the node agent runs its own cuda-checkpoint, in its own
namespaces, on the tree's host pids, in the order NVIDIA documents for
cuda-checkpoint with CRIU:

  dump     every CUDA process locked, then checkpointed (device memory moves into
           host memory and the process holds no GPU resource), then CRIU dumps a
           plain CPU tree; if CRIU fails the processes are restored and unlocked,
           and the tree serves on.
  restore  CRIU restores the tree, then every CUDA process is restored onto the
           pod's GPUs (--device-map, from the kubelet's allocation) and unlocked,
           and must then report `running`.

Processes are named by their pid in the pod (what the manifest records, the same
after a restore: CRIU recreates them) and translated to host pids here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rekindle_node import nvidia_fds
from rekindle_node.identity import proc_status

PROC = Path("/proc")
RUNNING = "running"


class CudaError(RuntimeError):
    """cuda-checkpoint refused or failed; the message names the process and the action."""


@dataclass(frozen=True)
class CudaCheckpoint:
    """The node agent's cuda-checkpoint binary (never one of the pod's)."""

    binary: Path
    timeout: float = 120.0

    def _run(self, args: list[str]) -> str:
        try:
            res = subprocess.run(
                [str(self.binary), *args],
                capture_output=True,
                text=True,
                timeout=self.timeout,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise CudaError(
                f"cuda-checkpoint {' '.join(args)}: no answer in {self.timeout:g}s"
            ) from e
        except OSError as e:
            raise CudaError(f"cannot run {self.binary}: {e}") from e
        if res.returncode != 0:
            why = (res.stderr or res.stdout).strip()[-300:]
            raise CudaError(f"cuda-checkpoint {' '.join(args)} exited {res.returncode}: {why}")
        return res.stdout

    def state(self, pid: int) -> str:
        return self._run(["--get-state", "--pid", str(pid)]).strip()

    def action(self, action: str, pid: int, device_map: str = "") -> None:
        args = ["--action", action, "--pid", str(pid)]
        if device_map:
            args += ["--device-map", device_map]
        self._run(args)


def host_pids(pod_init: int, proc: Path = PROC) -> dict[int, int]:
    """pid in the pod's pid namespace -> host pid, for every process of that namespace
    (pod_init: the host pid of any process of it, the node agent gives its PID 1).
    NSpid lists a process's pid in each namespace it is in, the innermost last."""
    target = os.stat(proc / str(pod_init) / "ns" / "pid").st_ino
    out = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry / "ns" / "pid").st_ino != target:
                continue
            nspid = proc_status(proc, int(entry.name))["NSpid"].split()
        except (OSError, KeyError):
            continue  # gone, or a kernel thread
        out[int(nspid[-1])] = int(entry.name)
    return out


def uses_gpu(host_pid: int, proc: Path = PROC) -> bool:
    """Whether the process maps or holds an NVIDIA device file (a CUDA context)."""
    return bool(nvidia_fds.scan(host_pid, proc))


def gpu_tree(
    pod_init: int, root: int, proc: Path = PROC, uses: Callable[[int], bool] | None = None
) -> dict[int, int]:
    """The processes of the tree rooted at root (its pid in the pod) that use a GPU
    (uses, by host pid: uses_gpu by default): pod pid -> host pid."""
    uses = uses or (lambda pid: uses_gpu(pid, proc))
    table = host_pids(pod_init, proc)
    if root not in table:
        raise CudaError(f"pid {root} is not running in the pod")
    by_host = {h: p for p, h in table.items()}
    out = {}
    for pod_pid, host in table.items():
        current, seen = host, 0
        while current in by_host and seen < 4096:
            if current == table[root]:
                if uses(host):
                    out[pod_pid] = host
                break
            try:
                current = int(proc_status(proc, current)["PPid"])
            except (OSError, KeyError, ValueError):
                break
            seen += 1
    return dict(sorted(out.items()))


def translate(pod_pids: Iterable[int], pod_init: int, proc: Path = PROC) -> list[int]:
    """Host pids of these pod pids; CudaError naming any the pod does not run."""
    table = host_pids(pod_init, proc)
    missing = [p for p in pod_pids if p not in table]
    if missing:
        raise CudaError(f"pid(s) {missing} not running in the pod (pid 1 is host pid {pod_init})")
    return [table[p] for p in pod_pids]


def checkpoint(tool: CudaCheckpoint, pids: Sequence[int], proc: Path = PROC) -> None:
    """Lock every process, then checkpoint each (host pids); then no NVIDIA device file
    may be left open or mapped in them (CUDA released its own; an NVML handle never shut
    down would fail CRIU's dump), each leftover named. On a failure what was done is
    undone (undo) and CudaError raised: the tree serves on."""
    try:
        for pid in pids:
            tool.action("lock", pid)
        for pid in pids:
            tool.action("checkpoint", pid)
        handles = nvidia_fds.scan_tree(pids, proc)
        if handles:
            raise CudaError(nvidia_fds.leftover_message(handles))
    except CudaError as e:
        failed = undo(tool, pids)
        raise CudaError(f"{e}{'; undo failed: ' + failed if failed else ''}") from e


def resume(tool: CudaCheckpoint, pids: Sequence[int], device_map: str) -> None:
    """Restore every process onto its GPUs, unlock each, and check it runs (host pids)."""
    for pid in pids:
        tool.action("restore", pid, device_map)
    for pid in pids:
        tool.action("unlock", pid)
    for pid in pids:
        state = tool.state(pid)
        if state != RUNNING:
            raise CudaError(f"process {pid} is {state!r} after restore and unlock, not running")


def undo(tool: CudaCheckpoint, pids: Sequence[int]) -> str:
    """Bring each process back to running from wherever the checkpoint left it (no
    device map: the GPU it never left). "" on success, else what failed."""
    failed = []
    for pid in pids:
        try:
            state = tool.state(pid)
            if state == "checkpointed":
                tool.action("restore", pid)
                state = "locked"
            if state == "locked":
                tool.action("unlock", pid)
        except CudaError as e:
            failed.append(str(e))
    return "; ".join(failed)


def kill(pids: Iterable[int]) -> None:
    """SIGKILL a restored tree whose GPU state did not come back (it cannot serve)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
