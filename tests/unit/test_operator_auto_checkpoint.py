"""spec.coldStart.checkpoint: the operator checkpoints each new spec by itself, with one
replica more while it runs, and keeps `keep` of its own checkpoints."""

from __future__ import annotations

from typing import Any

from rekindle_operator import auto_checkpoint as auto
from rekindle_operator import checkpointing as cp
from rekindle_operator.pods import Agents
from rekindle_operator.reconcile import reconcile, spec_of
from rekindle_operator.spec_fingerprint import spec_fingerprint
from rekindle_operator.status import now_iso

from tests.unit.test_operator_checkpointing import (
    MANIFEST,
    NS,
    FakeAgent,
    FakeKube,
    current_fingerprint,
    drive,
    pod_obj,
    world,
)

FP = "0123456789abcdef"


def ckpt(
    name: str, phase: str | None, *, auto_for: str = "", completed: str = ""
) -> dict[str, Any]:
    c = (
        auto.build("tiny", NS, auto_for)
        if auto_for
        else {
            "kind": "Checkpoint",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"inferenceService": "tiny"},
        }
    )
    c["metadata"]["name"] = name
    if phase:
        c["status"] = {"phase": phase, "completedAt": completed}
    return c


def test_due_once_per_spec_with_a_ready_replica_and_nothing_running() -> None:
    assert auto.due("tiny", FP, [], None, ready_current=1)
    assert not auto.due("tiny", FP, [], None, ready_current=0)  # nothing to dump yet
    assert not auto.due("tiny", FP, [], {"metadata": {"name": "x"}}, 1)  # one is usable
    running = [ckpt("by-hand", "Running")]
    assert not auto.due("tiny", FP, running, None, 1)  # one at a time
    failed = [ckpt(auto.auto_name("tiny", FP), "Failed", auto_for=FP)]
    assert not auto.due("tiny", FP, failed, None, 1)  # not retried in a loop


def test_retention_keeps_the_newest_and_never_the_one_in_use_or_by_hand() -> None:
    checkpoints = [
        ckpt("a1", "Ready", auto_for="1" * 16, completed="2026-01-01T00:00:00Z"),
        ckpt("a2", "Ready", auto_for="2" * 16, completed="2026-01-02T00:00:00Z"),
        ckpt("a3", "Ready", auto_for=FP, completed="2026-01-03T00:00:00Z"),
        ckpt("a0-failed-old-spec", "Failed", auto_for="9" * 16),
        ckpt("a4-failed-this-spec", "Failed", auto_for=FP),
        ckpt("by-hand", "Ready", completed="2025-01-01T00:00:00Z"),
    ]
    assert auto.to_delete(checkpoints, "tiny", FP, keep=2, in_use="a3") == [
        "a1",
        "a0-failed-old-spec",
    ]
    # The one new replicas use is never deleted, however old.
    assert auto.to_delete(checkpoints, "tiny", FP, keep=1, in_use="a1") == [
        "a2",
        "a0-failed-old-spec",
    ]


def test_surge_only_while_a_keep_serving_checkpoint_is_unfinished() -> None:
    assert auto.surge([ckpt("x", None, auto_for=FP)], "tiny") == 1
    assert auto.surge([ckpt("x", "Ready", auto_for=FP)], "tiny") == 0
    assert auto.surge([ckpt("by-hand", "Running")], "tiny") == 0


def _auto_world() -> tuple[FakeKube, list[Any], dict[str, Any]]:
    kube, events = world()
    body = kube.get("InferenceService", NS, "tiny")
    assert body is not None
    body["spec"]["coldStart"] = {"checkpoint": {"auto": True, "keep": 1}}
    kube.put(body)
    return kube, events, body


def replicas(kube: FakeKube) -> int:
    dep = kube.get("Deployment", NS, "tiny")
    assert dep is not None
    return int(dep["spec"]["replicas"])


def test_a_new_spec_is_checkpointed_with_one_replica_more_meanwhile() -> None:
    kube, events, body = _auto_world()
    emitted: list[tuple[str, str, str]] = []
    reconcile(kube, body, lambda *e: emitted.append(e), Agents(FakeAgent()))
    fp = spec_fingerprint(spec_of(body))
    assert fp == current_fingerprint()  # the replica runs this spec
    made = kube.get("Checkpoint", NS, auto.auto_name("tiny", fp))
    assert made is not None and made["spec"]["keepServing"] is True
    made["metadata"]["creationTimestamp"] = now_iso()  # as the apiserver stamps it
    kube.put(made)
    assert made["spec"]["deletionPolicy"] == "Delete"
    assert any(r == "AutoCheckpoint" for _, r, _ in emitted)
    # The next reconcile surges one replica while it is unfinished.
    reconcile(kube, body, lambda *e: None, Agents(FakeAgent()))
    assert replicas(kube) == 2
    # keepServing: with one ready replica it waits; with two it runs on one of them.
    agents = Agents(FakeAgent(manifest=MANIFEST))
    st = cp.step(kube, made, lambda *e: None, agents)
    assert st["phase"] == "Pending" and "a second ready replica" in st["message"]
    kube.put(pod_obj("tiny-surge", ip="10.244.0.10"))
    assert drive(kube, agents, events, made["metadata"]["name"])["phase"] == "Ready"
    # Done: back to the spec's replicas, and nothing more is due for this spec.
    reconcile(kube, body, lambda *e: None, Agents(FakeAgent()))
    assert replicas(kube) == 1
    autos = [o for (k, _, _), o in kube.objs.items() if k == "Checkpoint" and auto.is_auto(o)]
    assert [o["metadata"]["name"] for o in autos] == [made["metadata"]["name"]]


def test_auto_off_or_restore_never_makes_none() -> None:
    kube, _ = world()
    body = kube.get("InferenceService", NS, "tiny")
    assert body is not None
    reconcile(kube, body, lambda *e: None, Agents(FakeAgent()))
    body["spec"]["coldStart"] = {"checkpoint": {"auto": True}, "restorePolicy": "Never"}
    reconcile(kube, body, lambda *e: None, Agents(FakeAgent()))
    assert not [k for (k, _, _) in kube.objs if k == "Checkpoint"]
