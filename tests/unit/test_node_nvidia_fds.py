"""nvidia_fds: which descriptors and mappings of a process are NVIDIA device files.

The scan reads /proc/PID/fd and /proc/PID/maps; here a directory laid out the same
way stands in for /proc (descriptors are symlinks to their targets there too), so
every kind of NVIDIA file can be named without a driver. On a GPU the same scan ran
on real PyTorch processes (docs/bench/gpu/results.json).
"""

from __future__ import annotations

import os
from pathlib import Path

from rekindle_node import nvidia_fds

MAPS = """\
7f0000000000-7f0000200000 rw-s 00000000 00:05 12 /dev/nvidia0
7f0000200000-7f0000400000 rw-s 00000000 00:05 12 /dev/nvidia0
7f0000400000-7f0000600000 rw-s 00000000 00:05 9 /dev/nvidia-uvm
7f0000600000-7f0000800000 r-xp 00000000 08:01 77 /usr/lib/x86_64-linux-gnu/libcuda.so.1
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
"""


def fake_proc(root: Path, pid: int, fds: dict[int, str], maps: str = "") -> Path:
    fd_dir = root / str(pid) / "fd"
    fd_dir.mkdir(parents=True)
    for fd, target in fds.items():
        os.symlink(target, fd_dir / str(fd))
    (root / str(pid) / "maps").write_text(maps)
    return root


def test_every_kind_of_nvidia_file_is_named_and_nothing_else(tmp_path: Path) -> None:
    fds = {
        3: "/dev/nvidiactl",
        4: "/dev/nvidia0",
        5: "/dev/nvidia-uvm",
        6: "/dev/nvidia-uvm-tools",
        7: "/dev/nvidia-caps/nvidia-cap1",
        8: "/dev/nvidia-modeset",
        9: "/dev/null",
        10: "socket:[1234]",
        11: "/dev/nvidia-fake0",
    }
    proc = fake_proc(tmp_path, 42, fds, MAPS)
    found = nvidia_fds.scan(42, proc)
    assert [(h.fd, h.kind) for h in found] == [
        (3, "control"),
        (4, "gpu"),
        (5, "uvm"),
        (6, "uvm-tools"),
        (7, "capability"),
        (8, "modeset"),
        (None, "uvm"),  # mappings after descriptors, by path
        (None, "gpu"),  # /dev/nvidia0 mapped twice: named once
    ]
    assert str(found[0]) == "pid 42 fd 3: /dev/nvidiactl (control)"
    assert str(found[-1]) == "pid 42 a mapping: /dev/nvidia0 (gpu)"


def test_a_released_process_has_nothing_and_a_gone_one_is_no_error(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 7, {0: "/dev/null", 1: "/tmp/log"}, MAPS.splitlines()[3] + "\n")
    assert nvidia_fds.scan(7, proc) == []
    assert nvidia_fds.scan(8, proc) == []  # no such process (exited meanwhile)
    fake_proc(tmp_path, 9, {3: "/dev/nvidiactl"})
    assert [h.pid for h in nvidia_fds.scan_tree([7, 8, 9], proc)] == [9]


def test_the_refusal_names_what_is_open_and_what_to_do(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 5, {n: "/dev/nvidia0" for n in range(3, 13)})
    msg = nvidia_fds.leftover_message(nvidia_fds.scan(5, proc))
    assert msg.startswith("NVIDIA device files still open after CUDA released the GPU: ")
    assert "pid 5 fd 3: /dev/nvidia0 (gpu)" in msg and "(and 2 more)" in msg
    assert "nvmlShutdown()" in msg


def test_our_own_process_really_scans(tmp_path: Path) -> None:
    """The real /proc: this process has no NVIDIA file open, and reading it works."""
    with open(os.devnull) as f:
        assert f.fileno() >= 0
        assert nvidia_fds.scan(os.getpid()) == []
