"""The node agent's request socket: a pod asks only about itself.

Real unix sockets and the kernel's peer credentials; the pid -> pod mapping is
given (these test processes are in no container; tests/cluster/test_node_identity.py
proves the mapping on the local cluster's containerd).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rekindle_node import requests
from rekindle_node.identity import IdentityError, PodContainer
from rekindle_node.requests import Caller, Request, RequestServer

POD_A = PodContainer("a" * 64, "vllm", "team-a", "chat-a", "uid-a")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, list[tuple[PodContainer, Request]]]]:
    calls: list[tuple[PodContainer, Request]] = []

    def dump(caller: Caller, req: Request) -> dict[str, Any]:
        assert (caller.pid, caller.uid) == (os.getpid(), os.getuid())
        calls.append((caller.container, req))
        return {"dumped": req.pod_uid}

    def as_pod_a(pid: int) -> PodContainer:
        assert pid == os.getpid()  # the kernel's answer: the connecting process
        return POD_A

    path = tmp_path / "node.sock"
    server = RequestServer(path, {"dump": dump}, resolve=as_pod_a)
    requests.serve_in_thread(server)
    try:
        yield path, calls
    finally:
        server.shutdown()
        server.server_close()


def test_a_pod_may_ask_about_itself(served: tuple[Path, list[Any]]) -> None:
    path, calls = served
    got = requests.call(path, "dump", "uid-a", {"pid": 7})
    assert got == {"ok": True, "dumped": "uid-a"}
    assert calls == [(POD_A, Request(op="dump", pod_uid="uid-a", args={"pid": 7}))]


def test_a_pod_asking_about_another_pod_is_refused(served: tuple[Path, list[Any]]) -> None:
    path, calls = served
    got = requests.call(path, "dump", "uid-b")
    assert got == {
        "ok": False,
        "error": "refused",
        "message": "pod team-a/chat-a asked to dump pod uid-b: "
        "a pod may only ask the node agent about itself",
    }
    assert calls == []


def test_a_caller_that_is_no_pod_is_refused_before_its_request_is_parsed(tmp_path: Path) -> None:
    def nobody(pid: int) -> PodContainer:
        raise IdentityError(f"process {pid} is in no container's cgroup: not a pod's process")

    path = tmp_path / "node.sock"
    server = RequestServer(path, {}, resolve=nobody)
    requests.serve_in_thread(server)
    try:
        got = requests.call(path, "dump", "uid-a")
    finally:
        server.shutdown()
        server.server_close()
    assert got["ok"] is False and got["error"] == "refused"
    assert (
        got["message"] == f"process {os.getpid()} is in no container's cgroup: not a pod's process"
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            b'{"op": "format", "pod_uid": "uid-a"}',
            "op 'format': use one of dump, commit, open, mark_verified, publish, pull, "
            "unpublish, evict, restore, mapped_failed, reserve_pids, status, devices",
        ),
        (b'{"op": "dump"}', "pod_uid: the UID of the pod the request is about"),
        (b"[1]", "request is not a JSON object"),
        (b'{"op": "dump", "pod_uid": "u", "args": []}', "args is not a JSON object"),
    ],
)
def test_malformed_requests_say_what_is_wrong(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(") + "$"):
        requests.parse(raw)


def test_an_op_without_a_handler_is_a_bad_request(served: tuple[Path, list[Any]]) -> None:
    path, _ = served
    got = requests.call(path, "restore", "uid-a")
    assert got == {
        "ok": False,
        "error": "bad_request",
        "message": "op 'restore' is not served by this node agent",
    }
