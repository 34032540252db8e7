"""The node agent finds serving pods in containerd's task directory and binds a socket in
each one's own volume; a connection is served only for a container of that pod.

A task directory laid out as containerd writes it (config.json with the CRI's
annotations and the pod's mounts); real sockets; the pid -> pod mapping given
(tests/cluster/test_node_identity.py proves it on the real containerd).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rekindle_contract.pod import NODE_SOCKET_DIR, NODE_SOCKET_NAME
from rekindle_node import identity, requests
from rekindle_node.identity import PodContainer
from rekindle_node.pod_sockets import PodSockets
from rekindle_node.requests import Caller, Request

A, B = "a" * 64, "b" * 64


def bundle(
    tasks: Path, cid: str, pod_uid: str, volume: Path | None, kind: str = "container"
) -> None:
    (tasks / cid).mkdir(parents=True)
    mounts = [{"destination": "/dev/shm", "source": "/somewhere"}]
    if volume is not None:
        mounts.append({"destination": NODE_SOCKET_DIR, "source": str(volume)})
    ann = {
        identity.A_CONTAINER_TYPE: kind,
        identity.A_CONTAINER_NAME: "vllm",
        identity.A_POD_NAMESPACE: "team-a",
        identity.A_POD_NAME: f"pod-{pod_uid}",
        identity.A_POD_UID: pod_uid,
    }
    (tasks / cid / "config.json").write_text(json.dumps({"annotations": ann, "mounts": mounts}))


def test_a_serving_pod_gets_a_socket_in_its_volume_and_only_it_is_served(tmp_path: Path) -> None:
    tasks, vol = tmp_path / "tasks", tmp_path / "pods" / "uid-a" / "rekindle-node"
    vol.mkdir(parents=True)
    bundle(tasks, A, "uid-a", vol)
    bundle(tasks, B, "uid-b", None)  # a pod without the volume: not served
    seen: list[Caller] = []

    def status(caller: Caller, req: Request) -> dict[str, Any]:
        seen.append(caller)
        return {"entries": []}

    callers = {"now": "uid-a"}

    def resolve(pid: int, _tasks: Path) -> PodContainer:
        assert pid == os.getpid()
        uid = callers["now"]
        return PodContainer(A if uid == "uid-a" else B, "vllm", "team-a", f"pod-{uid}", uid)

    sockets = PodSockets(tasks, {"status": status}, resolve=resolve)
    try:
        sockets.scan()
        assert set(sockets.servers) == {A} and sockets.other == {B}
        sock = vol / NODE_SOCKET_NAME
        assert sock.exists() and sock.stat().st_mode & 0o777 == 0o666
        assert requests.call(sock, "status", "uid-a") == {"ok": True, "entries": []}
        assert [c.container.pod_uid for c in seen] == ["uid-a"]
        # A process of another pod that got hold of this socket is refused.
        callers["now"] = "uid-b"
        got = requests.call(sock, "status", "uid-b")
        assert got["ok"] is False and got["error"] == "refused"
        assert "connected through the socket of pod team-a/pod-uid-a" in got["message"]
        assert len(seen) == 1
    finally:
        sockets.close()


def no_caller(pid: int, tasks: Path) -> PodContainer:
    raise AssertionError("nobody connects in this test")


def test_a_record_being_written_is_looked_at_again_and_an_ended_pod_is_let_go(
    tmp_path: Path,
) -> None:
    tasks, vol = tmp_path / "tasks", tmp_path / "vol"
    vol.mkdir()
    (tasks / A).mkdir(parents=True)
    (tasks / A / "config.json").write_text('{"annotations": {')  # containerd mid-write
    gone: list[str] = []
    sockets = PodSockets(tasks, {}, on_gone=gone.append, resolve=no_caller)
    try:
        sockets.scan()
        assert sockets.servers == {} and sockets.other == set()
        (tasks / A).rename(tmp_path / "old")
        bundle(tasks, A, "uid-a", vol)
        sockets.scan()
        assert set(sockets.servers) == {A}
        for f in (tasks / A).iterdir():
            f.unlink()
        (tasks / A).rmdir()
        sockets.scan()
        assert sockets.servers == {} and gone == ["uid-a"]
    finally:
        sockets.close()
