"""Keep io_uring out of vLLM's process tree, per process, without a host sysctl.

CRIU cannot dump io_uring instances, and uvloop (vLLM's API server event loop)
opens one even with UV_USE_IO_URING=0. Rather than `kernel.io_uring_disabled`
(host-wide), vLLM runs under a seccomp filter that answers io_uring_setup with
ENOSYS, so libuv falls back to epoll. Filters survive fork and exec, so every
process of the tree (API server, engine core, workers) inherits it, and CRIU
dumps and restores the filter with the tree.

Used as an exec wrapper: `python -m rekindle_agent.confinement.seccomp -- ARGV...` installs
the filter in itself and execs ARGV (same PID), which keeps the agent free of
preexec_fn (unsafe in a threaded parent).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

# <linux/filter.h>, <linux/seccomp.h>, <linux/audit.h>
BPF_LD_W_ABS = 0x20
BPF_JMP_JEQ_K = 0x15
BPF_RET_K = 0x06
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
ENOSYS = 38
# io_uring_setup on x86_64 (and the same number on aarch64 and every arch since 5.1).
IO_URING_SETUP = 425


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def deny_program(syscalls: list[int], arch: int = AUDIT_ARCH_X86_64, errno: int = ENOSYS) -> bytes:
    """A classic-BPF seccomp program: on `arch`, syscalls in the list fail with errno.

    Everything else, including other architectures' calls, is allowed: the
    filter only exists to make one feature fall back, not to sandbox.
    """
    n = len(syscalls)
    prog = [
        _insn(BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        _insn(BPF_JMP_JEQ_K, 0, n + 1, arch),  # other arch: jump to ALLOW
        _insn(BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    for i, nr in enumerate(syscalls):
        prog.append(_insn(BPF_JMP_JEQ_K, n - i, 0, nr))  # match: jump to ERRNO
    prog.append(_insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    prog.append(_insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | (errno & 0xFFFF)))
    return b"".join(prog)


def io_uring_program() -> bytes:
    return deny_program([IO_URING_SETUP, IO_URING_SETUP | X32_SYSCALL_BIT])


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_io_uring_filter() -> None:
    """Install the filter in the calling process (and all its future children)."""
    if platform.machine() != "x86_64":
        raise OSError(f"seccomp io_uring filter is written for x86_64, not {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    prog = io_uring_program()
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def wrap(argv: list[str], python: str = sys.executable) -> list[str]:
    """argv run under the filter."""
    return [python, "-m", "rekindle_agent.confinement.seccomp", "--", *argv]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(
            "usage: python -m rekindle_agent.confinement.seccomp -- COMMAND [ARGS...]",
            file=sys.stderr,
        )
        return 2
    install_io_uring_filter()
    os.execvp(args[0], args)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
