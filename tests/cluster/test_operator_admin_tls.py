"""The agent's admin API over TLS, on the real local cluster.

A CA and a server certificate for the default name (NAME.NAMESPACE.svc) are
made with openssl and stored as a kubernetes.io/tls Secret with ca.crt, as
cert-manager writes it. The pod's probes go over HTTPS (or it never becomes
Ready), the operator reads the agent's status over HTTPS, verifying the
certificate against the Secret's CA (or status.pods[] stays "unknown"), and a
checkpoint is taken over the same channel. A service naming a Secret that does
not exist gets no Deployment and says why.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.immutable import remove_tree

from tests.cluster.cluster_tools import kubectl, kubectl_json
from tests.cluster.operator_fixtures import (
    OperatorProcess,
    apply,
    get,
    isvc_manifest,
    kubectl_rekindle,
    op_namespace,
    operator,
    pods_of,
    require_runtime_image,
    run_plugin,
    wait_status,
)
from tests.unit.tls_certs import make_ca, make_server_cert, needs_openssl

__all__ = ["kubectl_rekindle", "op_namespace", "operator"]  # fixtures used by name

pytestmark = [pytest.mark.cluster, needs_openssl]
NAME = "tls"


@pytest.fixture(scope="module")
def tls_secret(op_namespace: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    cert = make_server_cert(ca, d, f"{NAME}.{op_namespace}.svc")
    kubectl(
        "create", "secret", "generic", "admin-tls", "-n", op_namespace,
        "--type=kubernetes.io/tls", f"--from-file=tls.crt={cert.cert}",
        f"--from-file=tls.key={cert.key}", f"--from-file=ca.crt={ca.cert}",
    )  # fmt: skip
    return "admin-tls"


def test_admin_api_over_tls(
    operator: OperatorProcess,
    op_namespace: str,
    tls_secret: str,
    kubectl_rekindle: dict[str, str],
) -> None:
    require_runtime_image()
    host = Path(f"/var/lib/rekindle/test-tls-{op_namespace}")
    try:
        _serve_and_checkpoint(op_namespace, tls_secret, kubectl_rekindle, host)
    finally:
        kubectl("delete", "rkis", NAME, "-n", op_namespace, "--timeout=120s", check=False)
        with contextlib.suppress(OSError):
            remove_tree(host)  # immutable pages images: rm -rf cannot


def _serve_and_checkpoint(
    op_namespace: str, tls_secret: str, kubectl_rekindle: dict[str, str], host: Path
) -> None:
    r = apply(isvc_manifest(NAME, str(host), adminTLS={"secretName": tls_secret}), op_namespace)
    assert r.returncode == 0, r.stderr

    def served(o: dict[str, Any]) -> bool:
        pods = (o.get("status") or {}).get("pods") or []
        return len(pods) == 1 and pods[0].get("ready") is True and pods[0]["origin"] == "booted"

    wait_status("rkis", NAME, op_namespace, "Ready and its agent read over TLS", served, 600)
    (pod,) = pods_of(NAME, op_namespace)
    c = pod["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert "--admin-tls-cert" in c["command"]
    # A checkpoint goes over the same verified channel.
    r = run_plugin(
        kubectl_rekindle, "-n", op_namespace, "checkpoint", NAME,
        "--checkpoint-name", "over-tls", "--wait", "--timeout", "900",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    ck = get("rkcp", "over-tls", op_namespace)
    assert ck is not None and ck["status"]["phase"] == "Ready", ck


def test_missing_tls_secret_is_reported(operator: OperatorProcess, op_namespace: str) -> None:
    r = apply(
        isvc_manifest("no-secret", "/var/lib/rekindle/unused", adminTLS={"secretName": "nope"}),
        op_namespace,
    )
    assert r.returncode == 0, r.stderr
    obj = wait_status(
        "rkis", "no-secret", op_namespace, "the missing Secret named in status",
        lambda o: "nope" in str((o.get("status") or {}).get("message", "")), 120,
    )  # fmt: skip
    assert "does not exist" in obj["status"]["message"]
    deployments = kubectl_json("get", "deployments", "-n", op_namespace)["items"]
    assert not [d for d in deployments if d["metadata"]["name"] == "no-secret"]
