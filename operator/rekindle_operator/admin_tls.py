"""spec.adminTLS in the pod and in the Secret: names, and what a pod says about itself.

Pure (no apiserver, no pods): the builders use the names, pods.py and
reconcile.py read the Secret through the apiserver and hand it here.

Whether a pod's agent speaks HTTPS is read from the pod: while a rollout
turns TLS off, the old pods still speak what they were started with. It is
read from the pod's spec (the admin-tls Secret volume, which cannot change
after the pod is created), never from an annotation alone: anyone who may
patch pods could remove an annotation and have the token sent in clear.
Whether TLS is due is the InferenceService's spec: with spec.adminTLS set, a
pod without the volume gets no token at all (pods.Agents.client).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rekindle_operator.constants import NAME_LABEL

# The Secret's keys, as cert-manager (and `kubectl create secret tls`, plus
# ca.crt) writes them: the pods get the first two, the operator reads the third.
CERT_KEY = "tls.crt"
KEY_KEY = "tls.key"
CA_KEY = "ca.crt"
SECRET_KEYS = (CERT_KEY, KEY_KEY, CA_KEY)

VOLUME = "admin-tls"
DIR = "/var/run/rekindle-admin-tls"
CERT_FILE = f"{DIR}/{CERT_KEY}"
KEY_FILE = f"{DIR}/{KEY_KEY}"
# On the pod: the name its agent's certificate is checked against. Present only
# on pods whose agent serves the admin port over TLS.
ANN_SERVER_NAME = "rekindle.dev/admin-tls-server-name"

Body = Mapping[str, Any]


@dataclass(frozen=True)
class PodTLS:
    """How to reach one pod's agent over TLS: the Secret with the CA, the name to check."""

    secret_name: str
    server_name: str


def pod_tls(pod: Body) -> PodTLS | None:
    """The pod's admin TLS, from its Secret volume (and the name in its annotation);
    None: plain HTTP, only for a pod with neither.

    A pod with the volume speaks TLS whatever its annotations say: without the
    annotation (removed) the name checked is the Service's DNS name, the
    default, so a removed annotation fails verification rather than downgrade.
    """
    meta = pod.get("metadata") or {}
    server_name = (meta.get("annotations") or {}).get(ANN_SERVER_NAME)
    for vol in (pod.get("spec") or {}).get("volumes") or []:
        if vol.get("name") == VOLUME and (vol.get("secret") or {}).get("secretName"):
            isvc = (meta.get("labels") or {}).get(NAME_LABEL, "")
            name = server_name or f"{isvc}.{meta.get('namespace', '')}.svc"
            return PodTLS(str(vol["secret"]["secretName"]), str(name))
    if server_name:
        raise ValueError(
            f"pod {meta.get('name')} has {ANN_SERVER_NAME} but no {VOLUME} Secret volume"
        )
    return None


def secret_problem(secret: Body | None, namespace: str, name: str) -> str | None:
    """Why the Secret cannot serve as spec.adminTLS.secretName, or None when it can."""
    if secret is None:
        return (
            f"spec.adminTLS.secretName: Secret {name} does not exist in namespace {namespace}; "
            f"create it with {', '.join(SECRET_KEYS)} (a cert-manager Certificate with "
            f"secretName: {name} writes them)"
        )
    data = secret.get("data") or {}
    missing = [k for k in SECRET_KEYS if not data.get(k)]
    if missing:
        return (
            f"spec.adminTLS.secretName: Secret {name} in namespace {namespace} has no "
            f"{', '.join(missing)}: it needs {', '.join(SECRET_KEYS)} (an ACME issuer "
            "writes no ca.crt: use a CA or self-signed issuer)"
        )
    return None


def ca_bundle(secret: Body | None, namespace: str, name: str) -> bytes:
    """The Secret's ca.crt (PEM); raises ValueError saying what is wrong with the Secret."""
    problem = secret_problem(secret, namespace, name)
    if problem is not None or secret is None:
        raise ValueError(problem)
    try:
        return base64.b64decode(secret["data"][CA_KEY], validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"Secret {name}: {CA_KEY} is not valid base64: {e}") from e
