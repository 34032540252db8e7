"""The Helm chart installs a working operator: in-cluster, with only the chart's RBAC.

The operator image (rekindle.local/operator:dev, `make images`) runs as the
chart's ServiceAccount, watching one fresh namespace; the checks exercise what
its Role must allow (status writes, events, owned objects) without a vLLM boot.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.cluster_tools import REPO, helm, kubectl, kubectl_json, wait_until
from tests.cluster.operator_fixtures import (
    OPERATOR_IMAGE,
    apply,
    install_crds,
    isvc_manifest,
    kubectl_rekindle,
    require_image,
    run_plugin,
    wait_status,
)

pytestmark = pytest.mark.cluster
__all__ = ["kubectl_rekindle"]  # a fixture, used by name


def local_operator_values(namespace: str) -> list[str]:
    """`--set`s for the locally loaded operator image (never pulled), watching namespace."""
    repo, tag = OPERATOR_IMAGE.rsplit(":", 1)
    return [
        "--set",
        f"image.repository={repo}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        f"watchNamespaces={{{namespace}}}",
    ]


@pytest.fixture()
def release(namespace: str) -> Iterator[str]:
    require_image(OPERATOR_IMAGE, "operator")
    # The CRDs are cluster-wide and shared by tests running beside this one:
    # applied once with kubectl, and left out of this release (crds.install=false);
    # test_helm_upgrade_applies_crd_changes covers the chart managing them.
    install_crds()
    name = f"rk{uuid.uuid4().hex[:6]}"
    r = helm(
        "install",
        name,
        str(REPO / "charts" / "rekindle"),
        "-n",
        namespace,
        "--set",
        "crds.install=false",
        *local_operator_values(namespace),
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


def test_chart_operator_reconciles_with_its_own_rbac(
    namespace: str, release: str, kubectl_rekindle: dict[str, str], tmp_path: Path
) -> None:
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
    check_gpu_check_dry_run(namespace, kubectl_rekindle, tmp_path / "gpu-check.json")


def check_gpu_check_dry_run(namespace: str, env: dict[str, str], out: Path) -> None:
    """`kubectl rekindle gpu-check --dry-run` on this GPU-less cluster: it finds the
    chart's install, says no node offers a GPU, and lists what a real run would do."""
    r = run_plugin(
        env, "-n", namespace, "gpu-check", "--dry-run", "--storage", "hostPath", "--out", str(out)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().splitlines()[-2] == "DRY-RUN", r.stdout
    assert "7. negative [needs 1 GPU] (not on this cluster: too few GPUs free)" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "DRY-RUN"
    got = {f"{c['step']}/{c['name']}": c["verdict"] for c in doc["checks"]}
    assert got == {
        "validate/InferenceService": "PASS",
        "validate/Checkpoint": "PASS",
        "preflight/CRD inferenceservices": "PASS",
        "preflight/CRD checkpoints": "PASS",
        "preflight/operator": "PASS",
        "preflight/node agent": "SKIP",
        "preflight/GPU node": "SKIP",
    }, doc["checks"]
    gpu = next(c for c in doc["checks"] if c["name"] == "GPU node")
    assert gpu["note"].startswith("no node offers a free nvidia.com/gpu"), gpu


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
        ("list", "replicasets.apps"),  # which pods the service's Deployment made
    ):
        assert can_i(namespace, release, *args, *ns), args
    assert not can_i(namespace, release, "patch", "replicasets.apps", *ns)  # read only
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


CHART = REPO / "charts" / "rekindle"
CKPT_CRD = "checkpoints.rekindle.dev"


def changed_chart(dest: Path, probe: str) -> Path:
    """A copy of the chart whose Checkpoint CRD has one more printer column and one more
    optional spec field, both named probe: additions only, so tests running beside this
    one (which share the CRD) see nothing they rely on change."""
    chart = dest / "rekindle"
    shutil.copytree(CHART, chart)
    path = chart / "files" / "crds" / f"{CKPT_CRD}.yaml"
    crd = yaml.safe_load(path.read_text())
    for version in crd["spec"]["versions"]:
        version.setdefault("additionalPrinterColumns", []).append(
            {"name": probe, "type": "string", "jsonPath": ".spec." + probe, "priority": 1}
        )
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        spec["properties"][probe] = {"type": "string", "description": "test probe"}
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    return chart


def crd_has_probe(probe: str) -> bool:
    crd = kubectl_json("get", "crd", CKPT_CRD)
    return any(
        any(c["name"] == probe for c in v.get("additionalPrinterColumns", []))
        and probe in v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        for v in crd["spec"]["versions"]
    )


def helm_release(verb: str, name: str, chart: Path, namespace: str, *extra: str) -> None:
    """install/upgrade a release that owns the CRDs; its operator is not needed here
    (the local image, never pulled: nothing is fetched if it is not loaded)."""
    r = helm(
        verb,
        name,
        str(chart),
        "-n",
        namespace,
        *local_operator_values(namespace),
        "--set",
        "admissionPolicy.enabled=false",
        "--set",
        "releaseFinalizersOnUninstall=false",
        *extra,
        check=False,
    )
    assert r.returncode == 0, f"helm {verb}: {r.stdout}{r.stderr}"


def test_helm_upgrade_applies_crd_changes(namespace: str, tmp_path: Path) -> None:
    """The CRDs are templates: `helm upgrade` with a chart whose CRD changed changes it on
    the apiserver (Helm would never touch a crds/ directory after the first install), and
    upgrading back restores it. The CRDs were applied by kubectl first (as other tests
    do): --take-ownership lets the release adopt them."""
    install_crds()
    name = f"crd{uuid.uuid4().hex[:6]}"
    probe = f"upgradeProbe{uuid.uuid4().hex[:6]}"
    try:
        helm_release("install", name, CHART, namespace, "--take-ownership")
        meta = kubectl_json("get", "crd", CKPT_CRD)["metadata"]
        assert meta["annotations"]["meta.helm.sh/release-name"] == name
        assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
        assert not crd_has_probe(probe)
        helm_release("upgrade", name, changed_chart(tmp_path, probe), namespace)
        assert crd_has_probe(probe), "helm upgrade did not apply the CRD change"
        # The new field is in the schema: a Checkpoint with it passes strict validation.
        ck = {
            "apiVersion": "rekindle.dev/v1alpha1",
            "kind": "Checkpoint",
            "metadata": {"name": "probe"},
            "spec": {"inferenceService": "nope", probe: "x"},
        }
        r = apply(ck, namespace, "--dry-run=server", "--validate=strict")
        assert r.returncode == 0, r.stderr
        helm_release("upgrade", name, CHART, namespace)
        assert not crd_has_probe(probe), "upgrading back did not restore the CRD"
        r = helm("uninstall", name, "-n", namespace, "--wait", check=False)
        assert r.returncode == 0, r.stderr
        # helm.sh/resource-policy: keep: uninstall leaves the CRDs (and every object).
        assert kubectl("get", "crd", CKPT_CRD, check=False).returncode == 0
    finally:
        helm("uninstall", name, "-n", namespace, check=False)
        # Leave the CRDs as the repository has them, owned by no release.
        for crd in (CKPT_CRD, "inferenceservices.rekindle.dev"):
            kubectl(
                "annotate",
                "crd",
                crd,
                "meta.helm.sh/release-name-",
                "meta.helm.sh/release-namespace-",
                check=False,
            )
            kubectl("label", "crd", crd, "app.kubernetes.io/managed-by-", check=False)
        install_crds()
