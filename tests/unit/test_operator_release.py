"""The chart's uninstall hook: stop the operator, then let go of its finalizers."""

from __future__ import annotations

from typing import Any

from rekindle_operator import release


class Kube:
    def __init__(self) -> None:
        self.patches: list[tuple[str, str, str, dict[str, Any]]] = []
        self.pods = [{"metadata": {"name": "op-1"}}]
        self.objs = {
            "checkpoints": [
                {
                    "metadata": {
                        "name": "c1",
                        "namespace": "a",
                        "finalizers": ["rekindle.dev/finalizer", "other/keep"],
                    },
                    "status": {"path": "/var/lib/rekindle/checkpoints/c1-1234"},
                },
                {"metadata": {"name": "c2", "namespace": "a"}},
            ],
            "inferenceservices": [
                {
                    "metadata": {
                        "name": "s",
                        "namespace": "a",
                        "finalizers": ["rekindle.dev/finalizer"],
                    }
                }
            ],
        }
        self.urls: list[str] = []

    def merge_patch(self, kind: str, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.patches.append((kind, ns, name, patch))
        if kind == "Deployment":
            self.pods = []  # the ReplicaSet removes the operator's pod
        return {}

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict[str, Any]]:
        assert kind == "Pod" and selector == "app=op"
        return self.pods

    def request(self, method: str, path: str) -> dict[str, Any]:
        self.urls.append(path)
        return {"items": self.objs[path.rsplit("/", 1)[1]]}


def test_stop_then_release() -> None:
    kube = Kube()
    release.stop_operator(kube, "rk-system", "rk-rekindle", "app=op", timeout=5)  # type: ignore[arg-type]
    assert kube.patches[0] == ("Deployment", "rk-system", "rk-rekindle", {"spec": {"replicas": 0}})
    said: list[str] = []
    n = release.release_finalizers(kube, ["a"], said.append)  # type: ignore[arg-type]
    assert n == 2
    assert ("Checkpoint", "a", "c1", {"metadata": {"finalizers": ["other/keep"]}}) in kube.patches
    assert ("InferenceService", "a", "s", {"metadata": {"finalizers": None}}) in kube.patches
    assert not [p for p in kube.patches if p[2] == "c2"]  # nothing to release
    assert "its data stays at /var/lib/rekindle/checkpoints/c1-1234" in said[0]
    assert kube.urls[0] == "/apis/rekindle.dev/v1alpha1/namespaces/a/checkpoints"
    # No namespaces: every namespace (rbac.clusterWide).
    kube.urls.clear()
    release.release_finalizers(kube, [], said.append)  # type: ignore[arg-type]
    assert kube.urls[0] == "/apis/rekindle.dev/v1alpha1/checkpoints"
