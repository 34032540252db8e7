"""The chart's RBAC holds exactly what the operator does: no call it makes is refused, and
no verb is granted that nothing uses.

The operator's own calls all go through rekindle_operator.kube.Kube; here a recording
stand-in of it (the unit suite's in-memory apiserver) runs the operator's flows: the
reconcile of every storage kind with its NetworkPolicy and admin TLS, a checkpoint,
its data's cleanup Job (in the service's namespace, and in the operator's own for a
namespace being deleted), the uninstall hook. Each call is mapped to the verb the
apiserver authorizes (server-side apply is a `patch`, and a `create` too when the
object does not exist yet; create-if-absent is a `get`, then a `create`). kopf's own
calls, which do not go through Kube, are listed below from its documented behaviour.
The rendered chart's Roles must equal the union. The in-cluster proof that nothing
is missing is tests/cluster/test_operator_chart.py (the chart's operator, with these
rules, reconciles an InferenceService).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from rekindle_operator import auto_checkpoint, release
from rekindle_operator import checkpointing as cp
from rekindle_operator.kube import _RESOURCES, KubeError
from rekindle_operator.pods import Agents
from rekindle_operator.reconcile import reconcile
from rekindle_operator.settings import Settings

from tests.unit.test_chart_templates import render
from tests.unit.test_operator_checkpointing import (
    MANIFEST,
    NS,
    FakeAgent,
    FakeKube,
    _ready_hostpath_checkpoint,
    drive,
    isvc_obj,
    new_ckpt,
    pod_obj,
    world,
)

OPERATOR_NS = "rk-system"  # where the operator runs (the chart's release namespace)
Grant = tuple[str, str, str]  # (API group, resource[/subresource], verb)

# kopf's calls (settings.peering.standalone: no peering objects): it lists and watches
# both CRDs, patches them (its finalizer, its progress annotations) and their status
# subresource (kopf patches /status when the CRD has one), and posts core v1 Events.
KOPF: set[Grant] = {
    *{
        ("rekindle.dev", r, v)
        for r in ("inferenceservices", "checkpoints")
        for v in ("list", "watch", "patch")
    },
    ("rekindle.dev", "inferenceservices/status", "patch"),
    ("rekindle.dev", "checkpoints/status", "patch"),
    ("", "events", "create"),
    # pod_gated: an event handler on the services' pods (placement.py)
    ("", "pods", "list"),
    ("", "pods", "watch"),
}


def _resource(kind: str, sub: str | None = None) -> tuple[str, str]:
    prefix, plural = _RESOURCES[kind]
    group = "" if prefix == "/api/v1" else prefix.split("/")[2]
    return group, plural + (f"/{sub}" if sub else "")


class RecordingKube(FakeKube):
    """FakeKube that records each call as (namespace, group, resource, verb)."""

    def __init__(self, forbid_jobs_in: str = "") -> None:
        super().__init__()
        self.grants: set[tuple[str, str, str, str]] = set()
        self.forbid_jobs_in = forbid_jobs_in  # a namespace being deleted refuses new Jobs

    def _seen(self, ns: str, kind: str, verb: str, sub: str | None = None) -> None:
        self.grants.add((ns, *_resource(kind, sub), verb))

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        self._seen(ns, kind, "get")
        return super().get(kind, ns, name)

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict[str, Any]]:
        self._seen(ns, kind, "list")
        return super().list(kind, ns, selector)

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self._seen(obj["metadata"]["namespace"], obj["kind"], "create")
        if obj["kind"] == "Job" and obj["metadata"]["namespace"] == self.forbid_jobs_in:
            raise KubeError(403, "unable to create new content in namespace: being terminated")
        return super().create(obj)

    def create_if_absent(self, obj: Mapping[str, Any]) -> bool:
        meta = obj["metadata"]
        if self.get(obj["kind"], meta["namespace"], meta["name"]) is not None:
            return False  # as Kube.create_if_absent: a get, and a create only when absent
        return super().create_if_absent(obj)

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply is a patch, authorized as a create when the object is absent."""
        meta = obj["metadata"]
        self._seen(meta["namespace"], obj["kind"], "patch")
        if FakeKube.get(self, obj["kind"], meta["namespace"], meta["name"]) is None:
            self._seen(meta["namespace"], obj["kind"], "create")
        return super().apply(obj)

    def merge_patch(
        self, kind: str, ns: str, name: str, patch: Mapping[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        self._seen(ns, kind, "patch", sub)
        return super().merge_patch(kind, ns, name, patch, sub)

    def delete(self, kind: str, ns: str, name: str) -> bool:
        self._seen(ns, kind, "delete")
        return super().delete(kind, ns, name)

    def request(self, method: str, url_path: str, *args: Any, **kw: Any) -> Any:
        """The uninstall hook's list of a CRD's objects: GET /apis/G/V/namespaces/NS/PLURAL."""
        parts = url_path.strip("/").split("/")
        assert method == "GET" and parts[3] == "namespaces", url_path
        kind = next(k for k, (_, plural) in _RESOURCES.items() if plural == parts[5])
        return {"items": self.list(kind, parts[4])}


def _recorded(kube: RecordingKube) -> RecordingKube:
    """world()'s objects in a recording stand-in."""
    rec = RecordingKube(kube.forbid_jobs_in if isinstance(kube, RecordingKube) else "")
    rec.objs = kube.objs
    return rec


def operator_calls() -> tuple[set[Grant], set[Grant]]:
    """(grants used in the services' namespace, grants used in the operator's own)."""
    settings = Settings(
        operator_namespace=OPERATOR_NS,
        operator_labels={"app": "op"},
        front_url="http://rekindle-front.rekindle.svc:8080",
    )
    all_grants: set[tuple[str, str, str, str]] = set()

    def run(flow: Any) -> None:
        base, events = world()
        kube = _recorded(base)  # type: ignore[arg-type]
        flow(kube, events)
        all_grants.update(kube.grants)

    # The flows' own reads and deletes (a garbage-collected pod) go around the recorder.
    def read(kube: RecordingKube, kind: str, name: str, ns: str = NS) -> dict[str, Any]:
        obj = FakeKube.get(kube, kind, ns, name)
        assert obj is not None
        return obj

    def gone(kube: RecordingKube, kind: str, name: str) -> None:
        FakeKube.delete(kube, kind, NS, name)

    def reconcile_each_storage(kube: RecordingKube, events: Any) -> None:
        body = read(kube, "InferenceService", "tiny")
        assert body is not None
        for spec in (
            {},
            {"coldStart": {"storage": {"type": "hostPath"}}},
            {"coldStart": {"storage": {"type": "node", "node": {"publish": "pvc"}}}},
            {"adminTLS": {"secretName": "tiny-tls"}},
            {"disruptionBudget": {"maxUnavailable": 1}},  # made
            {"disruptionBudget": None},  # and removed again
            {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}},  # made
            {"autoscaling": None},  # and removed again
        ):
            body["spec"] = {**body["spec"], **spec}
            reconcile(kube, body, lambda *e: None, Agents(FakeAgent()), settings)

    def first_reconcile(kube: RecordingKube, events: Any) -> None:
        """A new InferenceService: nothing of it exists yet."""
        body = kube.put(isvc_obj("fresh"))
        reconcile(kube, body, lambda *e: None, Agents(FakeAgent()), settings)
        assert FakeKube.get(kube, "Deployment", NS, "fresh") is not None

    def automatic_checkpoints(kube: RecordingKube, events: Any) -> None:
        """spec.coldStart.checkpoint: one created for the current spec, one retired."""
        body = read(kube, "InferenceService", "tiny")
        body["spec"]["coldStart"] = {"checkpoint": {"auto": True, "keep": 1}}
        kube.put(body)
        for i in (1, 2):  # two Ready automatic ones of an older spec: keep 1
            old = auto_checkpoint.build("tiny", NS, f"{i}" * 16)
            old["status"] = {"phase": "Ready", "completedAt": f"2026-01-0{i}T00:00:00Z"}
            kube.put(old)
        reconcile(kube, body, lambda *e: None, Agents(FakeAgent()), settings)
        assert FakeKube.get(kube, "Checkpoint", NS, "tiny-auto-1111111111") is None
        assert any(n.startswith("tiny-auto-") and n != "tiny-auto-2222222222"
                   for (k, _, n) in kube.objs if k == "Checkpoint")  # fmt: skip

    def checkpoint_and_clean_up(kube: RecordingKube, events: Any) -> None:
        new_ckpt(kube)
        drive(kube, Agents(FakeAgent(manifest=MANIFEST)), events)
        body = read(kube, "Checkpoint", "c1")
        gone(kube, "Pod", "tiny-abc")
        assert cp.delete_data(kube, body, lambda *e: None, Agents(FakeAgent())).startswith(  # type: ignore[arg-type]
            "deleting"
        )

    def clean_up_from_the_operators_namespace(kube: RecordingKube, events: Any) -> None:
        body = _ready_hostpath_checkpoint(kube, events)
        gone(kube, "Pod", "tiny-abc")
        kube.forbid_jobs_in = NS
        out = cp.delete_data(kube, body, lambda *e: None, Agents(FakeAgent()), 0, settings)
        assert out.startswith("deleting"), out

    def uninstall_hook(kube: RecordingKube, events: Any) -> None:
        kube.put(
            {"kind": "Deployment", "metadata": {"name": "rk-rekindle", "namespace": OPERATOR_NS}}
        )
        release.stop_operator(kube, OPERATOR_NS, "rk-rekindle", "app=op", timeout=0)  # type: ignore[arg-type]
        body = read(kube, "InferenceService", "tiny")
        body["metadata"]["finalizers"] = [release.FINALIZER]
        kube.put(body)
        assert release.release_finalizers(kube, [NS], say=lambda _: None) == 1  # type: ignore[arg-type]

    def place_a_new_pod(kube: RecordingKube, events: Any) -> None:
        """A gated pod of a node-storage service released toward its checkpoint's node."""
        from rekindle_operator import placement
        from rekindle_operator.reconcile import release_pod

        body = read(kube, "InferenceService", "tiny")
        body["status"] = {**(body.get("status") or {}), "checkpoint": "c1"}
        kube.put(body)
        new_ckpt(kube)
        gated = pod_obj("tiny-new")
        gated["spec"] = {"schedulingGates": [{"name": placement.GATE}]}
        kube.put(gated)
        release_pod(kube, gated)
        assert not placement.gated(read(kube, "Pod", "tiny-new"))

    for flow in (
        place_a_new_pod,
        first_reconcile,
        automatic_checkpoints,
        reconcile_each_storage,
        checkpoint_and_clean_up,
        clean_up_from_the_operators_namespace,
        uninstall_hook,
    ):
        run(flow)
    service = {g[1:] for g in all_grants if g[0] == NS}
    own = {g[1:] for g in all_grants if g[0] == OPERATOR_NS}
    return service, own


def granted(role: Mapping[str, Any]) -> set[Grant]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.fixture(scope="module")
def roles() -> dict[str, set[Grant]]:
    docs = render()
    return {d["metadata"]["name"]: granted(d) for d in docs if d["kind"] == "Role"}


def test_the_services_role_is_exactly_what_the_operator_and_kopf_do(
    roles: dict[str, set[Grant]],
) -> None:
    service, _ = operator_calls()
    want = service | KOPF
    have = roles["rk-rekindle"]
    assert not want - have, f"the operator would be refused: {sorted(want - have)}"
    assert not have - want, f"granted but never used: {sorted(have - want)}"


def test_the_operators_own_role_is_exactly_what_it_does_there(
    roles: dict[str, set[Grant]],
) -> None:
    _, own = operator_calls()
    have = roles["rk-rekindle-self"]
    assert not own - have, f"the operator would be refused: {sorted(own - have)}"
    assert not have - own, f"granted but never used: {sorted(have - own)}"
