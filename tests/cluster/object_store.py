"""A real S3-compatible object store in the local cluster: SeaweedFS (`weed mini`) as
one Deployment with a ClusterIP Service, its image from `scripts/build-image
object-store`. Its S3 identity comes from a Secret the fixture writes; the node
agent gets the same keys from a Secret of its own namespace, as a platform team
would hand them over.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

from rekindle_dev import local_s3
from rekindle_store.s3 import Bucket, Credentials, S3Error

from tests.cluster.cluster_tools import NODE1, create_namespace, kubectl, kubectl_json, wait_until
from tests.cluster.operator_fixtures import require_image

IMAGE, BUCKET, PORT = local_s3.IMAGE, local_s3.BUCKET, local_s3.PORT


@dataclass(frozen=True)
class ObjectStore:
    namespace: str
    endpoint: str  # http://CLUSTER-IP:8333, reachable from this machine and every pod
    creds: Credentials

    def bucket(self) -> Bucket:
        return Bucket(self.endpoint, BUCKET, self.creds, timeout=10)

    def secret_manifest(self, name: str, namespace: str) -> dict[str, object]:
        """The credentials as the node agent's chart expects them."""
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "stringData": {
                "accessKeyID": self.creds.access_key,
                "secretAccessKey": self.creds.secret_key,
            },
        }

    def scale(self, replicas: int) -> None:
        """Take the store away (0) or bring it back (1), waiting until it is so."""
        kubectl("scale", "-n", self.namespace, "deployment/s3", f"--replicas={replicas}")
        if replicas:
            kubectl("rollout", "status", "-n", self.namespace, "deployment/s3", "--timeout=110s")
            wait_until("S3 to answer", self._answers, 120)
        else:
            wait_until("the store's pod gone", lambda: not self._pods(), 120)

    def _pods(self) -> list[object]:
        return list(kubectl_json("get", "pods", "-n", self.namespace, "-l", "app=s3")["items"])

    def _answers(self) -> bool:
        try:
            self.bucket().head("probe")
            return True
        except S3Error:
            return False


def _data_dir(ns: str) -> str:
    return f"/var/lib/rekindle-cluster/{ns}"


def deploy() -> Iterator[ObjectStore]:
    """Run the store until the generator is closed, then remove it and its data."""
    require_image(IMAGE, "object-store")
    ns = create_namespace("s3")
    creds = Credentials(f"rk-{secrets.token_hex(4)}", secrets.token_hex(20))
    data = _data_dir(ns)
    os.makedirs(data, exist_ok=True)
    os.chown(data, 65534, 65534)
    try:
        for m in local_s3.manifests(ns, creds, _data_dir(ns), NODE1):
            kubectl("apply", "-f", "-", input=json.dumps(m))
        svc = kubectl_json("get", "service", "-n", ns, "s3")
        store = ObjectStore(ns, f"http://{svc['spec']['clusterIP']}:{PORT}", creds)
        kubectl("rollout", "status", "-n", ns, "deployment/s3", "--timeout=110s")
        wait_until("S3 to answer", store._answers, 120)
        yield store
    finally:
        print(kubectl("logs", "-n", ns, "deployment/s3", "--tail=20", check=False).stdout)
        kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)
        shutil.rmtree(data, ignore_errors=True)
