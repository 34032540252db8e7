"""The /dev/shm files vLLM's tree uses: find, save, recreate, clear.

CRIU stores only references to POSIX shm files (psm_*, sem.mp-*, vLLM's
message-queue and cache segments), not their content. A restore in a fresh pod
(an empty /dev/shm) needs them recreated, byte for byte and at the same size,
before `criu restore`. Copies keep holes: vLLM's ring buffers are mostly sparse.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Any

from rekindle_agent.process_tree import proctree

SHM = "/dev/shm"
CHUNK = 8 << 20


def tree_shm_files(pids: list[int], shm_dir: str = SHM, proc: Path = proctree.PROC) -> set[str]:
    """Base names of files in shm_dir that the processes map or hold open.

    Deleted ones are included (CRIU's --link-remap keeps them reachable);
    their ' (deleted)' suffix is stripped.
    """
    prefix = shm_dir.rstrip("/") + "/"
    names: set[str] = set()
    for pid in pids:
        paths = set(proctree.mapped_paths(pid, proc)) | set(proctree.fd_targets(pid, proc).values())
        for p in paths:
            if p.startswith(prefix):
                name = p[len(prefix) :].removesuffix(" (deleted)")
                if name and "/" not in name:
                    names.add(name)
    return names


def copy_sparse(src: str, dst: str, mode: int | None = None, exclusive: bool = False) -> int:
    """Copy src to dst keeping holes (SEEK_DATA/SEEK_HOLE); returns bytes of data copied.

    exclusive: dst must not exist and is never followed as a symlink (a restore
    writes into /dev/shm, which other containers of the pod share).
    """
    copied = 0
    sfd = os.open(src, os.O_RDONLY)
    try:
        size = os.fstat(sfd).st_size
        flags = os.O_WRONLY | os.O_CREAT
        flags |= os.O_EXCL | os.O_NOFOLLOW if exclusive else os.O_TRUNC
        dfd = os.open(dst, flags, 0o600 if mode is None else mode)
        try:
            os.ftruncate(dfd, size)
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(sfd, pos, os.SEEK_DATA)
                except OSError as e:
                    if e.errno == errno.ENXIO:  # only a hole is left
                        break
                    raise
                end = os.lseek(sfd, start, os.SEEK_HOLE)
                off = start
                while off < end:
                    buf = os.pread(sfd, min(CHUNK, end - off), off)
                    if not buf:
                        break
                    os.pwrite(dfd, buf, off)
                    off += len(buf)
                    copied += len(buf)
                pos = end
            if mode is not None:
                os.fchmod(dfd, mode)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return copied


def save(names: set[str], dest: Path, shm_dir: str = SHM) -> list[dict[str, object]]:
    """Copy the named shm files into dest; returns their records for the manifest."""
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    records = []
    for name in sorted(names):
        src = os.path.join(shm_dir, name)
        try:
            st = os.stat(src)
        except FileNotFoundError:
            continue  # unlinked and not link-remapped: CRIU keeps it in the image (ghost)
        if not stat.S_ISREG(st.st_mode):
            continue
        copy_sparse(src, str(dest / name), mode=0o600)
        records.append(
            {
                "name": name,
                "size": st.st_size,
                "mode": stat.S_IMODE(st.st_mode) & 0o777,
                "uid": st.st_uid,
                "gid": st.st_gid,
            }
        )
    return records


def recreate(records: list[dict[str, Any]], src: Path, shm_dir: str = SHM) -> int:
    """Put the saved files back into shm_dir with their owner and a safe mode; data bytes.

    The records come from a validated manifest (manifest_io.validate_paths):
    each name is one file name, each mode without setuid/setgid/sticky; the
    mode is masked to at most rwxr-xr-x here as well.
    """
    total = 0
    for rec in records:
        name = str(rec["name"])
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"shm file name {name!r} is not a single file name")
        mode = int(rec["mode"])
        if mode & 0o7000:
            raise ValueError(f"shm file {name!r}: mode {mode:o} has setuid/setgid/sticky bits")
        dst = os.path.join(shm_dir, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        total += copy_sparse(str(src / name), dst, mode=mode & 0o755, exclusive=True)
        with contextlib.suppress(PermissionError):
            os.chown(dst, int(rec.get("uid", 0)), int(rec.get("gid", 0)), follow_symlinks=False)
    return total


def remove(names: list[str], shm_dir: str = SHM) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, name))


def clear_stale(shm_dir: str = SHM, in_use: set[str] | None = None) -> list[str]:
    """Delete every regular file in shm_dir not in in_use; returns what was removed.

    In a pod /dev/shm is the pod's own memory-backed emptyDir, and it survives
    container restarts: files left by a crashed vLLM would fill it (and count
    against the pod's memory) on every restart, turning one crash into a loop.
    """
    removed = []
    keep = in_use or set()
    for entry in os.scandir(shm_dir):
        if entry.name in keep or not entry.is_file(follow_symlinks=False):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(entry.name)
    return sorted(removed)
