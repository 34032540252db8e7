"""A cuda-checkpoint work-alike over the CUDA driver's checkpoint API (ctypes, libcuda only).

Why: the runtime GPU image ships NVIDIA's cuda-checkpoint binary, fetched at
image build time from NVIDIA's repository. A lent GPU machine here reaches no
network, so the device probe (gpu_probe.py) cannot fetch it; CRIU's CUDA
plugin only needs a `cuda-checkpoint` on PATH that answers the same command
lines (-h, --get-state, --get-restore-tid, --action lock|checkpoint|restore|
unlock, --timeout). This module answers them by calling the documented driver
functions (cuCheckpointProcess*, driver r570 and later), and adds
--device-map OLD=NEW[,...] (GPU UUIDs) for restore, the remapping the driver
takes as CUcheckpointRestoreArgs.gpuPairs.

Dev tooling: never installed in an image.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import uuid
from collections.abc import Sequence

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
HELP = """usage: cuda-checkpoint [--get-state | --get-restore-tid | --action ACTION] --pid PID
  --action - execute an action: lock, checkpoint, restore, unlock
  --timeout MS - lock timeout
  --device-map OLD=NEW[,OLD=NEW] - restore onto other GPUs (UUIDs, GPU-... form)
"""


class CudaError(RuntimeError):
    pass


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("old", _Uuid), ("new", _Uuid)]


class _LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeout_ms", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("r", ctypes.c_uint64 * 7),
    ]


class _Reserved(ctypes.Structure):
    """CUcheckpointCheckpointArgs and CUcheckpointUnlockArgs: 64 zero bytes."""

    _fields_ = [("r", ctypes.c_uint64 * 8)]


class _RestoreArgs(ctypes.Structure):
    """gpuPairs, gpuPairsCount, then zeros to 64 bytes (every layout since r570)."""

    _fields_ = [
        ("pairs", ctypes.POINTER(_GpuPair)),
        ("count", ctypes.c_uint),
        ("pad", ctypes.c_ubyte * (64 - 8 - 4)),
    ]


class Driver:
    """The few driver calls a checkpoint needs; cuInit first (restore requires it)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise CudaError(f"{what}: {(name.value or b'?').decode()} ({rc})")

    def state(self, pid: int) -> str:
        s = ctypes.c_int()
        self._check(self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(s)), "get-state")
        return STATES.get(s.value, f"unknown({s.value})")

    def restore_tid(self, pid: int) -> int:
        tid = ctypes.c_int()
        rc = self.lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid))
        self._check(rc, "get-restore-tid")
        return tid.value

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        args = _LockArgs(timeout_ms=timeout_ms)
        self._check(self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args)), "lock")

    def checkpoint(self, pid: int) -> None:
        rc = self.lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(_Reserved()))
        self._check(rc, "checkpoint")

    def restore(self, pid: int, device_map: Sequence[tuple[str, str]] = ()) -> None:
        pairs = (_GpuPair * max(len(device_map), 1))()
        for i, (old, new) in enumerate(device_map):
            pairs[i].old.bytes[:] = uuid_bytes(old)
            pairs[i].new.bytes[:] = uuid_bytes(new)
        args = _RestoreArgs()
        if device_map:
            args.pairs = ctypes.cast(pairs, ctypes.POINTER(_GpuPair))
            args.count = len(device_map)
        self._check(self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)), "restore")

    def unlock(self, pid: int) -> None:
        rc = self.lib.cuCheckpointProcessUnlock(pid, ctypes.byref(_Reserved()))
        self._check(rc, "unlock")

    def gpu_uuids(self) -> list[str]:
        """Every visible GPU's UUID, in CUDA's device order, as nvidia-smi prints them."""
        n = ctypes.c_int()
        self._check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        out = []
        for i in range(n.value):
            u = _Uuid()
            self._check(self.lib.cuDeviceGetUuid_v2(ctypes.byref(u), i), "cuDeviceGetUuid")
            out.append("GPU-" + str(uuid.UUID(bytes=bytes(u.bytes))))
        return out


def uuid_bytes(gpu: str) -> list[int]:
    """'GPU-xxxxxxxx-...' (nvidia-smi's form) -> its 16 bytes."""
    return list(uuid.UUID(gpu.removeprefix("GPU-")).bytes)


def parse_device_map(text: str) -> list[tuple[str, str]]:
    """'OLD=NEW,OLD=NEW' -> [(OLD, NEW), ...]; each side a GPU UUID."""
    pairs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        old, sep, new = item.partition("=")
        if not sep:
            raise ValueError(f"--device-map entry {item!r}: want OLD_UUID=NEW_UUID")
        uuid_bytes(old), uuid_bytes(new)  # each must parse
        pairs.append((old, new))
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP, end="")
        return 0
    p = argparse.ArgumentParser(prog="cuda-checkpoint", add_help=False)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--get-state", action="store_true")
    what.add_argument("--get-restore-tid", action="store_true")
    what.add_argument("--action", choices=("lock", "checkpoint", "restore", "unlock"))
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--timeout", type=int, default=0)
    p.add_argument("--device-map", default="")
    a = p.parse_args(argv)
    try:
        drv = Driver()
        if a.get_state:
            print(drv.state(a.pid))
        elif a.get_restore_tid:
            print(drv.restore_tid(a.pid))
        elif a.action == "lock":
            drv.lock(a.pid, a.timeout)
        elif a.action == "checkpoint":
            drv.checkpoint(a.pid)
        elif a.action == "restore":
            drv.restore(a.pid, parse_device_map(a.device_map))
        else:
            drv.unlock(a.pid)
    except (CudaError, OSError, ValueError) as e:
        print(f"cuda-checkpoint: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
