"""spec.adminTLS in the operator: which pods get HTTPS, the CA from their Secret, the
Secret missing (status and Event, no crash), and a real verification through pods.py."""

from __future__ import annotations

import base64
import threading
from pathlib import Path
from typing import Any

import pytest
from rekindle_contract.api import ADMIN_PORT
from rekindle_operator import admin_tls
from rekindle_operator.pods import Agent, Agents, AgentTLS, _client
from rekindle_operator.reconcile import reconcile

from tests.unit.test_contract_tls import NAME, TOKEN, https_server
from tests.unit.test_operator_checkpointing import (
    NS,
    FakeAgent,
    FakeKube,
    pod_obj,
    reply,
    world,
)
from tests.unit.tls_certs import Ca, ServerCert, make_ca, make_server_cert, needs_openssl

SECRET = "tiny-admin-tls"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def tls_secret(ca: bytes = b"CA PEM", keys: tuple[str, ...] = admin_tls.SECRET_KEYS) -> dict:  # type: ignore[type-arg]
    values = {admin_tls.CERT_KEY: b"CERT", admin_tls.KEY_KEY: b"KEY", admin_tls.CA_KEY: ca}
    return {
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": SECRET, "namespace": NS},
        "data": {k: b64(values[k]) for k in keys},
    }


def tls_pod(name: str, ip: str = "10.244.0.9", server_name: str = NAME) -> dict[str, Any]:
    """A pod the operator started with spec.adminTLS: its annotation and Secret volume."""
    pod = pod_obj(name, ip=ip)
    pod["metadata"]["annotations"][admin_tls.ANN_SERVER_NAME] = server_name
    pod["spec"] = {"volumes": [{"name": admin_tls.VOLUME, "secret": {"secretName": SECRET}}]}
    return pod


class Recorder(FakeAgent):
    """Records what each client was made with: (url, tls)."""

    def __init__(self) -> None:
        super().__init__(statuses=[reply("Ready", origin="booted")])
        self.made: list[tuple[str, AgentTLS | None]] = []

    def __call__(self, url: str, token: str, tls: AgentTLS | None = None) -> FakeAgent:  # type: ignore[override]
        self.made.append((url, tls))
        return super().__call__(url, token)


def test_tls_pods_get_https_with_their_secrets_ca_plain_pods_http() -> None:
    kube, _ = world()
    kube.put(tls_secret(ca=b"THE CA"))
    rec = Recorder()
    agents = Agents(rec, secrets=kube)
    reply_, error = agents.ask_status(tls_pod("tiny-tls"), "tok")
    assert error is None and reply_ is not None and reply_.state == "Ready"
    reply_, error = agents.ask_status(pod_obj("tiny-plain", ip="10.244.0.8"), "tok")
    assert error is None
    assert rec.made == [
        (f"https://10.244.0.9:{ADMIN_PORT}", AgentTLS(b"THE CA", NAME)),
        (f"http://10.244.0.8:{ADMIN_PORT}", None),
    ]


@pytest.mark.parametrize(
    ("secret", "says"),
    [
        (None, f"Secret {SECRET} does not exist in namespace {NS}"),
        (tls_secret(keys=(admin_tls.CERT_KEY, admin_tls.KEY_KEY)), "has no ca.crt"),
    ],
)
def test_a_missing_secret_or_ca_is_a_status_reason_not_a_crash(
    secret: dict | None,  # type: ignore[type-arg]
    says: str,
) -> None:
    kube, _ = world()
    if secret is not None:
        kube.put(secret)
    rec = Recorder()
    agents = Agents(rec, secrets=kube)
    reply_, error = agents.ask_status(tls_pod("tiny-tls"), "tok")
    assert reply_ is None and error is not None and says in error
    assert rec.made == []  # no client, so no token sent anywhere
    # A checkpoint call fails with the same reason, in its thread, and then() still runs.
    done = threading.Event()
    call = agents.start_checkpoint("k", tls_pod("tiny-tls"), "tok", "/c/x", 5, done.set)
    assert call.finished.wait(60) and done.is_set()
    assert call.error is not None and says in call.error and call.manifest is None


def test_with_admin_tls_in_the_spec_a_plain_pod_never_gets_the_token() -> None:
    """A pod from before spec.adminTLS (no Secret volume) is not sent the token in clear:
    the spec says TLS is due; it is reported unreachable until the rollout replaces it."""
    rec = Recorder()
    agents = Agents(rec, secrets=FakeKube())
    reply_, error = agents.ask_status(pod_obj("tiny-old", ip="10.244.0.8"), "tok", True)
    assert reply_ is None and error is not None and "not sent to it in clear" in error
    done = threading.Event()
    call = agents.start_checkpoint(
        "k", pod_obj("tiny-old"), "tok", "/c/x", 5, done.set, tls_required=True
    )
    assert call.finished.wait(60) and done.is_set()
    assert call.error is not None and "not sent to it in clear" in call.error
    assert rec.made == []  # no client was made: the token went nowhere


def test_a_pod_claiming_tls_without_its_volume_is_an_error() -> None:
    pod = tls_pod("tiny-tls")
    pod["spec"]["volumes"] = []
    with pytest.raises(ValueError, match="no admin-tls Secret volume"):
        admin_tls.pod_tls(pod)


@needs_openssl
def test_pods_verify_the_agent_for_real(tmp_path: Path) -> None:
    """pods.py with the real client against a real TLS server at the "pod IP" 127.0.0.1:
    the Secret's ca.crt passes; another CA in the Secret fails the status, with why."""
    ca: Ca = make_ca(tmp_path, "ca")
    other: Ca = make_ca(tmp_path, "other")
    cert: ServerCert = make_server_cert(ca, tmp_path, NAME)
    kube = FakeKube()
    with https_server(cert) as url:
        port = url.rsplit(":", 1)[1]

        def to_test_server(u: str, token: str, tls: AgentTLS | None = None) -> Agent:
            return _client(u.replace(f":{ADMIN_PORT}", f":{port}"), token, tls)

        agents = Agents(to_test_server, secrets=kube)
        kube.put(tls_secret(ca=ca.cert.read_bytes()))
        reply_, error = agents.ask_status(tls_pod("p", ip="127.0.0.1"), TOKEN)
        assert error is None and reply_ is not None and reply_.state == "Ready"
        reply_, error = agents.ask_status(
            tls_pod("p", ip="127.0.0.1", server_name="x.ns.svc"), TOKEN
        )
        assert reply_ is None and error is not None and "x.ns.svc" in error
        kube.put(tls_secret(ca=other.cert.read_bytes()))
        reply_, error = agents.ask_status(tls_pod("p", ip="127.0.0.1"), TOKEN)
        assert reply_ is None and error is not None and "certificate verify failed" in error


def test_reconcile_waits_for_the_secret_with_a_message_and_one_event() -> None:
    kube, _ = world()
    kube.merge_patch("InferenceService", NS, "tiny", {"spec": {"adminTLS": {"secretName": SECRET}}})
    events: list[tuple[str, str, str]] = []
    isvc = kube.get("InferenceService", NS, "tiny")
    assert isvc is not None
    st = reconcile(kube, isvc, lambda *e: events.append(e), Agents(FakeAgent(), secrets=kube))
    assert ("apply", "Deployment", "tiny") not in kube.calls  # its pods could not mount the Secret
    assert kube.get("Service", NS, "tiny") is not None  # everything else is there
    assert f"Secret {SECRET} does not exist" in st["message"]
    assert "Deployment is not updated" in st["message"]
    warned = [e for e in events if e[1] == "AdminTLSSecretInvalid"]
    assert len(warned) == 1 and warned[0][0] == "Warning"
    isvc["status"] = st
    reconcile(kube, isvc, lambda *e: events.append(e), Agents(FakeAgent(), secrets=kube))
    assert len([e for e in events if e[1] == "AdminTLSSecretInvalid"]) == 1  # said once
    # cert-manager has issued it: the Deployment follows, the message clears.
    kube.put(tls_secret())
    st = reconcile(kube, isvc, lambda *e: None, Agents(FakeAgent(), secrets=kube))
    dep = kube.get("Deployment", NS, "tiny")
    assert dep is not None and st["message"] == ""
    template = dep["spec"]["template"]
    assert admin_tls.pod_tls(template) == admin_tls.PodTLS(SECRET, "tiny.ns.svc")


def test_a_removed_annotation_does_not_downgrade_to_plain_http() -> None:
    """The Secret volume (fixed when the pod was made) decides TLS; the name checked
    falls back to the Service's DNS name, so verification fails closed."""
    pod = tls_pod("tiny-tls", server_name="custom.example")
    del pod["metadata"]["annotations"][admin_tls.ANN_SERVER_NAME]
    assert admin_tls.pod_tls(pod) == admin_tls.PodTLS(SECRET, f"tiny.{NS}.svc")
    kube, _ = world()
    kube.put(tls_secret(ca=b"THE CA"))
    rec = Recorder()
    Agents(rec, secrets=kube).ask_status(pod, "tok")
    ((url, tls),) = rec.made
    assert url.startswith("https://") and tls == AgentTLS(b"THE CA", f"tiny.{NS}.svc")
