"""Which checkpoint new replicas restore from; staleness; which pod to checkpoint."""

from __future__ import annotations

from typing import Any

from rekindle_operator.selection import newest_usable, ready_pods, stale_changes


def ckpt(
    name: str,
    phase: str = "Ready",
    fp: str = "A",
    done: str = "2026-01-01T00:00:00Z",
    isvc: str = "tiny",
    stale: bool = False,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"inferenceService": isvc},
        "status": {
            "phase": phase,
            "fingerprint": fp,
            "completedAt": done,
            "path": f"/c/{name}",
            "stale": stale,
        },
    }


def test_newest_ready_compatible_wins() -> None:
    cs = [
        ckpt("old", done="2026-01-01T00:00:00Z"),
        ckpt("new", done="2026-01-03T00:00:00Z"),
        ckpt("newest-stale", fp="B", done="2026-01-05T00:00:00Z"),
        ckpt("newest-failed", phase="Failed", done="2026-01-06T00:00:00Z"),
        ckpt("other-isvc", isvc="big", done="2026-01-07T00:00:00Z"),
        ckpt("deleting", done="2026-01-08T00:00:00Z", deleting=True),
        ckpt("running", phase="Running", done=""),
    ]
    best = newest_usable(cs, "tiny", "A")
    assert best is not None and best["metadata"]["name"] == "new"


def test_nothing_usable() -> None:
    assert newest_usable([ckpt("x", fp="B")], "tiny", "A") is None
    assert newest_usable([], "tiny", "A") is None


def test_stale_flags_flip_both_ways() -> None:
    cs = [
        ckpt("a", fp="A"),
        ckpt("b", fp="B"),
        ckpt("c", fp="A", stale=True),
        ckpt("d", fp="B", stale=True),
        ckpt("e", fp="B", phase="Failed"),
    ]
    assert stale_changes(cs, "tiny", "A") == {"b": True, "c": False}


def pod(
    name: str,
    ready: bool = True,
    ip: str | None = "10.0.0.1",
    created: str = "2026-01-01T00:00:00Z",
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = created
    st: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        st["podIP"] = ip
    return {"metadata": meta, "status": st}


def test_ready_pods_oldest_first() -> None:
    pods = [
        pod("young", created="2026-01-02T00:00:00Z"),
        pod("old"),
        pod("unready", ready=False),
        pod("noip", ip=None),
        pod("gone", deleting=True, created="2025-01-01T00:00:00Z"),
    ]
    assert [p["metadata"]["name"] for p in ready_pods(pods)] == ["old", "young"]
    assert [p["metadata"]["name"] for p in ready_pods(pods, "young")] == ["young"]
    assert ready_pods(pods, "unready") == []
    assert ready_pods([]) == []
