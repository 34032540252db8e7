"""The immutable attribute (chattr +i) on a checkpoint's mapped files, and removal past it.

Restored processes map pages-*.img, and a reloaded vLLM worker maps the
weight dump (weights/weights-rank*.bin), for their whole life: a write,
truncate or rename over the file would change or kill their memory, and root
ignores file modes. The immutable flag stops every writer, root included, until someone
with CAP_LINUX_IMMUTABLE clears it, which only the checkpoint's deletion
does. File systems without the flag (for example NFS, older tmpfs) keep the
0400 mode only; the caller reports that.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import stat
from pathlib import Path

# linux/fs.h, 64-bit: _IOR('f', 1, long) and _IOW('f', 2, long); the kernel reads an int.
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010
_UNSUPPORTED = (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def _flags(fd: int) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
    return buf[0]


def _open(path: Path) -> int:
    """Read-only is enough for the flag ioctls; never through a symlink."""
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)


def set_immutable(path: Path, on: bool = True) -> bool:
    """Set (or clear) the flag on one file. False where the file system has no such flag;
    EPERM (no CAP_LINUX_IMMUTABLE) raises."""
    fd = _open(path)
    try:
        try:
            old = _flags(fd)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                return False
            raise
        new = old | FS_IMMUTABLE_FL if on else old & ~FS_IMMUTABLE_FL
        if new != old:
            try:
                fcntl.ioctl(fd, FS_IOC_SETFLAGS, array.array("i", [new]), True)
            except OSError as e:
                if e.errno in _UNSUPPORTED:
                    return False
                raise
        return True
    finally:
        os.close(fd)


def is_immutable(path: Path) -> bool:
    try:
        fd = _open(path)
    except OSError:
        return False
    try:
        return bool(_flags(fd) & FS_IMMUTABLE_FL)
    except OSError:
        return False
    finally:
        os.close(fd)


def protect_pages(images: Path) -> list[str]:
    """chattr +i on every pages-*.img; returns what could not be protected, and why."""
    return _protect(sorted(images.glob("pages-*.img")))


def protect_weights(weights: Path) -> list[str]:
    """chattr +i on every file of the weight dump (data and index); what could not be, and why.

    A reload may map the dump's data file into the server's memory (privately,
    for the server's life), like the mmap restore maps pages images: the same
    protection, and the reload maps only a dump whose data file carries the flag.
    """
    return _protect(sorted(p for p in weights.glob("weights-rank*") if p.is_file()))


def _protect(paths: list[Path]) -> list[str]:
    failed = []
    for p in paths:
        try:
            if not set_immutable(p):
                failed.append(f"{p.name}: the file system has no immutable flag")
        except OSError as e:
            failed.append(f"{p.name}: {e.strerror or e}")
    return failed


def remove_tree(root: Path) -> None:
    """rm -rf --one-file-system that clears the immutable flag first.

    Symlinks are removed, never followed; directories on another file system
    (a mount below root) are left alone. Unlinking a file that replicas still
    map is safe: the kernel keeps its data until the last mapping goes. What
    vanishes meanwhile (another remover of the same tree, e.g. a second cleanup
    Job) is simply gone already.
    """
    try:
        top = os.lstat(root)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(top.st_mode):
        _unlink(root)
        return
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        d = Path(dirpath)
        if _device(d) != top.st_dev:
            continue
        for name in filenames + [n for n in dirnames if os.path.islink(d / n)]:
            _unlink(d / name)
        for name in dirnames:
            sub = d / name
            if not os.path.islink(sub) and _device(sub) == top.st_dev:
                _rmdir(sub)
    _rmdir(root)


def _device(p: Path) -> int | None:
    """p's st_dev, None once it is gone."""
    try:
        return os.lstat(p).st_dev
    except FileNotFoundError:
        return None


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
    except PermissionError:
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                set_immutable(p, False)
            os.unlink(p)
        except FileNotFoundError:
            pass


def _rmdir(p: Path) -> None:
    try:
        os.rmdir(p)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno == errno.ENOTEMPTY:
            raise OSError(e.errno, f"{p} is not empty (a mount below it?)") from e
        raise
