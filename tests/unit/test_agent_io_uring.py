"""Detecting io_uring in a process tree, with a fake /proc and with a real ring."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rekindle_agent.confinement import io_uring
from rekindle_dev.testenv import require

# A child that creates a real ring (io_uring_setup, x86_64 syscall 425), maps its SQ
# ring (what liburing does), prints "fd errno", then waits for its stdin to close.
RING = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
fd = libc.syscall(425, 4, ctypes.create_string_buffer(120))
err = ctypes.get_errno() if fd < 0 else 0
if fd >= 0 and libc.mmap(None, 4096, 3, 1, fd, 0) in (None, ctypes.c_void_p(-1).value):
    fd, err = -1, ctypes.get_errno()
print(fd, err, flush=True)
sys.stdin.read()
"""


def test_fake_proc(tmp_path: Path) -> None:
    fd_dir = tmp_path / "42" / "fd"
    fd_dir.mkdir(parents=True)
    os.symlink("anon_inode:[io_uring]", fd_dir / "7")
    os.symlink("/dev/null", fd_dir / "0")
    (tmp_path / "42" / "maps").write_text(
        "7f00-7f10 rw-s 00000000 00:0e 1  anon_inode:[io_uring]\n"
    )
    (tmp_path / "43" / "fd").mkdir(parents=True)
    (tmp_path / "43" / "maps").write_text("")
    found = io_uring.find([42, 43], proc=tmp_path)
    assert (42, "fd 7 -> anon_inode:[io_uring]") in found
    assert all(pid == 42 for pid, _ in found)
    msg = io_uring.error_message(found)
    assert "seccomp" in msg and "io_uring_disabled" in msg


def test_real_ring_is_found() -> None:
    """A real ring, fd and mapping, is found; this process, which has none, is clean.

    Needs a kernel that lets this process create a ring (kernel.io_uring_disabled 0,
    or 1 as root): without one the detector cannot be shown to see a real ring.
    """
    require("io_uring")
    p = subprocess.Popen(
        [sys.executable, "-c", RING], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        fd, err = (int(x) for x in p.stdout.readline().split())
        assert fd >= 0, f"io_uring_setup or mmap of the ring failed: {os.strerror(err)}"
        found = io_uring.find([p.pid])
        assert sorted(what for _pid, what in found) == [
            f"fd {fd} -> anon_inode:[io_uring]",
            "mapping anon_inode:[io_uring]",
        ], found
        assert {pid for pid, _ in found} == {p.pid}
        assert io_uring.find([os.getpid()]) == []
    finally:
        p.kill()
        p.wait()
