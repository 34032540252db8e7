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
a GPU restore checks every file before CRIU runs instead.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

COMMON_FLAGS = ("--shell-job", "--tcp-established", "--ext-unix-sk", "--link-remap", "--file-locks")
MMAP_RESTORE_FLAG = "--mmap-restore"
LEAVE_STOPPED_FLAG = "--leave-stopped"


@dataclass(frozen=True)
class CriuInfo:
    binary: str
    version: str | None
    mmap_restore: bool


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
) -> list[str]:
    """Detached (-d): CRIU exits once the tree is in place; the root is re-parented to the
    agent. stopped: every task is left stopped (SIGSTOP) until the agent sends SIGCONT.
    The work dir (stats-restore) is the log's directory: the images are read-only."""
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
