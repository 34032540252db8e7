"""The front's two reads from the Kubernetes API, over its own aiohttp session
with the pod's service account: which replicas of a service are Ready
(EndpointSlices of the service's Service) and whether the service exists.
Read-only; the chart's ClusterRole grants exactly get/list on those two.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ISVC_PATH = "/apis/rekindle.dev/v1alpha1/namespaces/{ns}/inferenceservices/{name}"
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


class KubeError(Exception):
    """The API answered something other than what was asked for."""


@dataclass(frozen=True)
class Replica:
    """A Ready endpoint of a service: where its agent's serve port listens."""

    address: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"


def ready_replicas(slices: list[dict[str, Any]], port_name: str) -> list[Replica]:
    """The Ready, not terminating, endpoints of a service's EndpointSlices (pure)."""
    out: list[Replica] = []
    for sl in slices:
        ports = [p for p in sl.get("ports") or [] if isinstance(p, dict)]
        port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
        if not isinstance(port, int):
            continue
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            out.extend(Replica(a, port) for a in ep.get("addresses") or [])
    return sorted(set(out), key=lambda r: (r.address, r.port))


class KubeReader:
    """GETs against the API server this pod runs under (in-cluster config)."""

    def __init__(self, server: str, token_file: Path, ca_file: Path | None) -> None:
        self.server = server.rstrip("/")
        self.token_file = token_file
        self.tls = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        self.session: ClientSession | None = None

    @classmethod
    def in_cluster(cls) -> KubeReader:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeError("KUBERNETES_SERVICE_HOST is unset: the front runs in a pod")
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", SA_DIR / "token", SA_DIR / "ca.crt")

    async def _get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any] | None:
        if self.session is None:
            self.session = ClientSession(
                connector=TCPConnector(ssl=self.tls) if self.tls else TCPConnector(),
                timeout=ClientTimeout(total=10),
            )
        # Read per call: the kubelet rotates the projected token.
        token = self.token_file.read_text().strip()
        async with self.session.get(
            self.server + path, params=params, headers={"Authorization": f"Bearer {token}"}
        ) as r:
            if r.status == 404:
                return None
            if r.status != 200:
                raise KubeError(f"GET {path}: HTTP {r.status}: {(await r.text())[:200]}")
            doc = await r.json()
            if not isinstance(doc, dict):
                raise KubeError(f"GET {path}: not an object")
            return doc

    async def service_exists(self, namespace: str, name: str) -> bool:
        return await self._get(ISVC_PATH.format(ns=namespace, name=name)) is not None

    async def replicas(self, namespace: str, service: str, port_name: str) -> list[Replica]:
        doc = await self._get(
            SLICES_PATH.format(ns=namespace),
            {"labelSelector": f"{SERVICE_NAME_LABEL}={service}"},
        )
        items = (doc or {}).get("items") or []
        return ready_replicas([i for i in items if isinstance(i, dict)], port_name)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
