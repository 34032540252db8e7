"""The node agent's request socket, as both ends speak it (standard library only).

One connection, one request: a JSON line {"op", "pod_uid", "args"}; one answer:
a JSON line {"ok": true, ...} or {"ok": false, "error": REASON, "message": ...}.
An answer may carry one file descriptor (SCM_RIGHTS): `open` hands the caller
a read-only descriptor of a verified checkpoint's directory in the node's
cache, which the caller reads below and cannot change.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

MAX_REQUEST_BYTES = 64 << 10
MAX_ANSWER_BYTES = 4 << 20

# dump    CRIU-dump the tree rooted at args.pid (its pid in the pod), into the node's staging
# commit  finish that dump: args.dir's files (a directory in the pod) and args.manifest join
#         the images, signed by the node agent (the fleet key), into the cache under args.name
# open    a descriptor of checkpoint args.name's verified directory (answer: fd)
# mark_verified  record that a restore from args.name served (args.details)
# publish copy checkpoint args.name to args.dir (a new directory in the pod, on shared
#         storage), signed as it is, for other nodes' caches
# pull    verify the checkpoint published at args.dir (a directory in the pod) into the
#         cache as args.name: every byte checked against the node's signature as it is read
#         (args.from "store": from the node agent's object store; args.to the same for publish)
# unpublish  delete checkpoint args.name of the caller's namespace from the object store,
#         and from this node's cache unless a replica maps it
# evict   drop checkpoint args.name of the caller's namespace from this node's cache
#         unless a replica maps it (the store's copy stays: the next replica pulls it)
# restore CRIU-restore checkpoint args.name into the caller's pod (args.mmap, .mmap_heap,
#         .stopped); answer: pid
# status  the node cache's entries of the caller's namespace
# devices the caller's container's devices, from the kubelet
# mapped_failed  a tree restored from args.name with mapped memory died of SIGBUS
#         (args.why): restores of it copy from now on
# reserve_pids  move the pod's next pid above args.floor (before vLLM starts: its pids
#         stay free in a new pod for a restore)
OPS = (
    "dump",
    "commit",
    "open",
    "mark_verified",
    "publish",
    "pull",
    "unpublish",
    "evict",
    "restore",
    "mapped_failed",
    "reserve_pids",
    "status",
    "devices",
)


class NodeAgentError(RuntimeError):
    """The node agent answered no (reason: a short word), or could not be asked."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def call(
    path: str,
    op: str,
    pod_uid: str,
    args: dict[str, Any] | None = None,
    timeout: float = 600.0,
) -> tuple[dict[str, Any], int | None]:
    """One request; (the answer, a descriptor it carried or None). Raises NodeAgentError
    for an answer that says no, and for a node agent that cannot be reached."""
    request = json.dumps({"op": op, "pod_uid": pod_uid, "args": args or {}}).encode() + b"\n"
    data = bytearray()
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(request)
            while True:
                msg, got, _flags, _addr = socket.recv_fds(s, 65536, 1)
                fds += got
                if not msg:
                    break
                data += msg
                if len(data) > MAX_ANSWER_BYTES:
                    raise NodeAgentError("bad_answer", "the node agent's answer is too large")
    except OSError as e:
        _close(fds)
        raise NodeAgentError("unreachable", f"node agent socket {path}: {e.strerror or e}") from e
    try:
        answer = json.loads(bytes(data))
    except ValueError as e:
        _close(fds)
        raise NodeAgentError("bad_answer", f"the node agent's answer is not JSON: {e}") from e
    if not isinstance(answer, dict):
        _close(fds)
        raise NodeAgentError("bad_answer", "the node agent's answer is not a JSON object")
    if not answer.get("ok"):
        _close(fds)
        raise NodeAgentError(str(answer.get("error", "failed")), str(answer.get("message", "")))
    return answer, (fds[0] if fds else None)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
