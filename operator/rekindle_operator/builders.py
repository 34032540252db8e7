"""One plain function per Kubernetes object the operator owns (dicts in, dicts out).

Handlers call these and apply the result; tests call them directly and, in the
cluster suite, send them to the apiserver with a server-side dry run.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

from rekindle_contract.api import ADMIN_PORT, PATH_HEALTHZ, PATH_READYZ, SERVE_PORT
from rekindle_contract.pod import (
    CHECKPOINT_ENV,
    CHECKPOINT_MOUNT,
    LOOPBACK_ENV,
    TOKEN_DIR,
    TOKEN_KEY,
)

from rekindle_operator.agent_command import agent_command
from rekindle_operator.constants import (
    ANN_FINGERPRINT,
    ANN_RESTART,
    API_VERSION,
    COMPONENT_LABEL,
    ISVC_KIND,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    SERVING_LABEL,
)
from rekindle_operator.quantity import mib_str
from rekindle_operator.shm_sizing import memory_limit_bytes
from rekindle_operator.spec import IsvcSpec

Obj = dict[str, Any]

CONTAINER = "vllm"


def deployment_name(isvc: str) -> str:
    return isvc


def service_name(isvc: str) -> str:
    return isvc


def secret_name(isvc: str) -> str:
    return f"{isvc}-agent-token"


def configmap_name(isvc: str) -> str:
    return f"{isvc}-rekindle"


def pvc_name(spec: IsvcSpec) -> str:
    return spec.storage.existing_claim or f"{spec.name}-checkpoints"


def owner_reference(owner: Mapping[str, Any]) -> Obj:
    """ownerReference to an InferenceService body: deleting it garbage-collects the object."""
    meta = owner["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": owner.get("kind", ISVC_KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def selector_labels(name: str) -> dict[str, str]:
    """What the Deployment selects on (and the scale subresource reports)."""
    return {NAME_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def _meta(spec: IsvcSpec, name: str, owner: Mapping[str, Any] | None, component: str) -> Obj:
    meta: Obj = {
        "name": name,
        "namespace": spec.namespace,
        "labels": {
            **selector_labels(spec.name),
            COMPONENT_LABEL: component,
            MANAGED_BY_LABEL: MANAGED_BY,
        },
    }
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def build_secret(spec: IsvcSpec, owner: Mapping[str, Any] | None = None, token: str = "") -> Obj:
    """The agent's bearer token; generated once (the handler never replaces an existing one)."""
    token = token or secrets.token_urlsafe(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(spec, secret_name(spec.name), owner, "agent-token"),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_configmap(
    spec: IsvcSpec, checkpoint_path: str, owner: Mapping[str, Any] | None = None
) -> Obj:
    """Names the checkpoint new pods restore from ("" boots normally)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(spec, configmap_name(spec.name), owner, "restore-pointer"),
        "data": {"checkpoint": checkpoint_path if spec.restore_policy != "Never" else ""},
    }


def build_pvc(spec: IsvcSpec, owner: Mapping[str, Any] | None = None) -> Obj | None:
    """The checkpoint volume, or None when checkpoints go to a node path or an existing claim.

    Owned by the InferenceService (garbage-collected with it) only when
    coldStart.storage.deletionPolicy is Delete; Retain keeps the data.
    """
    if spec.storage.type != "pvc" or spec.storage.existing_claim:
        return None
    pvc: Obj = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(
            spec,
            pvc_name(spec),
            owner if spec.storage.deletion_policy == "Delete" else None,
            "checkpoints",
        ),
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": spec.storage.size}},
        },
    }
    if spec.storage.storage_class:
        pvc["spec"]["storageClassName"] = spec.storage.storage_class
    return pvc


def build_service(spec: IsvcSpec, owner: Mapping[str, Any] | None = None) -> Obj:
    """The OpenAI endpoint; selects only pods that carry the serving label."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, service_name(spec.name), owner, "endpoint"),
        "spec": {
            "type": "ClusterIP",
            "selector": {**selector_labels(spec.name), SERVING_LABEL: "true"},
            "ports": [
                {"name": "http", "port": SERVE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def checkpoint_volume(spec: IsvcSpec) -> Obj:
    if spec.storage.type == "hostPath":
        return {
            "name": "checkpoints",
            "hostPath": {"path": spec.storage.host_path, "type": "DirectoryOrCreate"},
        }
    return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": pvc_name(spec)}}


def _resources(spec: IsvcSpec, shm_bytes: int) -> Obj:
    requests: Obj = {"memory": spec.memory}
    limits: Obj = {"memory": mib_str(memory_limit_bytes(spec, shm_bytes))}
    if spec.cpu:
        requests["cpu"] = spec.cpu
    if spec.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.gpus
    return {"requests": requests, "limits": limits}


def build_pod_template(spec: IsvcSpec, shm_bytes: int, fingerprint: str) -> Obj:
    user = dict(spec.env)
    env: list[Obj] = [{"name": k, "value": v} for k, v in LOOPBACK_ENV.items() if k not in user]
    env += [{"name": k, "value": v} for k, v in spec.env]
    env.append(
        {
            "name": CHECKPOINT_ENV,
            "valueFrom": {
                "configMapKeyRef": {
                    "name": configmap_name(spec.name),
                    "key": "checkpoint",
                    "optional": True,
                }
            },
        }
    )
    container: Obj = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": agent_command(spec),
        "env": env,
        "ports": [
            {"name": "http", "containerPort": SERVE_PORT, "protocol": "TCP"},
            {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {
            "httpGet": {"path": PATH_READYZ, "port": "admin"},
            "periodSeconds": 2,
            "failureThreshold": 1,
        },
        "livenessProbe": {
            "httpGet": {"path": PATH_HEALTHZ, "port": "admin"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": _resources(spec, shm_bytes),
        # CRIU dumps and restores a process tree: it needs ptrace, namespaces,
        # TCP repair and /proc/sys writes that only a privileged container has,
        # and no seccomp/AppArmor confinement (the agent confines vLLM itself).
        "securityContext": {
            "privileged": True,
            "seccompProfile": {"type": "Unconfined"},
            "appArmorProfile": {"type": "Unconfined"},
        },
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "agent-token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
        ],
    }
    return {
        "metadata": {
            "labels": {
                **selector_labels(spec.name),
                SERVING_LABEL: "true",
                COMPONENT_LABEL: "inference",
                MANAGED_BY_LABEL: MANAGED_BY,
            },
            "annotations": {ANN_FINGERPRINT: fingerprint, ANN_RESTART: spec.restart_token},
        },
        "spec": {
            "containers": [container],
            "terminationGracePeriodSeconds": 30,
            "enableServiceLinks": False,
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": mib_str(shm_bytes)}},
                {
                    "name": "agent-token",
                    "secret": {"secretName": secret_name(spec.name), "defaultMode": 0o400},
                },
                checkpoint_volume(spec),
            ],
        },
    }


def build_deployment(
    spec: IsvcSpec, shm_bytes: int, fingerprint: str, owner: Mapping[str, Any] | None = None
) -> Obj:
    """The vLLM pods: the agent as entrypoint, /dev/shm sized, checkpoint storage mounted."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec, deployment_name(spec.name), owner, "inference"),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(spec.name)},
            # A restored pod is ready in seconds; surge one at a time so a
            # rollout never runs two cold boots' worth of extra memory.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": build_pod_template(spec, shm_bytes, fingerprint),
        },
    }


def build_cleanup_job(
    namespace: str,
    checkpoint: str,
    path: str,
    volume: Mapping[str, Any],
    image: str,
    pull_policy: str = "IfNotPresent",
) -> Obj:
    """A Job that deletes one checkpoint's data (deletionPolicy Delete).

    The operator does not mount the storage itself; the runtime image (already
    on the node) does the rm, so no other image is needed. volume and image
    are recorded in the Checkpoint's status, so this works after the
    InferenceService is gone too.
    """
    if not path.startswith(CHECKPOINT_MOUNT + "/") or ".." in path.split("/"):
        raise ValueError(f"refusing to delete {path!r}: not below {CHECKPOINT_MOUNT}")
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": f"rm-{checkpoint}"[:63].rstrip("-"),
            "namespace": namespace,
            "labels": {COMPONENT_LABEL: "cleanup", MANAGED_BY_LABEL: MANAGED_BY},
        },
        "spec": {
            "backoffLimit": 2,
            "ttlSecondsAfterFinished": 300,
            "template": {
                "metadata": {"labels": {COMPONENT_LABEL: "cleanup"}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "rm",
                            "image": image,
                            "imagePullPolicy": pull_policy,
                            "command": ["rm", "-rf", "--one-file-system", path],
                            "volumeMounts": [
                                {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}
                            ],
                        }
                    ],
                    "volumes": [{**volume, "name": "checkpoints"}],
                },
            },
        },
    }


def checkpoint_path(isvc: str, checkpoint: str, uid: str) -> str:
    """A fresh directory per Checkpoint object (content is immutable once written)."""
    return f"{CHECKPOINT_MOUNT}/{isvc}/{checkpoint}-{uid[:8]}"
