"""SeaweedFS (`weed mini`) as a Deployment of the local cluster: the S3-compatible
object store of the cluster tests and `rekindle-dev bench scale-out`. Its image comes
from `scripts/build-image object-store`; its telemetry (on by default) is off, so it
talks to nothing outside the cluster.
"""

from __future__ import annotations

import json
from typing import Any

from rekindle_store.s3 import Credentials

from rekindle_dev.seaweedfs import SIZING_ARGS

IMAGE = "rekindle.local/object-store:dev"
BUCKET = "checkpoints"
PORT = 8333


def manifests(ns: str, creds: Credentials, data_dir: str, node: str) -> list[dict[str, Any]]:
    """A Secret (its S3 identity), a Deployment (on node, its objects in the host
    directory data_dir, owned by 65534) and a Service (port PORT) in namespace ns."""
    config = {
        "identities": [
            {
                "name": "rekindle-node",
                "credentials": [{"accessKey": creds.access_key, "secretKey": creds.secret_key}],
                "actions": ["Read", "Write", "List", "Tagging", "Admin"],
            }
        ]
    }
    labels = {"app": "s3"}
    args = [
        "mini",
        "-dir=/data",
        "-ip=127.0.0.1",
        "-ip.bind=0.0.0.0",
        "-master.telemetry=false",  # on by default: it would call out of the cluster
        "-webdav=false",
        "-admin.ui=false",
        "-admin.port.legacy=0",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.port={PORT}",
        "-s3.config=/etc/s3/config.json",
        f"-bucket={BUCKET}",
        *SIZING_ARGS,
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3-config", "namespace": ns},
            "stringData": {"config.json": json.dumps(config)},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "s3", "namespace": ns, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "automountServiceAccountToken": False,
                        "enableServiceLinks": False,
                        # On the first node, even while a test cordons it (to send a
                        # replica to the second): the store stays where its data is.
                        "nodeSelector": {"kubernetes.io/hostname": node},
                        "tolerations": [
                            {
                                "key": "node.kubernetes.io/unschedulable",
                                "operator": "Exists",
                                "effect": "NoSchedule",
                            }
                        ],
                        "securityContext": {"runAsUser": 65534, "runAsGroup": 65534},
                        "containers": [
                            {
                                "name": "weed",
                                "image": IMAGE,
                                "imagePullPolicy": "Never",
                                "args": args,
                                "ports": [{"containerPort": PORT}],
                                "readinessProbe": {
                                    "tcpSocket": {"port": PORT},
                                    "periodSeconds": 1,
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [
                                    {"name": "data", "mountPath": "/data"},
                                    {"name": "config", "mountPath": "/etc/s3"},
                                ],
                            }
                        ],
                        # The objects outlive the pod: scaled to zero and back, it holds them.
                        "volumes": [
                            {"name": "data", "hostPath": {"path": data_dir}},
                            {"name": "config", "secret": {"secretName": "s3-config"}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "s3", "namespace": ns},
            "spec": {"selector": labels, "ports": [{"port": PORT, "targetPort": PORT}]},
        },
    ]
