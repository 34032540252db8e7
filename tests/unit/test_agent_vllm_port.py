"""The agent serves only a vLLM it started: a foreign listener on vLLM's port is refused.

Agents that share a network namespace and a vLLM port (the dev harness's
agents of one factory; pods with hostNetwork) could otherwise report
"Ready booted" against another agent's vLLM: the new vLLM cannot bind the
port, and before it dies of that, /health is answered by the other server.
The agent checks the port before it spawns vLLM and, once /health answers,
that the listening socket belongs to its own tree.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from rekindle_agent.supervision import vllm_process
from rekindle_agent.supervision.vllm_process import (
    ForeignVllmError,
    VllmProcess,
    argv_endpoint,
    listening_inodes,
    port_in_use,
    socket_inodes,
    wait_port_free,
)

HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout"
)


def row(local: str, state: str, inode: int) -> str:
    timers = "00000000:00000000 00:00000000 00000000"
    return f"   0: {local} 00000000:0000 {state} {timers}     0        0 {inode} 1 0"


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A socket of this test process listening on a loopback port."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s
    s.close()


def test_argv_endpoint() -> None:
    assert argv_endpoint(["vllm", "serve", "m", "--host", "127.0.0.1", "--port", "18000"]) == (
        "127.0.0.1",
        18000,
    )
    assert argv_endpoint(["vllm", "--port=9", "--host=::1"]) == ("::1", 9)
    assert argv_endpoint(["vllm", "--port", "9"]) == ("0.0.0.0", 9)
    assert argv_endpoint(["vllm", "serve", "m"]) is None
    assert argv_endpoint(["vllm", "--port"]) is None  # no value: nothing to check


def test_listening_inodes_only_listeners_on_that_port() -> None:
    table = "\n".join(
        [
            HEADER,
            row("0100007F:4650", "0A", 111),  # 127.0.0.1:18000 listening
            row("00000000:4650", "0A", 222),  # 0.0.0.0:18000 listening
            row("0100007F:4650", "01", 333),  # an established connection on it
            row("0100007F:4651", "0A", 444),  # another port
        ]
    )
    assert listening_inodes(table, 18000) == {111, 222}
    assert listening_inodes(table, 80) == set()
    six = HEADER + "\n" + row("00000000000000000000000001000000:4650", "0A", 555)
    assert listening_inodes(six, 18000) == {555}


def test_socket_inodes() -> None:
    links = ["/dev/null", "socket:[12]", "pipe:[13]", "socket:[x]", "anon_inode:[eventfd]"]
    assert socket_inodes(links) == {12}


def test_port_in_use(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    assert port_in_use("127.0.0.1", port)
    listener.close()
    assert not port_in_use("127.0.0.1", port)


def vllm_on(port: int, argv: list[str] | None = None) -> VllmProcess:
    cmd = argv or ["true"]
    return VllmProcess(
        [*cmd, "--host", "127.0.0.1", "--port", str(port)],
        {},
        "/nonexistent/vllm.log",
        cast(Any, object()),  # a reaper is never reached: the spawn is refused first
        seccomp_io_uring=False,
        echo_fd=None,
    )


def test_wait_port_free_waits_for_a_closing_listener(listener: socket.socket) -> None:
    """A tree killed a moment ago still holds the port: the agent waits, then boots."""
    port = listener.getsockname()[1]
    threading.Timer(0.3, listener.close).start()
    assert wait_port_free("127.0.0.1", port, timeout=10)
    again = socket.socket()
    again.bind(("127.0.0.1", 0))
    again.listen()
    try:
        assert not wait_port_free("127.0.0.1", again.getsockname()[1], timeout=0.2)
    finally:
        again.close()


def test_spawn_refuses_a_port_in_use(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_process, "PORT_GRACE_S", 0.2)
    port = listener.getsockname()[1]
    with pytest.raises(ForeignVllmError, match=f"port {port} is already in use.*--vllm-port"):
        vllm_on(port).spawn()


def listening_child(port: int) -> subprocess.Popen[bytes]:
    """A child process that listens on port (stands in for vLLM's API server)."""
    code = (
        "import socket,time; s=socket.socket(); "
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('127.0.0.1',{port})); s.listen(); print('up', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline().strip() == b"up"
    return child


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_own_listener_passes_a_foreign_one_fails(listener: socket.socket) -> None:
    assert Path("/proc/net/tcp").exists(), "no /proc/net/tcp: a kernel without IPv4 procfs"
    port = free_loopback_port()
    child = listening_child(port)
    try:
        ours = vllm_on(port)
        ours.root_pid = child.pid
        ours.check_own_listener()  # the tree's own socket: fine
        foreign = vllm_on(listener.getsockname()[1])
        foreign.root_pid = child.pid  # the tree holds no socket on the listener's port
        with pytest.raises(ForeignVllmError, match="did not start"):
            foreign.check_own_listener()
    finally:
        child.kill()
        child.wait()


def test_no_listener_found_passes() -> None:
    proc = vllm_on(free_loopback_port())
    proc.root_pid = 1
    proc.check_own_listener(tables=[Path("/nonexistent/tcp")])  # no table read: no verdict
