"""The node agent's request socket: one JSON request per connection, answered by
whoever the kernel says is calling.

A request names the pod it concerns (`pod_uid`) so that a mistake is refused
rather than acted on for the caller; what decides is the caller's identity
(identity.identify on the connection's peer credentials), never the request:
a pod may only ask about itself. A caller that is no pod's container is refused
before its request is parsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rekindle_contract import node_api

from rekindle_node import identity
from rekindle_node.identity import IdentityError, PodContainer

MAX_REQUEST_BYTES = node_api.MAX_REQUEST_BYTES
OPS = node_api.OPS
# A handler's answer may carry one descriptor under this key: sent with SCM_RIGHTS
# (and closed here), never in the JSON.
FD_KEY = "_fd"


class Refused(PermissionError):
    """The caller may not ask this."""


class OperationError(RuntimeError):
    """A handler failed; reason is a short machine-readable word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Caller:
    """Who is asking: the kernel's credentials and the pod the runtime says they are in."""

    pid: int  # host pid of the connecting process
    uid: int
    gid: int
    container: PodContainer


@dataclass(frozen=True)
class Request:
    op: str
    pod_uid: str
    args: dict[str, Any]


Handler = Callable[[Caller, Request], dict[str, Any]]
Resolver = Callable[[int], PodContainer]


def parse(raw: bytes) -> Request:
    """A request line: {"op": ..., "pod_uid": ..., "args": {...}} (ValueError: malformed)."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise ValueError(f"request larger than {MAX_REQUEST_BYTES} bytes")
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("request is not a JSON object")
    op, pod_uid, args = doc.get("op"), doc.get("pod_uid"), doc.get("args", {})
    if op not in OPS:
        raise ValueError(f"op {op!r}: use one of {', '.join(OPS)}")
    if not isinstance(pod_uid, str) or not pod_uid:
        raise ValueError("pod_uid: the UID of the pod the request is about")
    if not isinstance(args, dict):
        raise ValueError("args is not a JSON object")
    return Request(op=op, pod_uid=pod_uid, args=args)


def authorize(caller: PodContainer, request: Request) -> None:
    """A pod may ask only about itself."""
    if request.pod_uid != caller.pod_uid:
        raise Refused(
            f"pod {caller.namespace}/{caller.pod} asked to {request.op} pod {request.pod_uid}: "
            "a pod may only ask the node agent about itself"
        )


class _Handler(socketserver.StreamRequestHandler):
    server: RequestServer

    def handle(self) -> None:
        answer = self.server.answer(self.connection)
        fd = answer.pop(FD_KEY, None)
        payload = json.dumps(answer).encode() + b"\n"
        if fd is None:
            self.wfile.write(payload)
            self.wfile.flush()
        else:
            try:
                socket.send_fds(self.connection, [payload], [fd])
            finally:
                os.close(fd)
        # Unread input at close would reset the connection before the caller reads
        # the answer (a refused caller's request is never read): discard it first.
        self.connection.shutdown(socket.SHUT_WR)
        self.connection.settimeout(1)
        with contextlib.suppress(OSError):
            while self.connection.recv(65536):
                pass


class RequestServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A unix socket the node agent answers on; handlers by op."""

    daemon_threads = True

    def __init__(
        self, path: Path, handlers: dict[str, Handler], resolve: Resolver = identity.identify
    ) -> None:
        self.handlers = handlers
        self.resolve = resolve
        super().__init__(str(path), _Handler)

    def answer(self, conn: socket.socket) -> dict[str, Any]:
        peer = identity.peer(conn)
        try:
            container = self.resolve(peer.pid)
        except IdentityError as e:
            return {"ok": False, "error": "refused", "message": str(e)}
        caller = Caller(pid=peer.pid, uid=peer.uid, gid=peer.gid, container=container)
        conn.settimeout(30)
        try:
            request = parse(_read_line(conn))
            authorize(container, request)
            handler = self.handlers.get(request.op)
            if handler is None:
                raise ValueError(f"op {request.op!r} is not served by this node agent")
            return {"ok": True, **handler(caller, request)}
        except Refused as e:
            return {"ok": False, "error": "refused", "message": str(e)}
        except OperationError as e:
            return {"ok": False, "error": e.reason, "message": str(e)}
        except (ValueError, OSError) as e:
            # A store's CopyError carries its own reason (checksum_mismatch, cache_full, ...).
            reason = getattr(e, "reason", None)
            return {
                "ok": False,
                "error": reason if isinstance(reason, str) else "bad_request",
                "message": str(e),
            }


def _read_line(conn: socket.socket) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError(f"request larger than {MAX_REQUEST_BYTES} bytes")
    return bytes(buf.split(b"\n", 1)[0])


def serve_in_thread(server: RequestServer) -> threading.Thread:
    t = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.05},
        name="node-requests",
        daemon=True,
    )
    t.start()
    return t


def call(path: Path, op: str, pod_uid: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The caller's side, for tests and tools: the answer, refusals included (no raise)."""
    try:
        answer, fd = node_api.call(str(path), op, pod_uid, args, timeout=30)
    except node_api.NodeAgentError as e:
        return {"ok": False, "error": e.reason, "message": e.message}
    if fd is not None:
        os.close(fd)
    return answer
