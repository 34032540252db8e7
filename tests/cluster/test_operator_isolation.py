"""Isolation and deletion between InferenceServices, on the real local cluster.

Two InferenceServices of the same name in two namespaces share one hostPath
root on the node (the default layout): each pod mounts only its own
NAMESPACE/NAME directory of it (subPath), carries no service-account token,
and gets a NetworkPolicy; neither can see nor write the other's checkpoints
(checked in the live pod spec and with `kubectl exec`). Then the namespace of
one, holding a Checkpoint with data, is deleted while the operator runs: it
finishes in bounded time and the data is removed from the node.

vLLM does not have to become Ready for any of this: the checks run as soon as
the containers run, and everything is deleted right after.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.mapped_files.immutable import remove_tree
from rekindle_agent.restoring.kdat_cache import CACHE_SUBDIR as KDAT_DIR

from tests.cluster.cluster_tools import create_namespace, kubectl, kubectl_json, wait_until
from tests.cluster.operator_fixtures import (
    RUNTIME_IMAGE,
    OperatorProcess,
    apply,
    get,
    install_crds,
    isvc_manifest,
    pods_of,
    release,
    require_runtime_image,
    wind_down,
)

pytestmark = pytest.mark.cluster
NAME = "tiny"
MOUNT = "/var/lib/rekindle/checkpoints"
# The operator's own namespace and pod labels, as the chart sets them: each
# InferenceService gets a NetworkPolicy naming them (the local CNI bridge does not
# enforce NetworkPolicy, so the operator running here still reaches the agents).
OPERATOR_LABELS = "app.kubernetes.io/name=rekindle-test-operator"


@pytest.fixture(scope="module")
def two(
    cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Namespaces a and b, an operator watching both, and the shared hostPath root."""
    require_runtime_image()
    install_crds()
    a, b = create_namespace("rka"), create_namespace("rkb")
    root = Path(f"/var/lib/rekindle/test-iso-{a}")
    op = OperatorProcess(
        [a, b],
        tmp_path_factory.mktemp("operator") / "operator.log",
        env={
            "REKINDLE_OPERATOR_NAMESPACE": b,
            "REKINDLE_OPERATOR_POD_LABELS": OPERATOR_LABELS,
            "REKINDLE_ALLOWED_IMAGES": RUNTIME_IMAGE,
        },
    )
    op.start()
    try:
        yield {"a": a, "b": b, "root": root, "operator": op}
    finally:
        for ns in (a, b):
            wind_down(ns)
        op.kill(signal.SIGTERM)
        print(f"operator log tail:\n{op.tail()}")
        for ns in (a, b):
            release(ns)
            kubectl("delete", "namespace", ns, "--wait=false", check=False)
        with contextlib.suppress(OSError):
            remove_tree(root)  # immutable pages images: rm -rf cannot


def _running_pod(ns: str) -> dict[str, Any]:
    """The InferenceService's pod once its container runs (vLLM may still be booting)."""

    def running() -> bool:
        pods = pods_of(NAME, ns)
        return bool(pods) and all(
            (c.get("state") or {}).get("running")
            for c in (pods[0].get("status") or {}).get("containerStatuses") or [{}]
        )

    wait_until(f"a running pod of {ns}/{NAME}", running, 240, namespace=ns)
    return pods_of(NAME, ns)[0]


def _own_entries(ls: str) -> list[str]:
    """A service's checkpoint directory listing, less the agent's kdat cache directory."""
    return [e for e in ls.split() if e != KDAT_DIR]


def _exec(ns: str, pod: str, script: str) -> str:
    r = kubectl("exec", "-n", ns, pod, "--", "sh", "-c", script, check=False)
    assert r.returncode == 0, f"{script}: {r.stdout}{r.stderr}"
    return r.stdout


def test_isolation_then_namespace_deletion(two: dict[str, Any]) -> None:
    a, b, root = two["a"], two["b"], two["root"]
    for ns in (a, b):
        doc = isvc_manifest(NAME, str(root), resources={"cpu": "250m", "memory": "6Gi"})
        r = apply(doc, ns)
        assert r.returncode == 0, r.stderr
    pods = {ns: _running_pod(ns) for ns in (a, b)}

    # The live pod spec: only NAMESPACE/NAME of the shared root, no API token.
    for ns, pod in pods.items():
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        (c,) = spec["containers"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["checkpoints"]["mountPath"] == MOUNT
        assert mounts["checkpoints"]["subPath"] == f"{ns}/{NAME}"
        assert mounts["agent-token"]["readOnly"] is True
        assert not [m for m in c["volumeMounts"] if "serviceaccount" in m["mountPath"]]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["checkpoints"]["hostPath"]["path"] == str(root)
        np = kubectl_json("get", "networkpolicy", f"{NAME}-agent", "-n", ns)
        admin = np["spec"]["ingress"][1]
        assert admin["ports"] == [{"port": "admin", "protocol": "TCP"}]
        assert admin["from"][0]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": b
        }
        assert (
            kubectl("get", "secret", f"{NAME}-signing-key", "-n", ns, check=False).returncode == 0
        )

    name_a, name_b = (pods[ns]["metadata"]["name"] for ns in (a, b))
    token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    for ns, name in ((a, name_a), (b, name_b)):
        assert _exec(ns, name, f"test -e {token} && echo present || echo absent") == "absent\n"
    # Each writes into its own directory (as a checkpoint would) ...
    _exec(a, name_a, f"mkdir -p {MOUNT}/ck-a && echo secret-a > {MOUNT}/ck-a/pages-1.img")
    _exec(b, name_b, f"mkdir -p {MOUNT}/ck-b && echo secret-b > {MOUNT}/ck-b/pages-1.img")
    # ... and sees only that: not the other's files, not the shared root above it
    # (beside its own CRIU kdat cache, which the agent keeps per service and node).
    assert _own_entries(_exec(a, name_a, f"ls -A {MOUNT}")) == ["ck-a"]
    assert _own_entries(_exec(b, name_b, f"ls -A {MOUNT}")) == ["ck-b"]
    assert "secret-a" not in _exec(b, name_b, f"grep -r secret-a {MOUNT} /var/lib/rekindle || true")
    # On the node the two directories sit side by side under the shared root.
    assert (root / a / NAME / "ck-a" / "pages-1.img").read_text() == "secret-a\n"
    assert (root / b / NAME / "ck-b" / "pages-1.img").read_text() == "secret-b\n"
    assert sorted(p.name for p in root.iterdir()) == sorted([a, b])

    # A Checkpoint with data whose InferenceService is gone (the operator fails
    # it at once, so nothing races the status written here as the operator
    # records a finished one); then a's namespace is deleted while the
    # operator runs: it must finish.
    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "ck"},
        "spec": {"inferenceService": "gone"},
    }
    assert apply(ck, a).returncode == 0
    wait_until(
        "the orphan Checkpoint Failed",
        lambda: ((get("rkcp", "ck", a) or {}).get("status") or {}).get("phase") == "Failed",
        60,
    )
    node = pods[a]["spec"]["nodeName"]
    status = {
        "phase": "Ready",
        "reason": "Verified",
        "path": f"{MOUNT}/ck-a",
        "subPath": f"{a}/{NAME}",
        "node": node,
        "volume": {
            "name": "checkpoints",
            "hostPath": {"path": str(root), "type": "DirectoryOrCreate"},
        },
        "image": RUNTIME_IMAGE,
        "imagePullPolicy": "Never",
        "completedAt": "2020-01-01T00:00:00Z",
    }
    kubectl(
        "patch", "rkcp", "ck", "-n", a, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    wait_until(
        "the operator's finalizer on the Checkpoint (it has data to delete)",
        lambda: (
            "rekindle.dev/finalizer"
            in ((get("rkcp", "ck", a) or {}).get("metadata", {}).get("finalizers") or [])
        ),
        60,
    )
    started = time.monotonic()
    kubectl("delete", "namespace", a, "--wait=false")
    wait_until(
        f"namespace {a} gone",
        lambda: kubectl("get", "namespace", a, check=False).returncode != 0,
        180,
    )
    took = time.monotonic() - started
    # No Job can start in a terminating namespace: the operator removed the
    # hostPath data from its own namespace, on the node that holds it.
    data = root / a / NAME / "ck-a"
    wait_until(f"{data} removed", lambda: not data.exists(), 120)
    jobs = kubectl_json("get", "jobs", "-n", b)["items"]
    (job,) = [j for j in jobs if j["metadata"]["name"].startswith(f"rm-{a}-ck-")]
    terms = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms[0]["matchFields"][0]["values"] == [node]
    # b's data is untouched.
    assert (root / b / NAME / "ck-b" / "pages-1.img").exists()
    print(f"namespace deletion took {took:.0f}s")
    assert two["operator"].alive()


def test_image_outside_the_allowed_list_is_refused_by_the_operator(two: dict[str, Any]) -> None:
    b = two["b"]
    doc = isvc_manifest("evil", str(two["root"]), replicas=0)
    doc["spec"]["runtime"]["image"] = "registry.example/evil:1"
    assert apply(doc, b).returncode == 0  # no admission policy here: the operator refuses

    def failed() -> bool:
        st = (get("rkis", "evil", b) or {}).get("status") or {}
        return st.get("phase") == "Failed" and "not an allowed runtime image" in st.get(
            "message", ""
        )

    wait_until("evil Failed with the reason", failed, 60)
    assert kubectl("get", "deploy", "evil", "-n", b, check=False).returncode != 0
    kubectl("delete", "rkis", "evil", "-n", b, "--wait=false", check=False)
