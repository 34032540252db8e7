"""A read-only view of the checkpoint a pod restores from, inside the pod only.

Every replica of a service mounts the service's checkpoint directory
read-write, because any of them may be the one asked to checkpoint, and the
directory a new checkpoint goes to is chosen after the pod exists. The
checkpoint a pod restores from is known when it starts, though: the agent
bind-mounts that directory read-only over itself in the container's own mount
namespace before CRIU runs, so nothing in the pod (vLLM included) can change
the files its memory is mapped from, while new checkpoints still go next to
it. Kubernetes keeps the container's mounts private, so the node and other pods
see nothing of this.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else None
    if _libc.mount(src, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def bind_read_only(path: Path) -> None:
    """Make path read-only in this mount namespace (a bind mount of itself, remounted ro)."""
    target = os.path.realpath(path)
    _mount(target, target, MS_BIND | MS_REC)
    _mount(None, target, MS_REMOUNT | MS_BIND | MS_RDONLY)


def is_read_only_mount(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """True if path is itself a mount point whose mount options include ro."""
    target = os.path.realpath(path)
    found = False
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and _unescape(fields[4]) == target:
            found = "ro" in fields[5].split(",")  # the last such mount is the one on top
    return found


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field
