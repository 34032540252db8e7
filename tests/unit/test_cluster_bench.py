"""`kubectl rekindle bench`'s bookkeeping: what it waits for, what its results record.

The timing itself runs against the real cluster (tests/cluster and `make demo`);
here a stand-in apiserver answers the few reads, to check the pure logic around them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rekindle_operator import cluster_bench as bench
from rekindle_operator.kube import KubeError


class Api:
    """Answers GETs from a dict of path -> object (or a list of them, one per call)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls.append(path)
        value = self.answers.get(path)
        if isinstance(value, list):
            value = value.pop(0) if len(value) > 1 else value[0]
        if value is None:
            raise KubeError(403, "forbidden")
        return value

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        """As Kube.get: None for a 404, any other refusal raised."""
        path = f"{kind}/{ns}/{name}"
        if self.answers.get(path, ...) is None:
            self.calls.append(path)
            return None
        out: dict[str, Any] = self.request("GET", path)
        return out


def test_wait_pointer_waits_for_the_operator_to_point_the_configmap() -> None:
    cm = f"ConfigMap/ns/{bench.b.configmap_name('tiny')}"
    api = Api({cm: [{"data": {"checkpoint": "/ck/1"}}, {"data": {"checkpoint": ""}}]})
    bench.wait_pointer(api, "ns", "tiny", restore=False, timeout=5)  # type: ignore[arg-type]
    assert api.calls == [cm, cm]  # the first answer still pointed at the checkpoint
    api = Api({cm: [{"data": {"checkpoint": ""}}]})
    with pytest.raises(TimeoutError, match="did not point tiny's ConfigMap at the checkpoint"):
        bench.wait_pointer(api, "ns", "tiny", restore=True, timeout=0.3)  # type: ignore[arg-type]


def test_without_read_access_to_configmaps_it_waits_for_the_status_to_catch_up() -> None:
    isvc = "InferenceService/ns/tiny"
    behind = {"metadata": {"generation": 5}, "status": {"observedGeneration": 4}}
    caught_up = {"metadata": {"generation": 5}, "status": {"observedGeneration": 5}}
    api = Api({isvc: [behind, caught_up]})  # the ConfigMap: 403 (not in answers)
    api.answers.pop(f"ConfigMap/ns/{bench.b.configmap_name('tiny')}", None)
    assert not bench.pointed(api, "ns", "tiny", restore=True)  # type: ignore[arg-type]
    assert bench.pointed(api, "ns", "tiny", restore=True)  # type: ignore[arg-type]


def test_environment_names_the_node_images_versions_and_client_load() -> None:
    node = {
        "status": {
            "nodeInfo": {
                "kernelVersion": "6.18",
                "osImage": "Debian 12",
                "kubeletVersion": "v1.35.4",
                "containerRuntimeVersion": "containerd://1.6.20",
            },
            "capacity": {"cpu": "2", "memory": "24Gi"},
        }
    }
    operator = {
        "metadata": {
            "namespace": "rekindle-system",
            "name": "rekindle",
            "labels": {"app.kubernetes.io/version": "0.1.0"},
        },
        "spec": {"template": {"spec": {"containers": [{"image": "rekindle.local/operator:dev"}]}}},
    }
    api = Api({"/api/v1/nodes/vm": node, "/apis/apps/v1/deployments": {"items": [operator]}})
    images = {"vllm": "rekindle.local/runtime-cpu:dev (sha256:abc)"}
    trials = [
        bench.Trial("naive", 0, 40.0, 41.0, "booted", "", 39.0, "p1", "vm", images),
        bench.Trial("restore", 0, 2.0, 2.1, "restored", "", 1.1, "p2", "vm", images),
    ]
    env = bench.environment(api, trials, (1.0, 2.0, 3.0), 0.0)  # type: ignore[arg-type]
    assert env["date"] == "1970-01-01T00:00:00Z" and env["timing"] == bench.TIMING
    assert "asked only once the pod is Ready" in env["timing"]
    assert env["node"] == {
        "name": "vm",
        "kernel": "6.18",
        "os": "Debian 12",
        "kubelet": "v1.35.4",
        "container_runtime": "containerd://1.6.20",
        "cpus": "2",
        "memory": "24Gi",
    }
    assert env["versions"]["operator"] == {
        "deployments": [
            {
                "deployment": "rekindle-system/rekindle",
                "version": "0.1.0",
                "images": ["rekindle.local/operator:dev"],
            }
        ]
    }
    assert env["versions"]["images"] == {"naive": images, "restore": images}
    assert env["client"]["load_avg_at_start"] == [1.0, 2.0, 3.0]
    assert len(env["client"]["load_avg_at_end"]) == 3
    # What the plugin may not read is said, not guessed.
    env = bench.environment(Api({}), trials, (0.0, 0.0, 0.0), 0.0)  # type: ignore[arg-type]
    assert env["node"]["error"].startswith("could not read the node")
    assert env["versions"]["operator"]["error"].startswith("could not list")


def test_pod_images_and_per_trial_values_in_the_json(tmp_path: Path) -> None:
    pod = {
        "status": {
            "containerStatuses": [
                {"name": "vllm", "image": "rt:dev", "imageID": "sha256:1"},
                {"name": "side", "image": "s:1"},
            ]
        }
    }
    assert bench.pod_images(pod) == {"vllm": "rt:dev (sha256:1)", "side": "s:1 (no digest)"}
    trials = [
        bench.Trial("naive", i, 40.0 + i, 41.0 + i, "booted", "", None, f"p{i}", "vm")
        for i in range(2)
    ]
    bench.write_json(tmp_path / "r.json", trials, {"command": "kubectl rekindle bench t"})
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [t["first_token_s"] for t in doc["trials"]] == [41.0, 42.0]
    assert [t["pod"] for t in doc["trials"]] == ["p0", "p1"]
    assert doc["summary"]["naive"]["first_token_s"]["median"] == 41.5
