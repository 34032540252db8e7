"""Checkpoint orchestration and reconcile against an in-memory apiserver and fake agents."""

from __future__ import annotations

import base64
import copy
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from rekindle_contract import restore_pointer
from rekindle_contract.api import StatusReply
from rekindle_contract.pod import CHECKPOINT_MOUNT
from rekindle_operator import builders as b
from rekindle_operator import checkpointing as cp
from rekindle_operator.kube import KubeError
from rekindle_operator.pods import Agents
from rekindle_operator.reconcile import reconcile, spec_of
from rekindle_operator.settings import Settings
from rekindle_operator.spec_fingerprint import spec_fingerprint
from rekindle_operator.status import now_iso


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
    """The apiserver as a dict; thread-safe, since checkpoint calls finish in a thread."""

    def __init__(self) -> None:
        self.objs: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.lock = threading.RLock()

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        m = obj["metadata"]
        m.setdefault("uid", f"uid-{m['name']}")
        m.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        with self.lock:
            self.objs[(obj["kind"], m["namespace"], m["name"])] = copy.deepcopy(obj)
        return obj

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            o = self.objs.get((kind, ns, name))
            return copy.deepcopy(o) if o else None

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict[str, Any]]:
        want = dict(kv.split("=", 1) for kv in selector.split(",")) if selector else {}
        out = []
        with self.lock:
            for (k, n, _), o in self.objs.items():
                labels = o["metadata"].get("labels") or {}
                if k == kind and n == ns and all(labels.get(a) == b for a, b in want.items()):
                    out.append(copy.deepcopy(o))
        return out

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        m = obj["metadata"]
        with self.lock:
            if (obj["kind"], m["namespace"], m["name"]) in self.objs:
                raise KubeError(409, "exists")
            self.calls.append(("create", obj["kind"], m["name"]))
            return self.put(copy.deepcopy(dict(obj)))

    def create_if_absent(self, obj: Mapping[str, Any]) -> bool:
        try:
            self.create(obj)
            return True
        except KubeError as e:
            if e.status != 409:
                raise
            return False

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        m = obj["metadata"]
        with self.lock:
            self.calls.append(("apply", obj["kind"], m["name"]))
            cur = self.objs.get((obj["kind"], m["namespace"], m["name"]))
            new = copy.deepcopy(dict(obj))
            if cur and "status" in cur:
                new["status"] = cur["status"]
            return self.put(new)

    def merge_patch(
        self, kind: str, ns: str, name: str, patch: Mapping[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        with self.lock:
            o = self.objs.get((kind, ns, name))
            if o is None:
                raise KubeError(404, f"{kind} {name} not found")
            self.calls.append(("patch", kind, name))
            return copy.deepcopy(merge(o, patch))

    def delete(self, kind: str, ns: str, name: str) -> bool:
        with self.lock:
            return self.objs.pop((kind, ns, name), None) is not None


# Bounds what must happen (a background call finishing): generous, it only ends a failing
# test; no test passes or fails by how fast the machine is.
WAIT = 60.0


def reply(state: str = "Ready", **doc: Any) -> StatusReply:
    return StatusReply.from_json({"state": state, **doc})


class FakeAgent:
    """Every pod's agent: records calls; checkpoint() returns a manifest or raises.

    With `release` set, checkpoint() waits for it, as a real agent takes minutes.
    """

    def __init__(
        self,
        manifest: dict[str, Any] | None = None,
        error: Exception | None = None,
        statuses: list[StatusReply] | None = None,
        release: threading.Event | None = None,
    ) -> None:
        self.manifest = manifest
        self.error = error
        self.statuses = statuses or [reply("Ready")]
        self.release = release
        self.checkpoints: list[str] = []
        self.urls: list[str] = []
        self.token = ""
        self.in_checkpoint = threading.Event()
        self.finished = threading.Event()  # checkpoint() returned or raised
        self.during: Callable[[], None] | None = None

    def __call__(self, url: str, token: str) -> FakeAgent:
        self.urls.append(url)
        self.token = token
        return self

    def checkpoint(self, directory: str, timeout: float = 0) -> dict[str, Any]:
        self.checkpoints.append(directory)
        self.in_checkpoint.set()
        try:
            if self.during is not None:
                self.during()
            if self.release is not None:
                assert self.release.wait(WAIT), "the test never released the checkpoint"
            if self.error:
                raise self.error
            assert self.manifest is not None
            return self.manifest
        finally:
            self.finished.set()

    def status(self) -> StatusReply:
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
Events = list[tuple[str, str, str]]


def isvc_obj(name: str) -> dict[str, Any]:
    return {
        "kind": "InferenceService",
        "apiVersion": "rekindle.dev/v1alpha1",
        "metadata": {"name": name, "namespace": NS, "generation": 1},
        "spec": {
            "model": {"source": "/models/tiny"},
            "runtime": {"device": "cpu"},
            "multimodal": {"cacheSize": "512Mi", "maxObjectMiB": 64},
        },
    }


def current_fingerprint(isvc: str = "tiny") -> str:
    return spec_fingerprint(spec_of({**isvc_obj(isvc)}))


TEMPLATE_HASH = "5d9c8f7b6"


def owners(kube: FakeKube, isvc: str = "tiny") -> None:
    """isvc's Deployment and the ReplicaSet it controls (what owns the service's pods)."""
    owner = {"kind": "InferenceService", "name": isvc, "uid": f"uid-{isvc}", "controller": True}
    meta = {"name": b.deployment_name(isvc), "namespace": NS, "ownerReferences": [owner]}
    dep = kube.put({"kind": "Deployment", "metadata": meta})
    kube.put(
        {
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{isvc}-{TEMPLATE_HASH}",
                "namespace": NS,
                "uid": f"uid-{isvc}-rs",
                "labels": {
                    "rekindle.dev/inferenceservice": isvc,
                    "pod-template-hash": TEMPLATE_HASH,
                },
                "ownerReferences": [
                    {"kind": "Deployment", "uid": dep["metadata"]["uid"], "controller": True}
                ],
            },
        }
    )


def pod_obj(
    name: str,
    isvc: str = "tiny",
    ip: str = "10.244.0.9",
    fingerprint: str | None = None,
    owner_uid: str | None = None,
) -> dict[str, Any]:
    """A ready pod started from the current spec (its template's fingerprint annotation),
    made by isvc's ReplicaSet (owners()) unless owner_uid says otherwise ("": no owner)."""
    uid = f"uid-{isvc}-rs" if owner_uid is None else owner_uid
    refs = [{"kind": "ReplicaSet", "uid": uid, "controller": True}] if uid else []
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "rekindle.dev/inferenceservice": isvc,
                "rekindle.dev/serving": "true",
                "pod-template-hash": TEMPLATE_HASH,
            },
            "annotations": {"rekindle.dev/fingerprint": fingerprint or current_fingerprint(isvc)},
            "ownerReferences": refs,
        },
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


SIGNING_KEY = b"k" * 48


def world() -> tuple[FakeKube, Events]:
    kube = FakeKube()
    kube.put(isvc_obj("tiny"))
    kube.put(
        {
            "kind": "Secret",
            "metadata": {
                "name": "tiny-agent-token",
                "namespace": NS,
                "ownerReferences": [{"uid": "uid-tiny", "controller": True}],
            },
            "data": {"token": base64.b64encode(b"tok").decode()},
        }
    )
    kube.put(
        {
            "kind": "Secret",
            "metadata": {
                "name": "tiny-signing-key",
                "namespace": NS,
                "ownerReferences": [{"uid": "uid-tiny", "controller": True}],
            },
            "data": {"signing-key": base64.b64encode(SIGNING_KEY + b"\n").decode()},
        }
    )
    owners(kube)
    kube.put(pod_obj("tiny-abc"))
    return kube, []


def new_ckpt(kube: FakeKube, name: str = "c1", isvc: str = "tiny", **status: Any) -> dict[str, Any]:
    obj = {
        "kind": "Checkpoint",
        "metadata": {"name": name, "namespace": NS, "uid": "0123456789"},
        "spec": {"inferenceService": isvc},
    }
    if status:
        obj["status"] = status
    return kube.put(obj)


def ckpt_status(kube: FakeKube, name: str = "c1") -> dict[str, Any]:
    obj = kube.get("Checkpoint", NS, name)
    assert obj is not None
    return dict(obj.get("status") or {})


def serving(kube: FakeKube, pod: str = "tiny-abc") -> str | None:
    obj = kube.get("Pod", NS, pod)
    assert obj is not None
    return obj["metadata"]["labels"].get("rekindle.dev/serving")  # type: ignore[no-any-return]


def drive(kube: FakeKube, agents: Agents, events: Events, name: str = "c1") -> dict[str, Any]:
    """What the operator's timer does: step until the Checkpoint is finished."""
    body = kube.get("Checkpoint", NS, name)
    assert body is not None
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        st = cp.step(kube, body, lambda *e: events.append(e), agents)
        if not cp.unfinished(st):
            return st
        time.sleep(0.01)
    raise AssertionError(f"Checkpoint {name} still {ckpt_status(kube, name)}")


def test_checkpoint_ready_pod_out_of_rotation_then_back() -> None:
    kube, events = world()
    agent = FakeAgent(manifest=MANIFEST)
    seen: list[str | None] = []
    agent.during = lambda: seen.append(serving(kube))  # what the Service sees meanwhile
    new_ckpt(kube)
    drive(kube, Agents(agent), events)
    st = ckpt_status(kube)
    assert st["phase"] == "Ready"
    assert st["sizeBytes"] == 4 * 2**20 and st["size"] == "4.0Mi"
    assert st["phaseSeconds"] == {"drain": 0.01, "dump": 2.5, "verify": 1.25}
    isvc = kube.get("InferenceService", NS, "tiny")
    assert st["fingerprint"] == spec_fingerprint(spec_of(isvc))  # type: ignore[arg-type]
    assert st["path"] == b.checkpoint_path("c1", "0123456789")
    assert agent.checkpoints == [st["path"]]
    assert set(agent.urls) == {"http://10.244.0.9:8081"} and agent.token == "tok"
    assert seen == [None]  # out of the Service while checkpointing
    assert serving(kube) == "true"
    cm = kube.get("ConfigMap", NS, "tiny-rekindle")
    assert cm["data"]["checkpoint"] == st["path"]  # type: ignore[index]
    # Signed for this service and this Checkpoint: what its pods check before restoring.
    signature = cm["data"]["signature"]  # type: ignore[index]
    assert signature == restore_pointer.sign(SIGNING_KEY, st["path"], "uid-tiny", "0123456789")
    why = restore_pointer.problem(SIGNING_KEY, st["path"], "uid-tiny", signature, CHECKPOINT_MOUNT)
    assert why is None
    owner = kube.get("Checkpoint", NS, "c1")["metadata"]["ownerReferences"][0]  # type: ignore[index]
    assert owner["name"] == "tiny"
    assert [r for _, r, _ in events] == ["CheckpointStarted", "CheckpointReady"]


def test_where_the_node_agent_published_it_is_in_the_status() -> None:
    kube, events = world()
    path = b.checkpoint_path("c1", "0123456789")
    last = {
        "dir": path,
        "ok": True,
        "published": "published to http://s3:8333/ck/ (9 bytes, 0.1 s)",
    }
    agent = FakeAgent(manifest=MANIFEST, statuses=[reply("Ready", last_checkpoint=last)])
    new_ckpt(kube)
    drive(kube, Agents(agent), events)
    st = ckpt_status(kube)
    assert (st["phase"], st["path"]) == ("Ready", path)
    assert st["publication"] == last["published"]


def test_a_publication_of_another_checkpoint_or_none_is_not_reported() -> None:
    kube, events = world()
    other = {"dir": "/elsewhere", "ok": True, "published": "published to somewhere"}
    agent = FakeAgent(manifest=MANIFEST, statuses=[reply("Ready", last_checkpoint=other)])
    new_ckpt(kube)
    drive(kube, Agents(agent), events)
    st = ckpt_status(kube)
    assert st["phase"] == "Ready" and "publication" not in st


def impostors(kube: FakeKube) -> None:
    """Pods that carry the service's labels but that its Deployment did not make: no
    owner, another ReplicaSet, the right ReplicaSet's UID but another template hash."""
    kube.put(pod_obj("aaa-unowned", ip="10.244.0.66", owner_uid=""))
    kube.put(pod_obj("aab-foreign-rs", ip="10.244.0.67", owner_uid="uid-someone-else"))
    wrong_hash = pod_obj("aac-wrong-hash", ip="10.244.0.68")
    wrong_hash["metadata"]["labels"]["pod-template-hash"] = "0000000"
    kube.put(wrong_hash)


def test_impostor_pods_get_no_token_and_are_never_checkpointed() -> None:
    kube, events = world()
    impostors(kube)
    agent = FakeAgent(manifest=MANIFEST)
    reconcile(kube, kube.get("InferenceService", NS, "tiny"), lambda *e: None, Agents(agent))  # type: ignore[arg-type]
    new_ckpt(kube)
    assert drive(kube, Agents(agent), events)["phase"] == "Ready"
    assert set(agent.urls) == {"http://10.244.0.9:8081"}  # the Deployment's pod only
    assert ckpt_status(kube)["pod"] == "tiny-abc"


def test_only_impostors_means_no_pod_to_checkpoint() -> None:
    kube, events = world()
    kube.delete("Pod", NS, "tiny-abc")
    impostors(kube)
    agent = FakeAgent(manifest=MANIFEST)
    new_ckpt(kube)
    body = kube.get("Checkpoint", NS, "c1")
    st = cp.step(kube, body, lambda *e: events.append(e), Agents(agent))  # type: ignore[arg-type]
    # (new_ckpt's creation time is long past, so the wait for a pod is over at once)
    assert (st["phase"], st["reason"]) == ("Failed", "NoReadyPod")
    assert agent.urls == [] and agent.checkpoints == []


def test_a_step_never_waits_for_the_agent() -> None:
    kube, events = world()
    release = threading.Event()
    agent = FakeAgent(
        manifest=MANIFEST, release=release, statuses=[reply("Ready"), reply("Checkpointing")]
    )
    agents = Agents(agent)
    body = new_ckpt(kube)
    st = cp.step(kube, body, lambda *e: events.append(e), agents)
    assert st["phase"] == "Running" and agent.in_checkpoint.wait(WAIT)
    st = cp.step(kube, body, lambda *e: events.append(e), agents)
    # Both steps returned while the agent's checkpoint call is still blocked (the test
    # has not released it): no step waited for it.
    assert not agent.finished.is_set() and not release.is_set()
    assert st["phase"] == "Running" and ckpt_status(kube)["agentState"] == "Checkpointing"
    assert serving(kube) is None
    release.set()
    agent.statuses = [reply("Ready")]
    assert drive(kube, agents, events)["phase"] == "Ready"
    assert serving(kube) == "true"
    assert "agentState" not in ckpt_status(kube)


def test_other_inference_services_reconcile_while_a_checkpoint_runs() -> None:
    """One worker, as in kopf's pool at its busiest: the checkpoint must not hold it."""
    kube, events = world()
    kube.put(isvc_obj("other"))
    kube.put(pod_obj("other-xyz", isvc="other", ip="10.244.0.10"))
    release = threading.Event()
    agent = FakeAgent(
        manifest=MANIFEST, release=release, statuses=[reply("Ready"), reply("Checkpointing")]
    )
    agents = Agents(agent)
    body = new_ckpt(kube)
    emit = lambda *e: events.append(e)  # noqa: E731
    with ThreadPoolExecutor(max_workers=1) as workers:
        workers.submit(cp.step, kube, body, emit, agents).result(timeout=WAIT)
        assert agent.in_checkpoint.wait(WAIT)
        other = kube.get("InferenceService", NS, "other")
        status = workers.submit(reconcile, kube, other, emit, agents).result(timeout=WAIT)
        assert not release.is_set() and ckpt_status(kube)["phase"] == "Running"
        assert status["phase"] == "Progressing"  # reconciled while the agent still dumps
        assert kube.get("Deployment", NS, "other") is not None
        release.set()
        agent.statuses = [reply("Ready")]
        deadline = time.monotonic() + WAIT
        while cp.unfinished(workers.submit(cp.step, kube, body, emit, agents).result(WAIT)):
            assert time.monotonic() < deadline, ckpt_status(kube)
            time.sleep(0.01)
    assert ckpt_status(kube)["phase"] == "Ready"


def test_agent_failure_fails_checkpoint_and_pod_serves() -> None:
    kube, events = world()
    agent = FakeAgent(error=RuntimeError("criu dump: io_uring in the tree"))
    new_ckpt(kube)
    drive(kube, Agents(agent), events)
    st = ckpt_status(kube)
    assert st["phase"] == "Failed" and st["reason"] == "AgentCheckpointFailed"
    assert "io_uring" in st["message"]
    assert serving(kube) == "true"
    assert kube.get("ConfigMap", NS, "tiny-rekindle") is None


def test_pod_not_mmap_restored_is_preferred() -> None:
    kube, events = world()
    old = pod_obj("tiny-old-mmap", ip="10.244.0.7")
    old["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    kube.put(old)

    class PerPod(FakeAgent):
        def __call__(self, url: str, token: str) -> FakeAgent:
            mmap = url.startswith("http://10.244.0.7:")
            self.statuses = [reply("Ready", restored_with_mmap=mmap)]
            return super().__call__(url, token)

    new_ckpt(kube)
    drive(kube, Agents(PerPod(manifest=MANIFEST)), events)
    st = ckpt_status(kube)
    assert st["phase"] == "Ready" and st["pod"] == "tiny-abc"


def test_busy_agents_mean_waiting() -> None:
    kube, events = world()
    agent = FakeAgent(statuses=[reply("Checkpointing")])
    body = new_ckpt(kube)
    kube.merge_patch(
        "Checkpoint", NS, "c1", {"metadata": {"creationTimestamp": "2999-01-01T00:00:00Z"}}
    )
    st = cp.step(kube, body, lambda *e: events.append(e), Agents(agent))
    assert st["phase"] == "Pending" and "agent is Checkpointing" in st["message"]
    assert ckpt_status(kube)["reason"] == "WaitingForPod"
    assert agent.checkpoints == []


def test_no_ready_pod_in_time_fails() -> None:
    kube, events = world()
    kube.merge_patch(
        "Pod", NS, "tiny-abc", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    body = new_ckpt(kube)
    st = cp.step(kube, body, lambda *e: events.append(e), Agents(FakeAgent()))
    assert st["phase"] == "Failed" and st["reason"] == "NoReadyPod"


def test_missing_inference_service_fails_at_once() -> None:
    kube, events = world()
    body = new_ckpt(kube, isvc="nope")
    cp.step(kube, body, lambda *e: events.append(e), Agents(FakeAgent()))
    st = ckpt_status(kube)
    assert st["phase"] == "Failed" and st["reason"] == "InferenceServiceNotFound"
    assert "'nope'" in st["message"]


def test_finished_checkpoints_are_left_alone() -> None:
    kube, events = world()
    agent = FakeAgent(manifest=MANIFEST)
    body = new_ckpt(kube, phase="Ready", path="/x")
    assert cp.step(kube, body, lambda *e: events.append(e), Agents(agent))["path"] == "/x"
    assert agent.checkpoints == [] and events == []


def running(kube: FakeKube) -> dict[str, Any]:
    """A Checkpoint another operator process started (this one has no call for it)."""
    path = b.checkpoint_path("c1", "0123456789")
    kube.merge_patch(
        "Pod", NS, "tiny-abc", {"metadata": {"labels": {"rekindle.dev/serving": None}}}
    )
    return new_ckpt(
        kube, phase="Running", pod="tiny-abc", path=path, startedAt="2999-01-01T00:00:00Z"
    )


def test_operator_restart_waits_for_the_agent_then_fails_cleanly() -> None:
    kube, events = world()
    agent = FakeAgent(statuses=[reply("Checkpointing"), reply("Ready")])
    body = running(kube)
    st = cp.step(kube, body, lambda *e: events.append(e), Agents(agent))
    assert st["phase"] == "Running" and serving(kube) is None  # still busy: look again
    st = cp.step(kube, body, lambda *e: events.append(e), Agents(agent))
    assert st["phase"] == "Failed" and st["reason"] == "OperatorRestarted"
    assert agent.checkpoints == []  # no second checkpoint started
    assert serving(kube) == "true"


def test_operator_restart_finishes_when_agent_reports_it() -> None:
    kube, events = world()
    body = running(kube)
    last = {
        "dir": body["status"]["path"],
        "ok": True,
        "timings": {"dump": 1.5},
        "published": "not published, only this node has it: store_unreachable",
    }
    agent = FakeAgent(statuses=[reply("Ready", last_checkpoint=last)])
    cp.step(kube, body, lambda *e: events.append(e), Agents(agent))
    st = ckpt_status(kube)
    assert st["phase"] == "Ready" and st["verified"] is True
    assert st["publication"] == last["published"]
    assert st["phaseSeconds"] == {"dump": 1.5}
    assert kube.get("ConfigMap", NS, "tiny-rekindle")["data"]["checkpoint"] == st["path"]  # type: ignore[index]
    assert serving(kube) == "true"


def test_operator_restart_reports_the_agents_own_failure() -> None:
    kube, events = world()
    body = running(kube)
    last = {"dir": body["status"]["path"], "ok": False, "error": "criu dump failed: EPERM"}
    agent = FakeAgent(statuses=[reply("Ready", last_checkpoint=last)])
    cp.step(kube, body, lambda *e: events.append(e), Agents(agent))
    st = ckpt_status(kube)
    assert st["reason"] == "AgentCheckpointFailed" and "EPERM" in st["message"]


def test_restart_with_pod_gone() -> None:
    kube, events = world()
    body = running(kube)
    kube.delete("Pod", NS, "tiny-abc")
    cp.step(kube, body, lambda *e: events.append(e), Agents(FakeAgent()))
    assert ckpt_status(kube)["reason"] == "PodGone"


def test_deleting_a_running_checkpoint_waits_for_the_agent() -> None:
    kube, events = world()
    release = threading.Event()
    agent = FakeAgent(manifest=MANIFEST, release=release)
    agents = Agents(agent)
    cp.step(kube, new_ckpt(kube), lambda *e: events.append(e), agents)
    assert agent.in_checkpoint.wait(WAIT)
    body = kube.get("Checkpoint", NS, "c1")
    with pytest.raises(cp.Retry, match="still checkpointing"):
        cp.delete_data(kube, body, lambda *e: None, agents)  # type: ignore[arg-type]
    release.set()
    call = agents.checkpoint_call("0123456789")
    assert call is not None and call.finished.wait(WAIT)
    assert cp.delete_data(kube, body, lambda *e: None, agents).startswith("deleting")  # type: ignore[arg-type]
    assert serving(kube) == "true"


def test_delete_policy_survives_the_inference_service() -> None:
    kube, events = world()
    agents = Agents(FakeAgent(manifest=MANIFEST))
    new_ckpt(kube)
    drive(kube, agents, events)
    body = kube.get("Checkpoint", NS, "c1")
    kube.delete("InferenceService", NS, "tiny")
    kube.delete("Pod", NS, "tiny-abc")  # garbage-collected with it
    assert cp.delete_data(kube, body, lambda *e: events.append(e), agents).startswith("deleting")  # type: ignore[arg-type]
    (job,) = [o for (k, _, _), o in kube.objs.items() if k == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == body["status"]["path"]  # type: ignore[index]
    body["spec"]["deletionPolicy"] = "Retain"  # type: ignore[index]
    assert cp.delete_data(kube, body, lambda *e: None, agents).startswith("retained")  # type: ignore[arg-type]


def _ready_hostpath_checkpoint(kube: FakeKube, events: Events) -> dict[str, Any]:
    kube.merge_patch(
        "InferenceService",
        NS,
        "tiny",
        {"spec": {"coldStart": {"storage": {"type": "hostPath", "hostPath": {"path": "/d"}}}}},
    )
    # The pod template's fingerprint follows the spec (hostPath is not part of it).
    kube.merge_patch("Pod", NS, "tiny-abc", {"spec": {"nodeName": "node-a"}})
    new_ckpt(kube)
    drive(kube, Agents(FakeAgent(manifest=MANIFEST)), events)
    body = kube.get("Checkpoint", NS, "c1")
    assert body is not None and body["status"]["phase"] == "Ready"
    return body


def test_data_that_pods_map_is_kept_until_they_are_gone() -> None:
    kube, events = world()
    body = _ready_hostpath_checkpoint(kube, events)
    st = body["status"]
    assert st["subPath"] == "ns/tiny" and st["node"] == "node-a"
    assert st["path"] == b.checkpoint_path("c1", "0123456789")
    # The pod that made it verified it by restoring it: it maps the files now.
    ann = kube.get("Pod", NS, "tiny-abc")["metadata"]["annotations"]  # type: ignore[index]
    assert ann["rekindle.dev/restored-from"] == st["path"]
    # A replica restored from it, and one still coming up since it became Ready.
    restored = pod_obj("tiny-r", ip="10.0.0.2")
    restored["metadata"]["annotations"].update(
        {"rekindle.dev/boot-path": "restored", "rekindle.dev/restored-from": f"/x,{st['path']}"}
    )
    kube.put(restored)
    booting = pod_obj("tiny-new", ip="10.0.0.3")
    booting["metadata"]["creationTimestamp"] = "2999-01-01T00:00:00Z"
    kube.put(booting)
    booted_earlier = pod_obj("tiny-old", ip="10.0.0.4")
    booted_earlier["metadata"]["annotations"]["rekindle.dev/boot-path"] = "booted"
    kube.put(booted_earlier)
    agents = Agents(FakeAgent())
    with pytest.raises(cp.Retry, match="tiny-abc, tiny-new, tiny-r use it"):
        cp.delete_data(kube, body, lambda *e: events.append(e), agents)
    assert not [k for (k, _, _) in kube.objs if k == "Job"]
    # A pod that has not said how it came up stops blocking after the timeout.
    with pytest.raises(cp.Retry, match="tiny-abc, tiny-r use it"):
        cp.delete_data(kube, body, lambda *e: None, agents, waited_s=10_000)
    for pod in ("tiny-abc", "tiny-r", "tiny-new"):
        kube.delete("Pod", NS, pod)
    assert cp.delete_data(kube, body, lambda *e: events.append(e), agents).startswith("deleting")
    (job,) = [o for (k, _, _), o in kube.objs.items() if k == "Job"]
    assert job["metadata"]["name"] == "rm-c1-01234567"
    pod = job["spec"]["template"]["spec"]
    assert pod["volumes"][0]["hostPath"]["path"] == "/d"
    assert pod["containers"][0]["volumeMounts"][0]["subPath"] == "ns/tiny"
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]["matchFields"][0]["values"] == ["node-a"]


class ForbiddenJobs(FakeKube):
    def __init__(self, message: str, namespace: str = NS) -> None:
        super().__init__()
        self.message = message
        self.namespace = namespace

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Job" and obj["metadata"]["namespace"] == self.namespace:
            raise KubeError(403, self.message)
        return super().create(obj)


def _move(kube: FakeKube, into: FakeKube) -> FakeKube:
    into.objs = kube.objs
    return into


def test_a_terminating_namespace_never_waits_on_the_cleanup_job() -> None:
    kube, events = world()
    body = _ready_hostpath_checkpoint(kube, events)
    kube.delete("Pod", NS, "tiny-abc")
    terminating = _move(
        kube,
        ForbiddenJobs(
            "jobs is forbidden: unable to create new content in namespace ns because it is "
            "being terminated"
        ),
    )
    out = cp.delete_data(terminating, body, lambda *e: events.append(e), Agents(FakeAgent()))
    assert "left in place" in out and "/d/ns/tiny/c1-01234567 on node node-a" in out
    assert ("Warning", "CheckpointDataRetained", out) in events
    # With the operator's namespace known, hostPath data is removed from there.
    settings = Settings(operator_namespace="rk-system", operator_labels={"a": "b"})
    out = cp.delete_data(terminating, body, lambda *e: None, Agents(FakeAgent()), 0, settings)
    assert out.startswith("deleting")
    (job,) = [o for (k, _, _), o in terminating.objs.items() if k == "Job"]
    assert job["metadata"]["namespace"] == "rk-system"
    assert job["metadata"]["name"] == "rm-ns-c1-01234567"


def test_cleanup_job_failures_are_retried_then_let_go() -> None:
    kube, events = world()
    body = _ready_hostpath_checkpoint(kube, events)
    kube.delete("Pod", NS, "tiny-abc")
    denied = _move(kube, ForbiddenJobs("jobs.batch is forbidden: User cannot create"))
    with pytest.raises(cp.Retry, match="cannot create the cleanup Job yet"):
        cp.delete_data(denied, body, lambda *e: None, Agents(FakeAgent()), waited_s=5)
    out = cp.delete_data(denied, body, lambda *e: events.append(e), Agents(FakeAgent()), 301)
    assert "left in place: no cleanup Job after 301s" in out
    assert events[-1][:2] == ("Warning", "CheckpointDataRetained")


def test_has_data_decides_whether_a_finalizer_is_needed() -> None:
    st = {"phase": "Ready", "path": "/p", "volume": {"hostPath": {}}, "image": "i"}
    assert cp.has_data({"spec": {}, "status": st})
    assert not cp.has_data({"spec": {"deletionPolicy": "Retain"}, "status": st})
    assert not cp.has_data({"spec": {}, "status": {"phase": "Failed", "reason": "NoReadyPod"}})
    assert cp.has_data({"spec": {"deletionPolicy": "Retain"}, "status": {"phase": "Running"}})


def test_only_pods_of_the_current_spec_are_checkpointed() -> None:
    kube, events = world()
    kube.delete("Pod", NS, "tiny-abc")
    kube.put(pod_obj("tiny-old", fingerprint="0000000000000000"))
    agent = FakeAgent(manifest=MANIFEST)
    new_ckpt(kube)
    kube.merge_patch("Checkpoint", NS, "c1", {"metadata": {"creationTimestamp": now_iso()}})
    st = cp.step(kube, kube.get("Checkpoint", NS, "c1"), lambda *e: None, Agents(agent))  # type: ignore[arg-type]
    assert st["phase"] == "Pending" and st["reason"] == "WaitingForPod"
    assert "tiny-old: runs an older spec" in st["message"]
    assert agent.checkpoints == []
    kube.put(pod_obj("tiny-new"))
    st = drive(kube, Agents(agent), events)
    assert st["phase"] == "Ready" and st["pod"] == "tiny-new"
    assert st["fingerprint"] == current_fingerprint()


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
    agent = FakeAgent(
        statuses=[
            reply(
                "Ready", origin="restored", checkpoint="/c/good", started_at=100.0, ready_at=103.5
            )
        ]
    )
    st = reconcile(kube, isvc, lambda *e: events.append(e), Agents(agent))  # type: ignore[arg-type]
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
    assert st["pods"][0]["agentReadySeconds"] == 3.5
    ann = kube.get("Pod", NS, "tiny-abc")["metadata"]["annotations"]  # type: ignore[index]
    assert ann["rekindle.dev/boot-path"] == "restored"
    assert ann["rekindle.dev/agent-ready-seconds"] == "3.500"
    # Its data is kept while this pod lives (Checkpoint deletion reads this).
    assert ann["rekindle.dev/restored-from"] == "/c/good"
    # No NetworkPolicy unless the operator knows where it runs (the chart says so).
    assert "NetworkPolicy" not in {k for k, _, _ in kube.objs}
    token = kube.get("Secret", NS, "tiny-agent-token")["data"]["token"]  # type: ignore[index]
    # After a checkpoint the agent's ready_at moves on; the pod keeps its first figure.
    agent.statuses = [
        reply(
            "Ready",
            origin="restored",
            started_at=100.0,
            ready_at=900.0,
            last_checkpoint={"dir": "/c/x", "ok": True},
        )
    ]
    st = reconcile(kube, kube.get("InferenceService", NS, "tiny"), lambda *e: None, Agents(agent))  # type: ignore[arg-type]
    assert st["pods"][0]["agentReadySeconds"] == 3.5
    assert kube.get("Secret", NS, "tiny-agent-token")["data"]["token"] == token  # type: ignore[index]


def test_reconcile_refuses_undersized_shm_without_touching_deployment() -> None:
    kube, events = world()
    kube.merge_patch("InferenceService", NS, "tiny", {"spec": {"sharedMemory": {"size": "600Mi"}}})
    st = reconcile(
        kube,
        kube.get("InferenceService", NS, "tiny"),  # type: ignore[arg-type]
        lambda *e: events.append(e),
        Agents(FakeAgent(error=RuntimeError("x"))),
    )
    assert st["phase"] == "Failed"
    assert ("apply", "Deployment", "tiny") not in kube.calls
    warn = [m for k, r, m in events if r == "SharedMemorySizedBelowNeed"]
    assert warn and "600Mi" in warn[0] and "Mi (message queues" in warn[0]


def test_reconcile_refuses_images_outside_the_allowed_list() -> None:
    kube, events = world()
    isvc = kube.get("InferenceService", NS, "tiny")
    allowed = Settings(allowed_images=("registry.example/rekindle/*", "other:1"))
    st = reconcile(kube, isvc, lambda *e: events.append(e), Agents(FakeAgent()), allowed)  # type: ignore[arg-type]
    assert st["phase"] == "Failed"
    assert "rekindle.local/runtime-cpu:dev" in st["message"] and "not an allowed" in st["message"]
    assert ("apply", "Deployment", "tiny") not in kube.calls
    assert events[-1][:2] == ("Warning", "InvalidSpec")
    kube.merge_patch(
        "InferenceService",
        NS,
        "tiny",
        {"spec": {"runtime": {"image": "registry.example/rekindle/rt:2"}}},
    )
    isvc = kube.get("InferenceService", NS, "tiny")
    st = reconcile(kube, isvc, lambda *e: None, Agents(FakeAgent()), allowed)  # type: ignore[arg-type]
    assert st["phase"] != "Failed"
    assert kube.get("Deployment", NS, "tiny") is not None


def test_reconcile_creates_the_network_policy_when_the_operator_knows_its_pods() -> None:
    kube, _ = world()
    isvc = kube.get("InferenceService", NS, "tiny")
    settings = Settings(operator_namespace="rk-system", operator_labels={"app": "op"})
    reconcile(kube, isvc, lambda *e: None, Agents(FakeAgent()), settings)  # type: ignore[arg-type]
    np = kube.get("NetworkPolicy", NS, "tiny-agent")
    assert np is not None
    assert np["spec"]["ingress"][1]["from"][0]["podSelector"] == {"matchLabels": {"app": "op"}}


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("Service", "tiny"),
        ("Secret", "tiny-signing-key"),
        ("Secret", "tiny-metrics-token"),
        ("Deployment", "tiny"),
    ],
)
def test_an_object_with_our_name_that_is_not_ours_is_never_taken_over(kind: str, name: str) -> None:
    """Someone else's Service `tiny` (or a signing key Secret made beforehand, whose
    maker knows the key) stops the reconcile: Failed, one event, nothing written."""
    kube, _ = world()
    kube.delete("Deployment", NS, "tiny")  # world()'s own, so that the squatter's is the one
    squatter = {"kind": kind, "metadata": {"name": name, "namespace": NS}, "spec": {"x": 1}}
    kube.put(copy.deepcopy(squatter))
    calls_before = list(kube.calls)
    events: list[tuple[str, str, str]] = []
    isvc = kube.get("InferenceService", NS, "tiny")
    assert isvc is not None
    agents = Agents(FakeAgent())
    st = reconcile(kube, isvc, lambda *e: events.append(e), agents)
    assert st["phase"] == "Failed"
    assert st["message"].startswith(f"{kind} {name} exists and is not ours")
    assert kube.calls == calls_before  # nothing applied, created or patched
    assert kube.get(kind, NS, name)["spec"] == {"x": 1}  # type: ignore[index]
    again = reconcile(kube, {**isvc, "status": st}, lambda *e: events.append(e), agents)
    assert again["message"] == st["message"]
    assert [r for _, r, _ in events] == ["ObjectNotOurs"]  # once, not every reconcile


def test_one_checkpoint_per_service_at_a_time() -> None:
    """Two Checkpoints of one service: the younger waits (Pending, WaitingForCheckpoint)
    while the older runs, and starts once it is finished; the agent never has two."""
    kube, events = world()
    release = threading.Event()
    agent = FakeAgent(manifest=MANIFEST, release=release)
    agents = Agents(agent)
    created = now_iso()  # both just made (a queue past its timeout fails instead)
    first = new_ckpt(kube, "c1")
    first["metadata"]["creationTimestamp"] = created
    kube.put(first)
    second = new_ckpt(kube, "c2")
    second["metadata"].update(uid="9876543210", creationTimestamp=created)
    kube.put(second)

    def step(name: str) -> dict[str, Any]:
        body = kube.get("Checkpoint", NS, name)
        return cp.step(kube, body, lambda *e: events.append(e), agents)  # type: ignore[arg-type]

    assert step("c2")["reason"] == "WaitingForCheckpoint"  # c1 is older: it goes first
    assert step("c1")["phase"] == "Running"
    assert agent.in_checkpoint.wait(WAIT)
    waiting = step("c2")
    assert waiting["phase"] == "Pending" and "Checkpoint c1 of tiny" in waiting["message"]
    assert len(agent.checkpoints) == 1
    release.set()
    assert drive(kube, agents, events, "c1")["phase"] == "Ready"
    assert drive(kube, agents, events, "c2")["phase"] == "Ready"
    assert agent.checkpoints == [
        b.checkpoint_path("c1", "0123456789"),
        b.checkpoint_path("c2", "9876543210"),
    ]


def test_a_checkpoint_of_another_service_does_not_wait() -> None:
    ahead = cp.checkpoint_ahead(
        [
            {
                "metadata": {"name": "a"},
                "spec": {"inferenceService": "other"},
                "status": {"phase": "Running"},
            },
            {
                "metadata": {"name": "b"},
                "spec": {"inferenceService": "tiny"},
                "status": {"phase": "Ready"},
            },
        ],
        {"metadata": {"name": "z"}, "spec": {"inferenceService": "tiny"}},
    )
    assert ahead == ""


def test_a_checkpoint_in_the_object_store_is_deleted_through_a_node_agent() -> None:
    """A node-mode checkpoint published to the object store: deleting it starts a Job
    that asks its node's agent (the pod holds no store credential), at once, even while
    replicas restored from it run (they map their node cache's copy, not the store's)."""
    st = {
        "phase": "Ready",
        "path": f"{CHECKPOINT_MOUNT}/c1-0123",
        "volume": {"emptyDir": {}},
        "image": "rekindle.local/runtime-cpu:dev",
        "storageType": "node",
        "published": "objectStore",
    }
    assert cp.has_data({"spec": {}, "status": st})
    assert not cp.has_data({"spec": {}, "status": {**st, "published": "none"}})
    assert not cp.has_data({"spec": {"deletionPolicy": "Retain"}, "status": st})
    kube, events = world()
    body = new_ckpt(kube)
    body["status"] = st
    out = cp.delete_data(kube, body, lambda *e: events.append(e), Agents(FakeAgent()))  # type: ignore[arg-type]
    assert out == f"deleting {st['path']}"
    assert events[-1] == (
        "Normal",
        "CheckpointDataDeleted",
        "deleting checkpoint c1-0123 in the node agents' object store (deletionPolicy Delete)",
    )
    (job,) = [o for (k, _, _), o in kube.objs.items() if k == "Job"]
    pod = job["spec"]["template"]["spec"]  # type: ignore[index]
    (c,) = pod["containers"]
    assert c["command"] == ["rekindle", "remove-checkpoint", "--from-store", st["path"]]
    assert pod["volumes"] == [{"name": "rekindle-node", "emptyDir": {}}]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["runAsNonRoot"] is True
    assert {e["name"] for e in c["env"]} == {"REKINDLE_NODE_SOCKET", "REKINDLE_POD_UID"}
    assert "affinity" not in pod
