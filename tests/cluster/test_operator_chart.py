"""The Helm chart installs a working operator: in-cluster, with only the chart's RBAC.

The operator image (rekindle.local/operator:dev, `make images`) runs as the
chart's ServiceAccount, watching one fresh namespace; the checks exercise what
its Role must allow (status writes, events, owned objects) without a vLLM boot.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.cluster_tools import REPO, helm, kubectl, kubectl_json, wait_until
from tests.cluster.operator_fixtures import (
    OPERATOR_IMAGE,
    apply,
    install_crds,
    isvc_manifest,
    require_image,
    wait_status,
)

pytestmark = pytest.mark.cluster


@pytest.fixture()
def release(namespace: str) -> Iterator[str]:
    require_image(OPERATOR_IMAGE, "operator")
    install_crds()
    name = f"rk{uuid.uuid4().hex[:6]}"
    repo, tag = OPERATOR_IMAGE.rsplit(":", 1)
    r = helm(
        "install",
        name,
        str(REPO / "charts" / "rekindle"),
        "-n",
        namespace,
        "--set",
        f"image.repository={repo}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        f"watchNamespaces={{{namespace}}}",
        "--set",
        "statusIntervalSeconds=2",
        "--wait",
        "--timeout",
        "180s",
        check=False,
    )
    if r.returncode != 0:
        logs = kubectl(
            "logs", "-n", namespace, f"deploy/{name}-rekindle", "--tail=40", check=False
        ).stdout
        hint = route_hint(logs)
        helm("uninstall", name, "-n", namespace, check=False)
        pytest.fail(f"helm install failed: {r.stdout}{r.stderr}{hint}\noperator log:\n{logs}")
    yield name
    for kind in ("checkpoints.rekindle.dev", "inferenceservices.rekindle.dev"):
        kubectl("delete", kind, "--all", "-n", namespace, "--timeout=60s", check=False)
    helm("uninstall", name, "-n", namespace, check=False)


def route_hint(logs: str) -> str:
    """The local cluster's pods need a route to the Service CIDR to reach the apiserver."""
    if "Network is unreachable" not in logs:
        return ""
    return (
        "\npods have no route to the Service CIDR (the kubernetes Service): the cluster's CNI "
        'config needs one, e.g. "routes": [{"dst": "10.96.0.0/16"}] in the bridge plugin\'s '
        "ipam (scripts/local-cluster)"
    )


def operator_logs(namespace: str, release: str) -> str:
    return kubectl(
        "logs", "-n", namespace, f"deploy/{release}-rekindle", "--tail=80", check=False
    ).stdout


def test_chart_operator_reconciles_with_its_own_rbac(namespace: str, release: str) -> None:
    pods = kubectl_json(
        "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=operator"
    )["items"]
    assert pods and pods[0]["spec"]["serviceAccountName"] == f"{release}-rekindle"
    # An InferenceService scaled to zero: every owned object, status and events, no vLLM.
    doc: dict[str, Any] = isvc_manifest("zero", "/var/lib/rekindle/unused", replicas=0)
    assert apply(doc, namespace).returncode == 0
    try:
        obj = wait_status(
            "rkis",
            "zero",
            namespace,
            "ScaledToZero",
            lambda o: (o.get("status") or {}).get("phase") == "ScaledToZero",
            120,
        )
    except AssertionError as e:
        logs = operator_logs(namespace, release)
        raise AssertionError(f"{e}{route_hint(logs)}\noperator log:\n{logs}") from e
    assert obj["status"]["selector"] == "rekindle.dev/inferenceservice=zero"
    for kind, name in (
        ("deploy", "zero"),
        ("svc", "zero"),
        ("secret", "zero-agent-token"),
        ("configmap", "zero-rekindle"),
    ):
        assert kubectl("get", kind, name, "-n", namespace, check=False).returncode == 0, (
            kind,
            name,
        )
    # A Checkpoint of nothing fails at once, with an Event.
    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "orphan"},
        "spec": {"inferenceService": "nope"},
    }
    assert apply(ck, namespace).returncode == 0
    wait_status(
        "rkcp",
        "orphan",
        namespace,
        "Failed",
        lambda o: (o.get("status") or {}).get("reason") == "InferenceServiceNotFound",
        60,
    )
    wait_until(
        "an InferenceServiceNotFound event",
        lambda: any(
            e["reason"] == "InferenceServiceNotFound"
            for e in kubectl_json("get", "events", "-n", namespace)["items"]
        ),
        30,
    )
    # Deletion through the finalizer works with the chart's permissions.
    kubectl("delete", "rkcp", "orphan", "-n", namespace, "--timeout=60s")
    assert "Forbidden" not in operator_logs(namespace, release), json.dumps(
        operator_logs(namespace, release)[-2000:]
    )
    check_namespaced_rbac(namespace, release)
    check_image_policy(namespace)


def can_i(namespace: str, release: str, *args: str) -> bool:
    sa = f"system:serviceaccount:{namespace}:{release}-rekindle"
    r = kubectl("auth", "can-i", *args, "--as", sa, check=False)
    return r.stdout.strip() == "yes"


def check_namespaced_rbac(namespace: str, release: str) -> None:
    """The chart's default: rights in the watched namespace only, none elsewhere."""
    ns = ("-n", namespace)
    for args in (
        ("create", "deployments.apps"),
        ("patch", "inferenceservices.rekindle.dev", "--subresource=status"),
        ("create", "networkpolicies.networking.k8s.io"),
        ("create", "jobs.batch"),
        ("get", "secrets"),
    ):
        assert can_i(namespace, release, *args, *ns), args
    assert not can_i(namespace, release, "list", "secrets", *ns)  # the token is read by name
    assert not can_i(namespace, release, "delete", "pods", *ns)
    for other in ("default", "kube-system"):
        for args in (
            ("create", "deployments.apps"),
            ("get", "secrets"),
            ("list", "pods"),
            ("patch", "inferenceservices.rekindle.dev"),
        ):
            assert not can_i(namespace, release, *args, "-n", other), (other, args)
    assert not can_i(namespace, release, "list", "pods", "--all-namespaces")
    assert not can_i(namespace, release, "list", "secrets", "--all-namespaces")
    # Nothing cluster-wide, not even reads of namespaces or CRDs (kopf does not scan).
    assert not can_i(namespace, release, "list", "customresourcedefinitions.apiextensions.k8s.io")
    assert not can_i(namespace, release, "list", "namespaces")


def check_image_policy(namespace: str) -> None:
    """An image outside allowedRuntimeImages is refused at apply (ValidatingAdmissionPolicy)."""
    doc: dict[str, Any] = isvc_manifest("evil", "/var/lib/rekindle/unused", replicas=0)
    doc["spec"]["runtime"]["image"] = "registry.example/evil:1"
    refused = None

    def is_refused() -> bool:
        nonlocal refused
        r = apply(doc, namespace)
        if r.returncode == 0:  # the policy is not active yet (it syncs within seconds)
            kubectl("delete", "rkis", "evil", "-n", namespace, "--wait=true", check=False)
            return False
        refused = r.stderr
        return True

    wait_until("the admission policy to refuse the image", is_refused, 60)
    assert refused is not None
    assert "not an allowed runtime image" in refused and "rekindle.local/runtime-cpu:dev" in refused
    # The allowed image (the sample's) is accepted.
    ok = isvc_manifest("fine", "/var/lib/rekindle/unused", replicas=0)
    r = apply(ok, namespace, "--dry-run=server")
    assert r.returncode == 0, r.stderr
