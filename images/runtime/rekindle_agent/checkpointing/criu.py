"""CRIU command lines for vLLM's tree, and what the installed CRIU can do.

Flags, and why (each one was needed on a real vLLM CPU server):
  --shell-job        the tree's session/pgrp leader may be outside it (shell, agent)
  --tcp-established  tolerate established TCP connections in the tree. Observed:
                     vLLM CPU's tree holds 14 listening loopback sockets (its port,
                     torch.distributed and ZMQ) and no established connection once
                     the agent has closed its proxy connections, which it does
                     before every dump; the flag keeps a stray one from failing it
  --ext-unix-sk      unix sockets whose peer is outside the tree (e.g. /dev/log)
  --link-remap       deleted-but-open files (sem.mp-* are unlinked right after creation)
  --file-locks       vLLM's cache directories take flock()s
Dump does not pass --leave-running: on success CRIU kills the tree (the agent
restores it straight away), on failure CRIU resumes it, so a failed checkpoint
leaves vLLM serving.
Restore passes --leave-stopped: the restored tree does not run until the agent
has checked the memory pages and weights it restores from (restore.py), then
gets SIGCONT. Not with the CUDA plugin: CRIU 4.2.1's plugin resumes and
re-interrupts a thread of each task in its late hook, after CRIU has sent the
tasks SIGSTOP, and then waits forever (tests/criu/test_cuda_plugin.py shows it);
a GPU restore checks all the tree uses before CRIU runs instead.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

COMMON_FLAGS = ("--shell-job", "--tcp-established", "--ext-unix-sk", "--link-remap", "--file-locks")
MMAP_RESTORE_FLAG = "--mmap-restore"
# With --mmap-restore, map the heap (brk area) too; only for glibc-malloc-only trees.
MMAP_RESTORE_HEAP_FLAG = "--mmap-restore-heap"
LEAVE_STOPPED_FLAG = "--leave-stopped"


@dataclass(frozen=True)
class CriuInfo:
    binary: str
    version: str | None
    mmap_restore: bool
    mmap_restore_heap: bool = False


def parse_version(text: str) -> str | None:
    m = re.search(r"Version:\s*(\S+)", text)
    return m.group(1) if m else None


def supports_option(help_text: str, option: str) -> bool:
    """Whether `criu --help` lists option as a whole word."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text) is not None


def probe(binary: str) -> CriuInfo:
    """Ask the binary itself: never assume a patched build has the option."""
    try:
        ver = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20)
        hlp = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=20)
    except OSError as e:
        raise FileNotFoundError(
            f"CRIU binary {binary!r} cannot run ({e}); set --criu or REKINDLE_CRIU"
        ) from e
    help_text = hlp.stdout + hlp.stderr
    return CriuInfo(
        binary=binary,
        version=parse_version(ver.stdout + ver.stderr),
        mmap_restore=supports_option(help_text, MMAP_RESTORE_FLAG),
        mmap_restore_heap=supports_option(help_text, MMAP_RESTORE_HEAP_FLAG),
    )


def dump_argv(
    binary: str, pid: int, images: str, log_file: str, plugins: str | None = None
) -> list[str]:
    argv = [binary, "dump", "-t", str(pid), "-D", images, "-o", log_file, "-v4", *COMMON_FLAGS]
    if plugins:
        argv += ["-L", plugins]
    return argv


def restore_argv(
    binary: str,
    images: str,
    log_file: str,
    pidfile: str,
    mmap: bool = False,
    plugins: str | None = None,
    stopped: bool = False,
    mmap_heap: bool = False,
) -> list[str]:
    """Detached (-d): CRIU exits once the tree is in place; the root is re-parented to the
    agent. stopped: every task is left stopped (SIGSTOP) until the agent sends SIGCONT.
    The work dir (stats-restore) is the log's directory: the images are read-only.
    mmap_heap (with mmap only): map the heap too (mmap_policy.heap_decision)."""
    argv = [
        binary,
        "restore",
        "-d",
        "-D",
        images,
        "-W",
        os.path.dirname(log_file) or ".",
        "-o",
        log_file,
        "-v4",
        "--pidfile",
        pidfile,
        *COMMON_FLAGS,
    ]
    if mmap:
        argv.append(MMAP_RESTORE_FLAG)
        if mmap_heap:
            argv.append(MMAP_RESTORE_HEAP_FLAG)
    if stopped:
        argv.append(LEAVE_STOPPED_FLAG)
    if plugins:
        argv += ["-L", plugins]
    return argv


def log_tail(text: str, lines: int = 15) -> str:
    """The error lines of a CRIU log, for a status message a human can act on."""
    all_lines = text.splitlines()
    errs = [ln for ln in all_lines if "Error" in ln or "error" in ln]
    return "\n".join((errs or all_lines)[-lines:])


# ---------------------------------------------------------------- CRIU's own timing

# stats-restore (written to the work dir, -W): a CRIU image holding one protobuf
# message, stats_entry, whose field 2 is the restore's entry. Its fields (CRIU's
# images/stats.proto): 1 pages_compared, 2 pages_skipped_cow, 3 forking_time (us),
# 4 restore_time (us), 5 pages_restored (pages read into memory, not mapped).
_RESTORE_STATS_FIELDS = {
    1: "pages_compared",
    2: "pages_skipped_cow",
    3: "forking_us",
    4: "restore_us",
    5: "pages_restored",
}
_STATS_MAGIC = 0x57093306


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(msg: bytes) -> dict[int, int | bytes]:
    """The varint and length-delimited fields of one protobuf message (last one wins)."""
    out: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(msg):
        key, pos = _varint(msg, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            out[num], pos = _varint(msg, pos)
        elif wire == 2:
            n, pos = _varint(msg, pos)
            out[num] = msg[pos : pos + n]
            pos += n
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not expected in stats-restore")
    return out


def parse_restore_stats(data: bytes) -> dict[str, int]:
    """CRIU's own restore counters from its stats-restore file (no crit needed).

    Why: CRIU times its fork and its restore itself and counts the pages it
    read into memory (those not mapped by --mmap-restore); the profile and the
    benchmark split the agent's criu_restore phase with these. ValueError when
    data is not a stats image.
    """
    if len(data) < 12:
        raise ValueError("stats-restore is too short")
    magic = int.from_bytes(data[4:8], "little")
    if magic != _STATS_MAGIC:
        raise ValueError(f"not a CRIU stats image (magic {magic:#x})")
    size = int.from_bytes(data[8:12], "little")
    entry = _fields(data[12 : 12 + size]).get(2)
    if not isinstance(entry, bytes):
        raise ValueError("stats-restore holds no restore entry")
    return {
        name: value
        for num, value in _fields(entry).items()
        if (name := _RESTORE_STATS_FIELDS.get(num)) is not None and isinstance(value, int)
    }


_TS = re.compile(r"^\((\d+\.\d+)\)")
_PREADV = re.compile(r"pie: (\d+): Preadv ")
_RETURNED = re.compile(r"pie: (\d+): `- returned (\d+)")
_MAPPED = re.compile(r"(\d+): mmap-restore: 0x([0-9a-f]+)-0x([0-9a-f]+) from pages-")


def restore_log_profile(text: str) -> dict[str, float]:
    """Where a `-v4` restore log's time went, from its timestamps (seconds, bytes).

    Why: CRIU's stats give two totals; the log says what is inside them.
    setup_s: start to the first forked task (kernel feature probes,
    namespaces, reading the images); read_s: per task, the time from a Preadv
    to its result (memory CRIU copies from pages-*.img), the largest task's
    sum (tasks restore in parallel); read_bytes: bytes copied, all tasks;
    mapped_bytes: bytes --mmap-restore mapped instead; total_s: the log's
    last timestamp.
    """
    first_fork = total = 0.0
    pending: dict[str, float] = {}
    read_s: dict[str, float] = {}
    read_bytes = mapped = 0
    for line in text.splitlines():
        m = _TS.match(line)
        if not m:
            continue
        t = float(m.group(1))
        total = t
        if not first_fork and "Forking task with" in line:
            first_fork = t
        if (p := _PREADV.search(line)) is not None:
            pending[p.group(1)] = t
        elif (r := _RETURNED.search(line)) is not None and r.group(1) in pending:
            pid = r.group(1)
            read_s[pid] = read_s.get(pid, 0.0) + t - pending.pop(pid)
            read_bytes += int(r.group(2))
        elif (mm := _MAPPED.search(line)) is not None:
            mapped += int(mm.group(3), 16) - int(mm.group(2), 16)
    return {
        "setup_s": first_fork,
        "read_s": max(read_s.values(), default=0.0),
        "read_bytes": float(read_bytes),
        "mapped_bytes": float(mapped),
        "total_s": total,
    }
