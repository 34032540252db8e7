"""Detecting io_uring in a process tree, with a fake /proc and with a real ring."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rekindle_agent import io_uring

RING = (
    "import ctypes, sys, time; libc = ctypes.CDLL(None, use_errno=True); "
    "buf = ctypes.create_string_buffer(120); fd = libc.syscall(425, 4, buf); "
    "print(fd, flush=True); time.sleep(30)"
)


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
    p = subprocess.Popen([sys.executable, "-c", RING], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        fd = int(p.stdout.readline())
        if fd < 0:
            pytest.skip("io_uring is disabled on this kernel")
        time.sleep(0.05)
        found = io_uring.find([p.pid])
        assert any(what.startswith(f"fd {fd} ") for _pid, what in found)
        assert io_uring.find([os.getpid()]) == []
    finally:
        p.kill()
        p.wait()
