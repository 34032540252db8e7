"""vLLM's process tree as the agent owns it: how to start it, its root PID, killing it.

The root is either the agent's own child (a boot) or a process CRIU restored
and re-parented to the agent (adopt). Either way one object knows the root,
so the flows (boot, checkpoint, restore) never disagree about which tree is
the live one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from rekindle_agent.confinement import seccomp
from rekindle_agent.process_tree import proctree, shm_files
from rekindle_agent.process_tree.reaper import Reaper
from rekindle_agent.supervision import modelinfo_seed

# Each line vLLM writes reaches the agent's stdout (so `kubectl logs`) behind this tag.
LOG_TAG = b"[vllm] "
MAX_LINE = 16384  # a longer run without a newline is passed on in pieces
POLL_S = 0.2
# A tree killed a moment ago (a failed restore's, before the fallback boot) closes
# its listening socket as its last process exits: wait that long before refusing.
PORT_GRACE_S = 10.0
TCP_LISTEN = "0A"  # the socket state "listen" in /proc/net/tcp{,6}
PROC_NET_TCP = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))

log = logging.getLogger("rekindle.agent")


class ForeignVllmError(RuntimeError):
    """vLLM's port is served by a process the agent did not start.

    Serving it would report Ready for a server this agent cannot checkpoint,
    restore or kill (e.g. another agent's vLLM sharing the host network).
    """


def argv_endpoint(argv: Sequence[str]) -> tuple[str, int] | None:
    """(host, port) from vLLM's `--host H --port N` (or `--port=N`); None without a port."""
    host, port = "0.0.0.0", None
    args = list(argv)
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name not in ("--host", "--port"):
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        if name == "--host":
            host = value
        elif value.isdigit():
            port = int(value)
    return None if port is None else (host, port)


def port_in_use(host: str, port: int) -> bool:
    """True if something listens on host:port (a bind as vLLM's would fails: EADDRINUSE)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def wait_port_free(host: str, port: int, timeout: float) -> bool:
    """True once nothing listens on host:port; False if something still does at timeout."""
    deadline = time.monotonic() + timeout
    while port_in_use(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def listening_inodes(table: str, port: int) -> set[int]:
    """Socket inodes listening on port in one /proc/net/tcp or tcp6 table (its text)."""
    out: set[int] = set()
    for line in table.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3] != TCP_LISTEN:
            continue
        _addr, _, hex_port = cols[1].rpartition(":")
        with contextlib.suppress(ValueError):
            if int(hex_port, 16) == port:
                out.add(int(cols[9]))
    return out


def socket_inodes(fd_links: Iterable[str]) -> set[int]:
    """Inodes of the sockets among readlink targets of /proc/PID/fd ("socket:[N]")."""
    out: set[int] = set()
    for target in fd_links:
        if target.startswith("socket:[") and target.endswith("]"):
            with contextlib.suppress(ValueError):
                out.add(int(target[len("socket:[") : -1]))
    return out


def foreign_port_message(port: int, when: str) -> str:
    """Why the agent refuses the server on its vLLM port, and what to change."""
    return (
        f"vLLM's port {port} is {when} by a process this agent did not start "
        "(another vLLM or agent on the same network namespace?); the agent only serves "
        "a vLLM it started itself: stop that process or give this agent another --vllm-port"
    )


def describe_exit(code: int | None) -> str:
    """How vLLM's root ended, for the agent's Failed message ('' when unknown).

    A SIGBUS is named with its usual cause: vLLM's shared-memory files are
    sparse, so a /dev/shm smaller than them fails only when a write reaches a
    page the tmpfs cannot allocate (the multimodal cache, under image load).
    """
    if code is None:
        return ""
    if code >= 0:
        return f" (exit code {code})"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if name == "SIGBUS":
        return (
            " (killed by SIGBUS: most likely a write to /dev/shm past its size; "
            "size /dev/shm for vLLM's shared-memory caches)"
        )
    return f" (killed by {name})"


class LogFollower:
    """Copies the lines vLLM appends to its log file to the agent's stdout, tagged.

    Why a file followed by the agent rather than a pipe to the agent: the file
    is part of the checkpoint (CRIU reopens it by path in the restored tree and
    the restore recreates it first), so a restored vLLM writes to the same
    place as a booted one with nothing to pass to CRIU, and the dumped tree
    holds no descriptor that leads outside it. The agent keeps reading the
    file itself too (its path is in error messages and in the checkpoint).
    """

    def __init__(self, path: str, out_fd: int = 1, poll_s: float = POLL_S) -> None:
        self.path = path
        self.out_fd = out_fd
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._restart_at: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow_from_end(self) -> None:
        """From now on pass on what is appended after the file's current end.

        Called before a tree writes to the file (a spawn, or a restored tree
        still stopped), so nothing it writes is missed and nothing older is
        repeated (a restored log holds the checkpointed pod's lines).
        """
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        with self._lock:
            self._restart_at = size
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vllm-log", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Pass on what is left (a last partial line too) and end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _emit(self, line: bytes) -> None:
        # A progress bar redraws with \r: keep what a terminal would show last.
        line = line.rstrip(b"\r").rsplit(b"\r", 1)[-1]
        with contextlib.suppress(OSError):
            os.write(self.out_fd, LOG_TAG + line + b"\n")

    def _reopen(self, offset: int, old: int | None) -> int | None:
        if old is not None:
            os.close(old)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        os.lseek(fd, offset, os.SEEK_SET)
        return fd

    def _run(self) -> None:
        fd: int | None = None
        pending = b""
        while True:
            with self._lock:
                restart, self._restart_at = self._restart_at, None
            if restart is not None:
                if pending:
                    self._emit(pending)
                    pending = b""
                fd = self._reopen(restart, fd)
                if fd is None:  # not created yet: try again at the next poll
                    with self._lock:
                        if self._restart_at is None:
                            self._restart_at = restart
            chunk = os.read(fd, 1 << 16) if fd is not None else b""
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._emit(line)
                while len(pending) > MAX_LINE:
                    self._emit(pending[:MAX_LINE])
                    pending = pending[MAX_LINE:]
                continue
            if self._stop.is_set():
                break
            self._stop.wait(self.poll_s)
        if pending:
            self._emit(pending)
        if fd is not None:
            os.close(fd)


class VllmProcess:
    """argv and env of vLLM, where it logs, and the root PID of its live tree (or None).

    vLLM's stdout and stderr go to log_path; with echo_fd (the agent's stdout by
    default) every line of it is also passed on there, tagged `[vllm] `.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        log_path: str,
        reaper: Reaper,
        seccomp_io_uring: bool = True,
        echo_fd: int | None = 1,
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.reaper = reaper
        self.seccomp_io_uring = seccomp_io_uring
        self.root_pid: int | None = None
        self.log_follower = LogFollower(log_path, echo_fd) if echo_fd is not None else None

    def spawn(self) -> int:
        """Start vLLM in its own session, output appended to the log; returns the root PID.

        Refuses (ForeignVllmError) when vLLM's port still has a listener after
        PORT_GRACE_S: the
        new vLLM could not bind it, and until it died of that the health checks
        would be answered by the other server.
        """
        endpoint = argv_endpoint(self.argv)
        if endpoint is not None and not wait_port_free(*endpoint, timeout=PORT_GRACE_S):
            raise ForeignVllmError(foreign_port_message(endpoint[1], "already in use"))
        argv = seccomp.wrap(self.argv) if self.seccomp_io_uring else list(self.argv)
        seeded = modelinfo_seed.install(self.env)
        if seeded:
            log.info("vLLM's model info cache seeded from the image: %s", ", ".join(seeded))
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if self.log_follower is not None:
            self.log_follower.follow_from_end()
        try:
            pid = self.reaper.spawn(argv, env=self.env, stdout=fd, stderr=fd)
        finally:
            os.close(fd)
        self.root_pid = pid
        return pid

    def adopt(self, pid: int) -> None:
        """A tree CRIU restored (its root is now the agent's child) becomes the live one.

        Called while the tree is still stopped: its log lines are followed from here.
        """
        self.reaper.adopt(pid)
        self.root_pid = pid
        if self.log_follower is not None:
            self.log_follower.follow_from_end()

    def check_own_listener(self, tables: Sequence[Path] = PROC_NET_TCP) -> None:
        """Raise ForeignVllmError unless vLLM's port is listened on by this tree.

        Called once /health answered: a listener on the port whose socket no
        process of the tree holds means the answer came from someone else's
        server. No listener found (no port in argv, no /proc/net) passes.
        """
        endpoint = argv_endpoint(self.argv)
        if endpoint is None or self.root_pid is None:
            return
        listeners: set[int] = set()
        for table in tables:
            with contextlib.suppress(OSError):
                listeners |= listening_inodes(table.read_text(), endpoint[1])
        if not listeners:
            return
        ours: set[int] = set()
        for pid in proctree.tree(self.root_pid):
            ours |= socket_inodes(proctree.fd_targets(pid).values())
        if not listeners & ours:
            raise ForeignVllmError(foreign_port_message(endpoint[1], "served"))

    def alive(self) -> bool:
        return self.root_pid is not None and proctree.alive(self.root_pid)

    def exit_code(self, timeout: float = 0) -> int | None:
        """The dead root's exit code (negative: the signal that killed it); None if unknown."""
        if self.root_pid is None:
            return None
        try:
            return self.reaper.wait(self.root_pid, timeout=timeout)
        except TimeoutError:
            return None

    def dumped(self, pids: list[int]) -> None:
        """CRIU killed the tree after a successful dump: wait until it is fully gone."""
        with contextlib.suppress(TimeoutError):
            proctree.kill_tree(pids, timeout=10)
        self.root_pid = None

    def kill(self, remove_shm: bool = False) -> None:
        """Kill the whole tree (SIGKILL); optionally delete the /dev/shm files it used."""
        if self.root_pid is None:
            return
        pids = proctree.tree(self.root_pid)
        names = shm_files.tree_shm_files(pids) if remove_shm else set()
        with contextlib.suppress(TimeoutError):
            proctree.kill_tree(pids)
        if remove_shm:
            shm_files.remove(sorted(names))
        self.root_pid = None
