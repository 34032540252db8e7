"""Write a verified checkpoint out to shared storage, for other caches to pull.

The published copy is for transport only: whoever can mount that storage can
change it, so nothing ever runs from it. A node cache takes it back in only
through verified_copy (every byte checked against the signed manifest as it is
read). Writing it therefore needs no care about readers, only about leaving
nothing half-written under the final name: the files go into a hidden sibling
directory first, which is renamed into place once complete.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from rekindle_contract.manifest import VERIFIED_NAME

from rekindle_store import verified_copy
from rekindle_store.verified_copy import CopyError

# Files of a cache entry never published: the cache's own bookkeeping, and the proof
# marker (unsigned; a pull writes it again from the manifest's signed record).
PRIVATE_NAMES = frozenset({".entry.json", VERIFIED_NAME})
_DIR_MODE = 0o755
_FILE_MODE = 0o444


@dataclass(frozen=True)
class Published:
    files: int
    bytes: int
    seconds: float


def publish(
    entry: Path, parent_fd: int, name: str, where: str, owner: tuple[int, int] | None = None
) -> Published:
    """Copy the checkpoint directory entry to name below parent_fd (created, must not exist).

    parent_fd: a directory opened without following links (where names it in
    errors). owner: (uid, gid) the copy is given to, the pod whose storage it
    is (its files stay read-only; it may remove them, as it may the directory
    it could always rename). Holes stay holes. Raises CopyError when name
    exists or is not a plain name.
    """
    if not name or "/" in name or name in (".", ".."):
        raise CopyError("bad_request", f"{where}/{name}: a plain directory name is needed")
    t0 = time.monotonic()
    if _exists(parent_fd, name):
        raise CopyError("exists", f"{where}/{name} exists: a checkpoint is published once")
    tmp = f".{name}.partial-{secrets.token_hex(4)}"
    os.mkdir(tmp, _DIR_MODE, dir_fd=parent_fd)
    try:
        tmp_fd = os.open(tmp, verified_copy.OPEN_DIR, dir_fd=parent_fd)
        try:
            files, size = _copy_tree(entry, tmp_fd, owner)
            if owner is not None:
                os.fchown(tmp_fd, *owner)
        finally:
            os.close(tmp_fd)
        os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except BaseException:
        _remove_below(parent_fd, tmp)
        raise
    return Published(files=files, bytes=size, seconds=time.monotonic() - t0)


def _exists(parent_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _copy_tree(src: Path, dst_fd: int, owner: tuple[int, int] | None) -> tuple[int, int]:
    files = size = 0
    for child in sorted(src.iterdir()):
        if child.name in PRIVATE_NAMES:
            continue
        st = child.lstat()
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(child.name, _DIR_MODE, dir_fd=dst_fd)
            sub = os.open(child.name, verified_copy.OPEN_DIR, dir_fd=dst_fd)
            try:
                f, b = _copy_tree(child, sub, owner)
                if owner is not None:
                    os.fchown(sub, *owner)
            finally:
                os.close(sub)
            files, size = files + f, size + b
        elif stat.S_ISREG(st.st_mode):
            size += _copy_file(child, dst_fd, owner)
            files += 1
    return files, size


def _copy_file(src: Path, dst_fd: int, owner: tuple[int, int] | None) -> int:
    flags = verified_copy.CREATE_NEW
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd_out = os.open(src.name, flags, _FILE_MODE, dir_fd=dst_fd)
        try:
            if owner is not None:
                os.fchown(fd_out, *owner)
            return verified_copy.copy_sparse(fd_in, fd_out)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _remove_below(parent_fd: int, name: str) -> None:
    """Remove name (a tree this module created) below parent_fd, following no link."""
    try:
        fd = os.open(name, verified_copy.OPEN_DIR, dir_fd=parent_fd)
    except OSError:
        return
    try:
        for child in os.listdir(fd):
            if stat.S_ISDIR(os.stat(child, dir_fd=fd, follow_symlinks=False).st_mode):
                _remove_below(fd, child)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)
