"""`kubectl rekindle bench --scale-out`'s plan: what it refuses and which nodes it picks,
from recorded API answers (the trials themselves run on the cluster)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from rekindle_operator import scale_out_bench
from rekindle_operator.kube import Kube


class RecordedApi:
    """The apiserver's answers to the GETs plan makes."""

    def __init__(self, isvc: dict[str, Any], ck: dict[str, Any], nodes: list[dict[str, Any]]):
        self.isvc, self.ck, self.nodes = isvc, ck, nodes

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return {"InferenceService": self.isvc, "Checkpoint": self.ck}[kind]

    def list(self, kind: str, namespace: str, selector: str | None = None) -> list[Any]:
        ready = {"conditions": [{"type": "Ready", "status": "True"}]}
        return [{"metadata": {"name": f"p{i}"}, "status": ready} for i in range(2)]

    def request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        assert (method, path) == ("GET", "/api/v1/nodes")
        return {"items": self.nodes}


def plan(api: RecordedApi) -> scale_out_bench.Plan:
    return scale_out_bench.plan(cast(Kube, api), "ns", "svc", None, None)


def node(name: str, ready: bool = True, cordoned: bool = False) -> dict[str, Any]:
    cond = {"type": "Ready", "status": "True" if ready else "False"}
    return {
        "metadata": {"name": name},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"conditions": [cond]},
    }


def isvc(publish: str = "objectStore", **spec: Any) -> dict[str, Any]:
    storage = {"type": "node", "node": {"publish": publish}}
    return {
        "spec": {
            "runtime": {"image": "img", "imagePullPolicy": "Never"},
            "replicas": 2,
            "model": {"source": "/m", "servedName": "tiny"},
            "coldStart": {"storage": storage},
            **spec,
        },
        "status": {"checkpoint": "ck1"},
    }


CK = {"status": {"phase": "Ready", "path": "/var/lib/rekindle/checkpoints/ck1-a", "node": "a"}}


def test_the_warm_node_holds_it_and_the_cold_one_does_not() -> None:
    api = RecordedApi(isvc(), CK, [node("a"), node("b", cordoned=True), node("c"), node("d")])
    p = plan(api)
    assert (p.warm_node, p.cold_node, p.replicas, p.model) == ("a", "c", 2, "tiny")
    assert p.checkpoint_path == CK["status"]["path"]
    assert (p.image, p.pull_policy) == ("img", "Never")  # spec.runtime's, as the operator reads it
    ck = {"status": {**CK["status"], "cachedNodes": ["c"]}}
    p = plan(RecordedApi(isvc(), ck, [node("a"), node("c"), node("d")]))
    assert (p.warm_node, p.cold_node) == ("a", "d")


@pytest.mark.parametrize(
    ("svc", "nodes", "words"),
    [
        (isvc(publish="none"), [node("a"), node("b")], "needs checkpoints a node agent publishes"),
        (isvc(apiKeySecretRef={"name": "k"}), [node("a"), node("b")], "requires an API key"),
        (isvc(), [node("a")], "--cold-node: a Ready, schedulable node other than a"),
        (isvc(), [node("a", ready=False), node("b")], "--warm-node: none of"),
    ],
)
def test_what_cannot_be_benched_says_what_to_change(
    svc: dict[str, Any], nodes: list[dict[str, Any]], words: str
) -> None:
    with pytest.raises(SystemExit, match=words):
        plan(RecordedApi(svc, CK, nodes))


def test_a_trial_records_how_its_replica_came_up_and_the_restores_phases() -> None:
    svc = isvc()
    svc["status"]["pods"] = [
        {"name": "old", "coldStartPath": "restore"},
        {"name": "new", "coldStartPath": "restoreAfterPull", "restoreSeconds": {"pull": 12.5}},
    ]
    api = RecordedApi(svc, CK, [node("a"), node("c")])
    got = scale_out_bench._pod_status(cast(Kube, api), plan(api), "new", wait_s=0)
    assert (got["coldStartPath"], got["restoreSeconds"]) == ("restoreAfterPull", {"pull": 12.5})
    assert scale_out_bench._pod_status(cast(Kube, api), plan(api), "gone", wait_s=0) == {}
