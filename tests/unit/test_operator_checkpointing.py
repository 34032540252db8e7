"""Checkpoint orchestration against an in-memory apiserver and a fake agent."""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from typing import Any

import pytest
from rekindle_operator import builders as b
from rekindle_operator import checkpointing as cp
from rekindle_operator.spec_fingerprint import spec_fingerprint
from rekindle_operator.kube import KubeError
from rekindle_operator.reconcile import reconcile, spec_of


def merge(into: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch."""
    for k, v in patch.items():
        if v is None:
            into.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)
    return into


class FakeKube:
    def __init__(self) -> None:
        self.objs: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        m = obj["metadata"]
        m.setdefault("uid", f"uid-{m['name']}")
        m.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        self.objs[(obj["kind"], m["namespace"], m["name"])] = copy.deepcopy(obj)
        return obj

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        o = self.objs.get((kind, ns, name))
        return copy.deepcopy(o) if o else None

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict[str, Any]]:
        want = dict(kv.split("=", 1) for kv in selector.split(",")) if selector else {}
        out = []
        for (k, n, _), o in self.objs.items():
            labels = o["metadata"].get("labels") or {}
            if k == kind and n == ns and all(labels.get(a) == b for a, b in want.items()):
                out.append(copy.deepcopy(o))
        return out

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        m = obj["metadata"]
        if (obj["kind"], m["namespace"], m["name"]) in self.objs:
            raise KubeError(409, "exists")
        self.calls.append(("create", obj["kind"], m["name"]))
        return self.put(copy.deepcopy(dict(obj)))

    def create_if_absent(self, obj: Mapping[str, Any]) -> bool:
        try:
            self.create(obj)
            return True
        except KubeError:
            return False

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        m = obj["metadata"]
        self.calls.append(("apply", obj["kind"], m["name"]))
        cur = self.objs.get((obj["kind"], m["namespace"], m["name"]))
        new = copy.deepcopy(dict(obj))
        if cur and "status" in cur:
            new["status"] = cur["status"]
        return self.put(new)

    def merge_patch(
        self, kind: str, ns: str, name: str, patch: Mapping[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        o = self.objs.get((kind, ns, name))
        if o is None:
            raise KubeError(404, f"{kind} {name} not found")
        self.calls.append(("patch", kind, name))
        return merge(o, patch)

    def delete(self, kind: str, ns: str, name: str) -> bool:
        return self.objs.pop((kind, ns, name), None) is not None


class FakeStatus:
    def __init__(self, state: str, raw: dict[str, Any]) -> None:
        self.state = state
        self.raw = raw


class FakeAgent:
    """Records calls; checkpoint() returns a manifest or raises what it was given."""

    def __init__(
        self,
        manifest: dict[str, Any] | None = None,
        error: Exception | None = None,
        statuses: list[FakeStatus] | None = None,
    ) -> None:
        self.manifest = manifest
        self.error = error
        self.statuses = statuses or [FakeStatus("Ready", {"restored_with_mmap": False})]
        self.checkpoints: list[str] = []
        self.seen_labels: list[str | None] = []
        self.kube: FakeKube | None = None

    def __call__(self, url: str, token: str) -> FakeAgent:
        self.url, self.token = url, token
        return self

    def checkpoint(self, directory: str, timeout: float = 0) -> dict[str, Any]:
        self.checkpoints.append(directory)
        if self.kube is not None:  # what the Service would see during the checkpoint
            pod = next(iter(self.kube.list("Pod", "ns")))
            self.seen_labels.append(pod["metadata"]["labels"].get("rekindle.dev/serving"))
        if self.error:
            raise self.error
        assert self.manifest is not None
        return self.manifest

    def status(self) -> FakeStatus:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


NS = "ns"
MANIFEST = {
    "files": [
        {"path": "images/pages-1.img", "size": 3 * 2**20, "sha256": "x"},
        {"path": "weights/flat.bin", "size": 2**20, "sha256": "y"},
    ],
    "timings": {"drain": 0.01, "dump": 2.5, "verify": 1.25},
    "fingerprint": {"vllm": "0.32.0"},
    "verified": {"ok": True},
}


def world() -> tuple[FakeKube, list[tuple[str, str, str]]]:
    kube = FakeKube()
    kube.put(
        {
            "kind": "InferenceService",
            "apiVersion": "rekindle.dev/v1alpha1",
            "metadata": {"name": "tiny", "namespace": NS, "generation": 1},
            "spec": {
                "model": {"source": "/models/tiny"},
                "runtime": {"device": "cpu"},
                "multimodal": {"cacheSize": "512Mi", "maxObjectMiB": 64},
            },
        }
    )
    kube.put(
        {
            "kind": "Secret",
            "metadata": {"name": "tiny-agent-token", "namespace": NS},
            "data": {"token": base64.b64encode(b"tok").decode()},
        }
    )
    kube.put(
        {
            "kind": "Pod",
            "metadata": {
                "name": "tiny-abc",
                "namespace": NS,
                "labels": {"rekindle.dev/inferenceservice": "tiny", "rekindle.dev/serving": "true"},
            },
            "status": {"podIP": "10.244.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )
    events: list[tuple[str, str, str]] = []
    return kube, events


def new_ckpt(kube: FakeKube, name: str = "c1", isvc: str = "tiny", **status: Any) -> dict[str, Any]:
    obj = {
        "kind": "Checkpoint",
        "metadata": {"name": name, "namespace": NS, "uid": "0123456789"},
        "spec": {"inferenceService": isvc},
    }
    if status:
        obj["status"] = status
    return kube.put(obj)


def test_checkpoint_ready_pod_out_of_rotation_then_back() -> None:
    kube, events = world()
    agent = FakeAgent(manifest=MANIFEST)
    agent.kube = kube
    body = new_ckpt(kube)
    cp.run_checkpoint(kube, body, lambda *e: events.append(e), client_for=agent)
    st = kube.get("Checkpoint", NS, "c1")["status"]  # type: ignore[index]
    assert st["phase"] == "Ready"
    assert st["sizeBytes"] == 4 * 2**20 and st["size"] == "4.0Mi"
    assert st["phaseSeconds"] == {"drain": 0.01, "dump": 2.5, "verify": 1.25}
    isvc = kube.get("InferenceService", NS, "tiny")
    assert st["fingerprint"] == spec_fingerprint(spec_of(isvc))  # type: ignore[arg-type]
    assert st["path"] == b.checkpoint_path("tiny", "c1", "0123456789")
    assert agent.checkpoints == [st["path"]]
    assert agent.url == "http://10.244.0.9:8081" and agent.token == "tok"
    assert agent.seen_labels == [None]  # out of the Service while checkpointing
    pod = kube.get("Pod", NS, "tiny-abc")
    assert pod["metadata"]["labels"]["rekindle.dev/serving"] == "true"  # type: ignore[index]
    cm = kube.get("ConfigMap", NS, "tiny-rekindle")
    assert cm["data"]["checkpoint"] == st["path"]  # type: ignore[index]
    owner = kube.get("Checkpoint", NS, "c1")["metadata"]["ownerReferences"][0]  # type: ignore[index]
    assert owner["name"] == "tiny"
    assert [r for _, r, _ in events] == ["CheckpointStarted", "CheckpointReady"]


def test_agent_failure_fails_checkpoint_and_pod_serves() -> None:
    kube, events = world()
    agent = FakeAgent(error=RuntimeError("criu dump: io_uring in the tree"))
    cp.run_checkpoint(kube, new_ckpt(kube), lambda *e: events.append(e), client_for=agent)
    st = kube.get("Checkpoint", NS, "c1")["status"]  # type: ignore[index]
    assert st["phase"] == "Failed" and st["reason"] == "AgentCheckpointFailed"
    assert "io_uring" in st["message"]
    pod = kube.get("Pod", NS, "tiny-abc")
    assert pod["metadata"]["labels"]["rekindle.dev/serving"] == "true"  # type: ignore[index]
    assert kube.get("ConfigMap", NS, "tiny-rekindle") is None


def test_pod_not_mmap_restored_is_preferred() -> None:
    kube, events = world()
    kube.put(
        {
            "kind": "Pod",
            "metadata": {
                "name": "tiny-old-mmap",
                "namespace": NS,
                "creationTimestamp": "2020-01-01T00:00:00Z",
                "labels": {"rekindle.dev/inferenceservice": "tiny", "rekindle.dev/serving": "true"},
            },
            "status": {"podIP": "10.244.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )

    class PerPod(FakeAgent):
        def __call__(self, url: str, token: str) -> FakeAgent:
            mmap = url.startswith("http://10.244.0.7:")
            self.statuses = [FakeStatus("Ready", {"restored_with_mmap": mmap})]
            return super().__call__(url, token)

    agent = PerPod(manifest=MANIFEST)
    cp.run_checkpoint(kube, new_ckpt(kube), lambda *e: events.append(e), client_for=agent)
    st = kube.get("Checkpoint", NS, "c1")["status"]  # type: ignore[index]
    assert st["phase"] == "Ready" and st["pod"] == "tiny-abc"


def test_busy_agents_mean_retry() -> None:
    kube, events = world()
    agent = FakeAgent(statuses=[FakeStatus("Checkpointing", {})])
    body = new_ckpt(kube)
    body["metadata"]["creationTimestamp"] = "2999-01-01T00:00:00Z"
    with pytest.raises(cp.Retry, match="Checkpointing"):
        cp.run_checkpoint(kube, body, lambda *e: events.append(e), client_for=agent)
    st = kube.get("Checkpoint", NS, "c1")["status"]  # type: ignore[index]
    assert st["phase"] == "Pending" and "agent is Checkpointing" in st["message"]


def test_missing_inference_service_fails_at_once() -> None:
    kube, events = world()
    cp.run_checkpoint(
        kube, new_ckpt(kube, isvc="nope"), lambda *e: events.append(e), client_for=FakeAgent()
    )
    st = kube.get("Checkpoint", NS, "c1")["status"]  # type: ignore[index]
    assert st["phase"] == "Failed" and st["reason"] == "InferenceServiceNotFound"
    assert "'nope'" in st["message"]


def test_no_ready_pod_retries() -> None:
    kube, events = world()
    kube.merge_patch(
        "Pod", NS, "tiny-abc", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    body = new_ckpt(kube)
    body["metadata"]["creationTimestamp"] = "2999-01-01T00:00:00Z"
    with pytest.raises(cp.Retry):
        cp.run_checkpoint(kube, body, lambda *e: events.append(e), client_for=FakeAgent())


def test_finished_checkpoints_are_left_alone() -> None:
    kube, events = world()
    agent = FakeAgent(manifest=MANIFEST)
    body = new_ckpt(kube, phase="Ready", path="/x")
    assert (
        cp.run_checkpoint(kube, body, lambda *e: events.append(e), client_for=agent)["path"] == "/x"
    )
    assert agent.checkpoints == [] and events == []


def running(kube: FakeKube) -> dict[str, Any]:
    path = b.checkpoint_path("tiny", "c1", "0123456789")
    kube.merge_patch(
        "Pod", NS, "tiny-abc", {"metadata": {"labels": {"rekindle.dev/serving": None}}}
    )
    return new_ckpt(
        kube, phase="Running", pod="tiny-abc", path=path, startedAt="2026-01-01T00:00:00Z"
    )


def test_operator_restart_mid_checkpoint_fails_cleanly() -> None:
    kube, events = world()
    agent = FakeAgent(statuses=[FakeStatus("Checkpointing", {}), FakeStatus("Ready", {})])
    cp.run_checkpoint(kube, running(kube), lambda *e: events.append(e), client_for=agent, poll_s=0)
    st = kube.get("Checkpoint", NS, "c1")["status"]  # type: ignore[index]
    assert st["phase"] == "Failed" and st["reason"] == "OperatorRestarted"
    assert agent.checkpoints == []  # no second checkpoint started
    pod = kube.get("Pod", NS, "tiny-abc")
    assert pod["metadata"]["labels"]["rekindle.dev/serving"] == "true"  # type: ignore[index]


def test_operator_restart_mid_checkpoint_finishes_when_agent_reports_it() -> None:
    kube, events = world()
    body = running(kube)
    last = {"dir": body["status"]["path"], "ok": True, "timings": {"dump": 1.5}}
    agent = FakeAgent(statuses=[FakeStatus("Ready", {"last_checkpoint": last})])
    cp.run_checkpoint(kube, body, lambda *e: events.append(e), client_for=agent, poll_s=0)
    st = kube.get("Checkpoint", NS, "c1")["status"]  # type: ignore[index]
    assert st["phase"] == "Ready" and st["verified"] is True
    assert st["phaseSeconds"] == {"dump": 1.5}


def test_restart_with_pod_gone() -> None:
    kube, events = world()
    body = running(kube)
    kube.delete("Pod", NS, "tiny-abc")
    cp.run_checkpoint(kube, body, lambda *e: events.append(e), client_for=FakeAgent(), poll_s=0)
    assert kube.get("Checkpoint", NS, "c1")["status"]["reason"] == "PodGone"  # type: ignore[index]


def test_delete_policy_survives_the_inference_service() -> None:
    kube, events = world()
    agent = FakeAgent(manifest=MANIFEST)
    cp.run_checkpoint(kube, new_ckpt(kube), lambda *e: events.append(e), client_for=agent)
    body = kube.get("Checkpoint", NS, "c1")
    kube.delete("InferenceService", NS, "tiny")
    assert cp.delete_data(kube, body, lambda *e: events.append(e)).startswith("deleting")  # type: ignore[arg-type]
    (job,) = [o for (k, _, _), o in kube.objs.items() if k == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == body["status"]["path"]  # type: ignore[index]
    body["spec"]["deletionPolicy"] = "Retain"  # type: ignore[index]
    assert cp.delete_data(kube, body, lambda *e: None).startswith("retained")  # type: ignore[arg-type]


def test_reconcile_creates_objects_and_points_at_checkpoint() -> None:
    kube, events = world()
    kube.delete("Secret", NS, "tiny-agent-token")
    isvc = kube.get("InferenceService", NS, "tiny")
    fp = spec_fingerprint(spec_of(isvc))  # type: ignore[arg-type]
    new_ckpt(
        kube,
        "good",
        phase="Ready",
        fingerprint=fp,
        path="/c/good",
        completedAt="2026-01-02T00:00:00Z",
    )
    new_ckpt(
        kube,
        "other",
        phase="Ready",
        fingerprint="zzz",
        path="/c/other",
        completedAt="2026-01-03T00:00:00Z",
    )
    agent_reply = {"origin": "restored", "checkpoint": "/c/good", "state": "Ready"}
    st = reconcile(
        kube,
        isvc,
        lambda *e: events.append(e),  # type: ignore[arg-type]
        ask=lambda url, tok: (agent_reply, None),
    )
    assert {k for k, _, _ in kube.objs} >= {
        "Deployment",
        "Service",
        "Secret",
        "ConfigMap",
        "PersistentVolumeClaim",
    }
    assert kube.get("ConfigMap", NS, "tiny-rekindle")["data"]["checkpoint"] == "/c/good"  # type: ignore[index]
    assert kube.get("Checkpoint", NS, "other")["status"]["stale"] is True  # type: ignore[index]
    assert st["checkpoint"] == "good"
    assert st["pods"][0]["origin"] == "restored"
    pod = kube.get("Pod", NS, "tiny-abc")
    assert pod["metadata"]["annotations"]["rekindle.dev/boot-path"] == "restored"  # type: ignore[index]
    token = kube.get("Secret", NS, "tiny-agent-token")["data"]["token"]  # type: ignore[index]
    reconcile(
        kube,
        kube.get("InferenceService", NS, "tiny"),
        lambda *e: None,  # type: ignore[arg-type]
        ask=lambda url, tok: (agent_reply, None),
    )
    assert kube.get("Secret", NS, "tiny-agent-token")["data"]["token"] == token  # type: ignore[index]


def test_reconcile_refuses_undersized_shm_without_touching_deployment() -> None:
    kube, events = world()
    kube.merge_patch("InferenceService", NS, "tiny", {"spec": {"sharedMemory": {"size": "600Mi"}}})
    st = reconcile(
        kube,
        kube.get("InferenceService", NS, "tiny"),  # type: ignore[arg-type]
        lambda *e: events.append(e),
        ask=lambda u, t: (None, "x"),
    )
    assert st["phase"] == "Failed"
    assert kube.get("Deployment", NS, "tiny") is None
    warn = [m for k, r, m in events if r == "SharedMemorySizedBelowNeed"]
    assert warn and "600Mi" in warn[0] and "Mi (message queues" in warn[0]
