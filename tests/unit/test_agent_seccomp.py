"""The io_uring seccomp filter: its BPF shape, and that it really makes io_uring_setup fail."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import subprocess
import sys

import pytest
from rekindle_agent.confinement import seccomp

PROBE = (
    "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
    "buf = ctypes.create_string_buffer(120); "
    "r = libc.syscall(425, 4, buf); e = ctypes.get_errno(); "
    "print(r, e)"
)


def _insns(prog: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]


def _run_filter(prog: bytes, arch: int, nr: int) -> int:
    """A tiny classic-BPF interpreter for the subset the filter uses."""
    data = {0: nr, 4: arch}
    acc, pc = 0, 0
    insns = _insns(prog)
    while True:
        code, jt, jf, k = insns[pc]
        if code == seccomp.BPF_LD_W_ABS:
            acc = data[k]
            pc += 1
        elif code == seccomp.BPF_JMP_JEQ_K:
            pc += 1 + (jt if acc == k else jf)
        elif code == seccomp.BPF_RET_K:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


def test_program_denies_only_io_uring_setup() -> None:
    prog = seccomp.io_uring_program()
    deny = seccomp.SECCOMP_RET_ERRNO | errno.ENOSYS
    x86 = seccomp.AUDIT_ARCH_X86_64
    assert _run_filter(prog, x86, 425) == deny
    assert _run_filter(prog, x86, 425 | seccomp.X32_SYSCALL_BIT) == deny
    for nr in (0, 1, 2, 59, 232, 424, 426, 427, 435):
        assert _run_filter(prog, x86, nr) == seccomp.SECCOMP_RET_ALLOW
    assert _run_filter(prog, 0xC00000B7, 425) == seccomp.SECCOMP_RET_ALLOW  # aarch64


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="filter is x86_64-only")
def test_wrapper_makes_io_uring_setup_fail_with_enosys() -> None:
    out = subprocess.run(
        seccomp.wrap([sys.executable, "-c", PROBE]), capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["-1", str(errno.ENOSYS)]
    # Without the filter the kernel answers differently (a ring fd, or EPERM if disabled).
    plain = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    assert plain != ["-1", str(errno.ENOSYS)]
    if int(plain[0]) >= 0:
        assert ctypes.sizeof(ctypes.c_int) == 4  # a real ring was created without the filter


def test_wrapper_without_command_is_a_usage_error() -> None:
    assert seccomp.main(["--"]) == 2
