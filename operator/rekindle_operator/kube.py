"""The operator's Kubernetes calls, as dicts, over the official client's transport.

The official `kubernetes` package does the connection: its loaders read the
kubeconfig or the pod's service account (contexts, exec credential plugins,
token refresh, client certificates) and its REST client makes the requests
(TLS, proxy-url and no_proxy, retries). What this module adds is small: the
paths of the dozen kinds the operator touches, server-side apply with its
field manager, and plain dicts in and out. The generated typed models are
not used: the operator builds whole objects as dicts (builders.py) and
applies them as they are, which the typed API would only convert back and
forth, and their classes change between client releases.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from rekindle_operator.constants import CKPT_PLURAL, GROUP, ISVC_PLURAL, VERSION

FIELD_MANAGER = "rekindle-operator"

# kind -> (API prefix, plural); only what the operator touches.
_RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "ReplicaSet": ("/apis/apps/v1", "replicasets"),
    "Service": ("/api/v1", "services"),
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Pod": ("/api/v1", "pods"),
    "Job": ("/apis/batch/v1", "jobs"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "ScaledObject": ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    "InferenceService": (f"/apis/{GROUP}/{VERSION}", ISVC_PLURAL),
    "Checkpoint": (f"/apis/{GROUP}/{VERSION}", CKPT_PLURAL),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = _RESOURCES[kind]
    p = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        p += f"/{name}"
    if sub:
        p += f"/{sub}"
    return p


def service_proxy_path(namespace: str, service: str, port: int, sub: str) -> str:
    """The apiserver's proxy to a Service: reachable wherever the apiserver is (no pod IPs)."""
    return f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy/{sub.lstrip('/')}"


class ConfigError(RuntimeError):
    """No usable connection settings; the message says what to set."""


def load_configuration(kubeconfig: str | None = None) -> Any:
    """kubernetes.client.Configuration from in-cluster env, else kubeconfig (KUBECONFIG):
    the operator's order (it runs in a pod)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig:
            raise config.ConfigException("explicit kubeconfig")
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return cfg


def kubectl_configuration(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """Connection settings as kubectl finds them: --kubeconfig, else KUBECONFIG, else
    ~/.kube/config (its current context, or --context), else the pod's service account.

    The maintained client's loaders do the work (exec credential plugins, tokens,
    client certificates, proxy-url); ConfigError says what to set when none applies.
    """
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
        return cfg
    except config.ConfigException as e:
        missing = "No configuration found" in str(e) or "does not exist" in str(e)
        if not missing or kubeconfig or context:
            raise ConfigError(f"kubeconfig: {e}") from None
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        raise ConfigError(
            "no kubeconfig found (KUBECONFIG, ~/.kube/config) and not in a pod: set "
            "KUBECONFIG or pass --kubeconfig, as for kubectl"
        ) from None
    return cfg


class Kube:
    """JSON over the apiserver's REST API, with the credentials kubectl would use."""

    def __init__(self, configuration: Any | None = None) -> None:
        from kubernetes.client.rest import RESTClientObject

        self.cfg = configuration if configuration is not None else load_configuration()
        self.host = str(self.cfg.host).rstrip("/")
        self.rest = RESTClientObject(self.cfg)

    def _auth(self) -> dict[str, str]:
        key = self.cfg.get_api_key_with_prefix("authorization") or self.cfg.get_api_key_with_prefix(
            "BearerToken"
        )
        return {"Authorization": key} if key else {}

    def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json", **self._auth()}
        if body is not None:
            headers["Content-Type"] = content_type  # the client serializes body as JSON
        url = self.host + url_path
        if query:
            url += "?" + urlencode(dict(query))
        try:
            resp = self.rest.request(
                method, url, headers=headers, body=body, _request_timeout=timeout
            )
        except ApiException as e:  # the client's TLS failures (status 0): not an answer
            raise OSError(" ".join(str(e.reason).split())) from None
        text = resp.read().decode(errors="replace")
        if resp.status >= 400:
            try:
                message = json.loads(text).get("message", text)
            except ValueError:
                message = text
            raise KubeError(resp.status, message)
        return json.loads(text) if text else None

    # Conveniences -------------------------------------------------------------
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = self.request("GET", path(kind, namespace, name))
            return out
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": selector} if selector else None
        out = self.request("GET", path(kind, namespace), query=query)
        items: list[dict[str, Any]] = out.get("items", [])
        return items

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        ns = obj["metadata"]["namespace"]
        out: dict[str, Any] = self.request("POST", path(obj["kind"], ns), obj)
        return out

    def create_if_absent(self, obj: Mapping[str, Any]) -> bool:
        """Create obj unless it exists; True if created (for one-time values like tokens)."""
        meta = obj["metadata"]
        if self.get(obj["kind"], meta["namespace"], meta["name"]) is not None:
            return False  # the common case on every reconcile: no write at all
        try:
            self.create(obj)
            return True
        except KubeError as e:
            if e.status == 409:
                return False
            raise

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete the object; False if it was already gone."""
        try:
            self.request("DELETE", path(kind, namespace, name))
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator: idempotent, and owns exactly the fields it sets."""
        meta = obj["metadata"]
        out: dict[str, Any] = self.request(
            "PATCH",
            path(obj["kind"], meta["namespace"], meta["name"]),
            obj,
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )
        return out

    def merge_patch(
        self, kind: str, namespace: str, name: str, patch: Mapping[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = self.request(
            "PATCH",
            path(kind, namespace, name, sub),
            patch,
            content_type="application/merge-patch+json",
        )
        return out
