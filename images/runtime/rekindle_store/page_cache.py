"""Page-cache residency of a file, by mincore(2): how much of a checkpoint a read
would find in memory. The node cache reports it per checkpoint; the in-pod
agent's residency module builds its reports and budgets on it."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

PAGE = os.sysconf("SC_PAGE_SIZE")


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def mincore_pages(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(resident pages, total pages) of one file by mincore(2) on a read-only mapping."""
    size = os.stat(path).st_size
    if size == 0:
        return 0, 0
    pages = (size + PAGE - 1) // PAGE
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec.raw), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
