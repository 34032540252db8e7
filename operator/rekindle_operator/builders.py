"""One plain function per Kubernetes object the operator owns (dicts in, dicts out).

Handlers call these and apply the result; tests call them directly and, in the
cluster suite, send them to the apiserver with a server-side dry run.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from rekindle_contract import restore_pointer
from rekindle_contract.api import ADMIN_PORT, PATH_HEALTHZ, PATH_READYZ, SERVE_PORT
from rekindle_contract.pod import (
    API_KEY_DIR,
    API_KEY_ENV,
    API_KEY_FILE,
    API_KEY_KEY,
    CHECKPOINT_ENV,
    CHECKPOINT_MOUNT,
    CHECKPOINT_SIGNATURE_ENV,
    IMAGE_ENV,
    LOOPBACK_ENV,
    METRICS_TOKEN_ENV,
    METRICS_TOKEN_FILE,
    METRICS_TOKEN_NAME,
    NODE_SOCKET,
    NODE_SOCKET_DIR,
    NODE_SOCKET_ENV,
    NODE_SOCKET_VOLUME,
    POD_UID_ENV,
    RUN_DIR,
    SERVICE_UID_ENV,
    SIGNING_KEY_ENV,
    SIGNING_KEY_FILE,
    SIGNING_KEY_KEY,
    TOKEN_DIR,
    TOKEN_KEY,
)
from rekindle_contract.vllm_argv import MM_AUTO_ENV

from rekindle_operator import admin_tls, placement
from rekindle_operator.agent_command import KV_STORE_MOUNT, agent_command
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
from rekindle_operator.model_source import fetch_init_container, model_mounts, model_volumes
from rekindle_operator.pod_template import env_from_manifest, merge_into
from rekindle_operator.quantity import mib_str
from rekindle_operator.shm_sizing import memory_limit_bytes, memory_request_bytes
from rekindle_operator.spec import IsvcSpec

Obj = dict[str, Any]

CONTAINER = "vllm"


def deployment_name(isvc: str) -> str:
    return isvc


def service_name(isvc: str) -> str:
    return isvc


def secret_name(isvc: str) -> str:
    return f"{isvc}-agent-token"


def signing_secret_name(isvc: str) -> str:
    return f"{isvc}-signing-key"


def metrics_secret_name(isvc: str) -> str:
    return f"{isvc}-metrics-token"


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


def _token_secret(
    spec: IsvcSpec, name: str, component: str, owner: Mapping[str, Any] | None, token: str
) -> Obj:
    """A Secret holding one random bearer token under TOKEN_KEY."""
    token = token or secrets.token_urlsafe(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(spec, name, owner, component),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_secret(spec: IsvcSpec, owner: Mapping[str, Any] | None = None, token: str = "") -> Obj:
    """The agent's bearer token; generated once (the handler never replaces an existing one)."""
    return _token_secret(spec, secret_name(spec.name), "agent-token", owner, token)


def build_metrics_secret(
    spec: IsvcSpec, owner: Mapping[str, Any] | None = None, token: str = ""
) -> Obj:
    """The scrape credential: reads GET /metrics on the admin port and nothing else.

    A Secret of its own, apart from the agent token, so whoever may read it
    (Prometheus, a PodMonitor) cannot trigger a checkpoint or read status.
    """
    return _token_secret(spec, metrics_secret_name(spec.name), "metrics-token", owner, token)


def build_signing_secret(
    spec: IsvcSpec, owner: Mapping[str, Any] | None = None, key: str = ""
) -> Obj:
    """The key that signs this InferenceService's checkpoint manifests (HMAC-SHA256).

    One per InferenceService, generated once like the token: a restore refuses a
    manifest this key did not sign, so a checkpoint written by (or for) another
    InferenceService, or altered on the volume, is never restored here. A
    Secret of its own, so the operator needs no patch right on Secrets.
    """
    key = key or secrets.token_urlsafe(48)  # 64 characters, well above the 32-byte minimum
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(spec, signing_secret_name(spec.name), owner, "signing-key"),
        "type": "Opaque",
        "data": {SIGNING_KEY_KEY: base64.b64encode(key.encode()).decode()},
    }


def build_configmap(
    spec: IsvcSpec,
    checkpoint_path: str,
    owner: Mapping[str, Any] | None = None,
    signature: str = "",
) -> Obj:
    """Names the checkpoint new pods restore from ("" boots normally), with the
    operator's signature of it (rekindle_contract.restore_pointer)."""
    restore = spec.restore_policy != "Never" and bool(checkpoint_path)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(spec, configmap_name(spec.name), owner, "restore-pointer"),
        "data": {
            restore_pointer.PATH_KEY: checkpoint_path if restore else "",
            restore_pointer.SIGNATURE_KEY: signature if restore else "",
        },
    }


def build_pvc(spec: IsvcSpec, owner: Mapping[str, Any] | None = None) -> Obj | None:
    """The checkpoint volume, or None when checkpoints go to a node path or an existing claim.

    Owned by the InferenceService (garbage-collected with it) only when
    coldStart.storage.deletionPolicy is Delete; Retain keeps the data.
    """
    if not spec.storage.uses_claim() or spec.storage.existing_claim:
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
            "accessModes": [spec.storage.access_mode],
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


def network_policy_name(isvc: str) -> str:
    return f"{isvc}-agent"


def disruption_budget_name(name: str) -> str:
    return name


def build_disruption_budget(spec: IsvcSpec, owner: Mapping[str, Any] | None = None) -> Obj | None:
    """spec.disruptionBudget: a PodDisruptionBudget over the service's pods (None: unset).

    Unhealthy pods may always be evicted (unhealthyPodEvictionPolicy AlwaysAllow): a
    replica still booting or restoring never blocks a node drain.
    """
    if spec.disruption_max_unavailable is None:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(spec, disruption_budget_name(spec.name), owner, "inference"),
        "spec": {
            "maxUnavailable": spec.disruption_max_unavailable,
            "selector": {"matchLabels": selector_labels(spec.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def scaled_object_name(name: str) -> str:
    return name


# KEDA reads the front's /load this often; a request held at zero waits up to this long
# before KEDA sees it, so it bounds the scale-from-zero answer.
AUTOSCALING_POLL_S = 1


def build_scaled_object(
    spec: IsvcSpec, front_url: str, owner: Mapping[str, Any] | None = None
) -> Obj | None:
    """spec.autoscaling: a KEDA ScaledObject over the InferenceService's scale subresource
    (None: unset), reading the front's /load for this service with KEDA's metrics-api
    scaler. Above zero KEDA's HPA divides the metric by target per replica; at zero, a
    metric above 0 (a held request) activates the first replica at once."""
    a = spec.autoscaling
    if a is None:
        return None
    delay = a.scale_down_delay_s
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(spec, scaled_object_name(spec.name), owner, "autoscaling"),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": API_VERSION,
                "kind": "InferenceService",
                "name": spec.name,
            },
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": AUTOSCALING_POLL_S,
            "cooldownPeriod": delay,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {"stabilizationWindowSeconds": 0},
                        "scaleDown": {
                            "stabilizationWindowSeconds": delay,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}],
                        },
                    }
                }
            },
            "triggers": [
                {
                    "type": "metrics-api",
                    "metricType": "AverageValue",
                    "metadata": {
                        "url": f"{front_url.rstrip('/')}/load/{spec.namespace}/{spec.name}",
                        "format": "json",
                        "valueLocation": a.metric,
                        "targetValue": str(a.target),
                        "activationTargetValue": "0",
                    },
                }
            ],
        },
    }


def build_network_policy(
    spec: IsvcSpec,
    operator_namespace: str,
    operator_labels: Mapping[str, str],
    owner: Mapping[str, Any] | None = None,
) -> Obj:
    """Ingress to the pods: the OpenAI port from anywhere, the agent's admin port only
    from the operator's pods (its bearer token is the other half of that protection).
    With spec.egress, egress too: cluster DNS and spec.egress.cidrs only.

    Kubelet probes come from the node; NetworkPolicy implementations let a
    node reach its own pods, so /readyz and /healthz keep working.
    """
    policy: Obj = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(spec, network_policy_name(spec.name), owner, "network-policy"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"port": "http", "protocol": "TCP"}]},
                {
                    "from": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": operator_namespace}
                            },
                            "podSelector": {"matchLabels": dict(operator_labels)},
                        }
                    ],
                    "ports": [{"port": "admin", "protocol": "TCP"}],
                },
            ],
        },
    }
    if spec.egress_cidrs is not None:
        policy["spec"]["policyTypes"].append("Egress")
        policy["spec"]["egress"] = egress_rules(spec.egress_cidrs)
    return policy


def egress_rules(cidrs: Sequence[str]) -> list[Obj]:
    """Cluster DNS (kube-dns in kube-system, port 53), then the allowed ranges (none: DNS
    only). vLLM reaches nothing else: not the cloud's metadata endpoint, not other
    services, not a media URL outside the ranges."""
    dns = {
        "to": [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                },
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
    }
    rules = [dns]
    if cidrs:
        rules.append({"to": [{"ipBlock": {"cidr": c}} for c in cidrs]})
    return rules


def storage_subpath(namespace: str, isvc: str) -> str:
    """The directory of one InferenceService's checkpoints inside the checkpoint volume.

    Pods mount only this directory (a subPath), so InferenceServices that
    share a volume (every hostPath one on a node, by default) never see each
    other's checkpoints: namespace and name are both DNS labels, so the path
    is unique and has no `..`.
    """
    return f"{namespace}/{isvc}"


def checkpoint_volume(spec: IsvcSpec) -> Obj:
    if spec.storage.type == "node" and not spec.storage.uses_claim():
        # Scratch for the agent's part of a checkpoint (weight dump, /dev/shm copies):
        # the node agent takes it into its cache, and restores read from there. With
        # publish pvc the claim is both the scratch and where proven checkpoints go.
        return {"name": "checkpoints", "emptyDir": {}}
    if spec.storage.type == "hostPath":
        return {
            "name": "checkpoints",
            "hostPath": {"path": spec.storage.host_path, "type": "DirectoryOrCreate"},
        }
    return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": pvc_name(spec)}}


def _resources(spec: IsvcSpec, shm_bytes: int) -> Obj:
    """Memory request and limit both count /dev/shm (shm_sizing); GPUs as the device
    plugin's extended resource (nvidia.com/gpu, a MIG profile, another vendor's),
    which Kubernetes wants equal in requests and limits."""
    requests: Obj = {"memory": mib_str(memory_request_bytes(spec, shm_bytes))}
    limits: Obj = {"memory": mib_str(memory_limit_bytes(spec, shm_bytes))}
    if spec.cpu:
        requests["cpu"] = spec.cpu
    if spec.gpus:
        requests[spec.gpu_resource] = limits[spec.gpu_resource] = spec.gpus
    return {"requests": requests, "limits": limits}


def _probe(path: str, spec: IsvcSpec, **timing: int) -> Obj:
    """An HTTP GET on the admin port; HTTPS with admin TLS (the kubelet does not verify
    a probe's certificate, so the pod's own certificate serves)."""
    get: Obj = {"path": path, "port": "admin"}
    if spec.admin_tls:
        get["scheme"] = "HTTPS"
    return {"httpGet": get, **timing}


def build_pod_template(
    spec: IsvcSpec,
    shm_bytes: int,
    fingerprint: str,
    service_uid: str = "",
    warm_placement: bool = True,
) -> Obj:
    """The pod the operator owns, with the user's spec.podTemplate and spec.envFrom merged in.

    service_uid: the InferenceService's UID; its pods restore only from a restore
    pointer the operator signed for it. warm_placement: node-local storage's pods
    are created gated, for the operator to place (placement.py)."""
    template = _operator_pod_template(spec, shm_bytes, fingerprint, service_uid)
    container = template["spec"]["containers"][0]
    if spec.env_from:
        # Explicit env wins over envFrom in Kubernetes: the operator's variables
        # (and the loopback ones) stay as set even if a Secret holds the same names.
        container["envFrom"] = env_from_manifest(spec.env_from)
    merge_into(template, container, spec.pod_template)
    if warm_placement and placement.uses_gate(spec.storage.type):
        # Released by the operator with the warm nodes of the moment (placement.py).
        template["spec"]["schedulingGates"] = [{"name": placement.GATE}]
    return template


def _user_env(spec: IsvcSpec) -> list[Obj]:
    """The loopback defaults (a user's entry wins), the user's env (references passed on,
    never resolved), and, when the agent decides on the multimodal cache, that flag."""
    user = {e.name for e in spec.env}
    env: list[Obj] = [{"name": k, "value": v} for k, v in LOOPBACK_ENV.items() if k not in user]
    env += [e.manifest() for e in spec.env]
    if spec.mm_cache_undecided:
        env.append({"name": MM_AUTO_ENV, "value": "1"})
    return env


def _operator_pod_template(
    spec: IsvcSpec, shm_bytes: int, fingerprint: str, service_uid: str
) -> Obj:
    env = _user_env(spec)
    # Set by the operator (spec.env may not name them: spec.MANAGED_ENV). The
    # agent reads them as it reads its flags; env is understood by every agent
    # version, where a flag an older agent lacks would stop it.
    env += [
        # Part of a checkpoint's fingerprint: never restore one image's tree on another's files.
        {"name": IMAGE_ENV, "value": spec.image},
        {"name": SIGNING_KEY_ENV, "value": SIGNING_KEY_FILE},
        {"name": METRICS_TOKEN_ENV, "value": METRICS_TOKEN_FILE},
    ]
    if spec.api_key_secret:
        env.append({"name": API_KEY_ENV, "value": API_KEY_FILE})
    env += [
        {
            "name": name,
            "valueFrom": {
                "configMapKeyRef": {"name": configmap_name(spec.name), "key": key, "optional": True}
            },
        }
        for name, key in (
            (CHECKPOINT_ENV, restore_pointer.PATH_KEY),
            (CHECKPOINT_SIGNATURE_ENV, restore_pointer.SIGNATURE_KEY),
        )
    ]
    if service_uid:  # the agent then restores only from a pointer signed for this service
        env.append({"name": SERVICE_UID_ENV, "value": service_uid})
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
        # A restore is Ready about a second after the container starts: the
        # kubelet's shortest period (1 s) keeps the probe's lag under a second.
        "readinessProbe": _probe(PATH_READYZ, spec, periodSeconds=1, failureThreshold=1),
        "livenessProbe": _probe(
            PATH_HEALTHZ, spec, initialDelaySeconds=10, periodSeconds=10, failureThreshold=6
        ),
        "resources": _resources(spec, shm_bytes),
        "securityContext": _container_security(spec),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            # The agent's token and signing key, read-only, readable by root only.
            {"name": "agent-token", "mountPath": TOKEN_DIR, "readOnly": True},
            # Only this InferenceService's directory of the shared volume. Writable:
            # any serving replica may be the one picked to checkpoint, and the
            # agent writes and verifies a checkpoint at the same path new replicas
            # restore it from (docs/security.md, "Checkpoint storage").
            {
                "name": "checkpoints",
                "mountPath": CHECKPOINT_MOUNT,
                "subPath": storage_subpath(spec.namespace, spec.name),
            },
            # The model's volume (PVC, node path or hub cache), read-only; none for the image.
            *model_mounts(spec.model),
        ],
    }
    if spec.api_key_secret:
        container["volumeMounts"].append(
            {"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True}
        )
    if spec.kv_store:
        # Writable: every pod both stores the KV chunks it computed and loads others'.
        container["volumeMounts"].append({"name": KV_STORE_VOLUME, "mountPath": KV_STORE_MOUNT})
    annotations = {ANN_FINGERPRINT: fingerprint, ANN_RESTART: spec.restart_token}
    if spec.admin_tls:
        container["volumeMounts"].append(
            {"name": admin_tls.VOLUME, "mountPath": admin_tls.DIR, "readOnly": True}
        )
        # Each pod says which name its agent's certificate carries: the operator
        # reads it from the pod, so it reaches old and new pods alike mid-rollout.
        annotations[admin_tls.ANN_SERVER_NAME] = spec.admin_tls.server_name
    template: Obj = {
        "metadata": {
            "labels": {
                **selector_labels(spec.name),
                SERVING_LABEL: "true",
                COMPONENT_LABEL: "inference",
                MANAGED_BY_LABEL: MANAGED_BY,
            },
            "annotations": annotations,
        },
        "spec": {
            "containers": [container],
            # A hub model is downloaded into the node's cache before the agent starts.
            **_fetch_model(spec),
            # vLLM and the agent never call the Kubernetes API: no token in the pod.
            "automountServiceAccountToken": False,
            # The agent lets requests in flight finish within it (agent_command).
            "terminationGracePeriodSeconds": spec.termination_grace_s,
            "enableServiceLinks": False,
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": mib_str(shm_bytes)}},
                {
                    "name": "agent-token",
                    "projected": {
                        "defaultMode": 0o400,
                        "sources": [
                            {
                                "secret": {
                                    "name": secret_name(spec.name),
                                    "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
                                }
                            },
                            {
                                "secret": {
                                    "name": signing_secret_name(spec.name),
                                    "items": [{"key": SIGNING_KEY_KEY, "path": SIGNING_KEY_KEY}],
                                }
                            },
                            {
                                "secret": {
                                    "name": metrics_secret_name(spec.name),
                                    "items": [{"key": TOKEN_KEY, "path": METRICS_TOKEN_NAME}],
                                }
                            },
                        ],
                    },
                },
                checkpoint_volume(spec),
                *model_volumes(spec.model),
                *_api_key_volumes(spec),
                *_admin_tls_volumes(spec),
                *_kv_store_volumes(spec),
            ],
        },
    }
    if node_mode(spec):
        _node_mode_pod(spec, template["spec"], container)
    return template


# The user vLLM and the agent run as when the node agent runs CRIU (nobody).
NODE_MODE_UID = 65534


def node_mode(spec: IsvcSpec) -> bool:
    """The node agent runs CRIU and keeps the checkpoints: the pod needs no privilege."""
    return spec.storage.type == "node"


def _container_security(spec: IsvcSpec) -> Obj:
    if node_mode(spec):
        # Pod Security "restricted" for the container: no privilege at all.
        return {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": NODE_MODE_UID,
            "runAsGroup": NODE_MODE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
    # CRIU dumps and restores a process tree: it needs ptrace, namespaces,
    # TCP repair and /proc/sys writes that only a privileged container has,
    # and no seccomp/AppArmor confinement (the agent confines vLLM itself).
    return {
        "privileged": True,
        "seccompProfile": {"type": "Unconfined"},
        "appArmorProfile": {"type": "Unconfined"},
    }


def _node_mode_pod(spec: IsvcSpec, pod: Obj, container: Obj) -> None:
    """Wire a node-mode pod to its node agent: the socket's emptyDir, the pod's UID, a
    home vLLM can write, the Secrets readable by the pod's group."""
    container["env"] += [
        {"name": NODE_SOCKET_ENV, "value": NODE_SOCKET},
        {"name": POD_UID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        # vLLM, torch and Triton write caches under $HOME: the image's is root's.
        {"name": "HOME", "value": f"{RUN_DIR}/home"},
    ]
    container["volumeMounts"].append({"name": NODE_SOCKET_VOLUME, "mountPath": NODE_SOCKET_DIR})
    pod["volumes"].append({"name": NODE_SOCKET_VOLUME, "emptyDir": {}})
    pod["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": NODE_MODE_UID,
        "runAsGroup": NODE_MODE_UID,
        "fsGroup": NODE_MODE_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for v in pod["volumes"]:
        if v["name"] == "agent-token":
            v["projected"]["defaultMode"] = 0o440  # root:fsGroup, read by the pod's user


def _fetch_model(spec: IsvcSpec) -> Obj:
    init = fetch_init_container(spec.model, spec.image, spec.image_pull_policy)
    return {"initContainers": [init]} if init else {}


def _api_key_volumes(spec: IsvcSpec) -> list[Obj]:
    if not spec.api_key_secret:
        return []
    name, key = spec.api_key_secret
    return [
        {
            "name": "api-key",
            "secret": {
                "secretName": name,
                "items": [{"key": key, "path": API_KEY_KEY}],
                "defaultMode": 0o400,
            },
        }
    ]


KV_STORE_VOLUME = "kv-store"


def _kv_store_volumes(spec: IsvcSpec) -> list[Obj]:
    """spec.kvCache.sharedStore's volume: the user's claim, or a node directory."""
    store = spec.kv_store
    if store is None:
        return []
    if store.claim_name:
        return [{"name": KV_STORE_VOLUME, "persistentVolumeClaim": {"claimName": store.claim_name}}]
    return [
        {
            "name": KV_STORE_VOLUME,
            "hostPath": {"path": store.host_path, "type": "DirectoryOrCreate"},
        }
    ]


def _admin_tls_volumes(spec: IsvcSpec) -> list[Obj]:
    """The certificate and its key only (not ca.crt, which only the operator needs),
    read-only and readable by root only, like the token."""
    if not spec.admin_tls:
        return []
    return [
        {
            "name": admin_tls.VOLUME,
            "secret": {
                "secretName": spec.admin_tls.secret_name,
                "items": [
                    {"key": admin_tls.CERT_KEY, "path": admin_tls.CERT_KEY},
                    {"key": admin_tls.KEY_KEY, "path": admin_tls.KEY_KEY},
                ],
                "defaultMode": 0o400,
            },
        }
    ]


def build_deployment(
    spec: IsvcSpec,
    shm_bytes: int,
    fingerprint: str,
    owner: Mapping[str, Any] | None = None,
    surge: int = 0,
    warm_placement: bool = True,
) -> Obj:
    """The vLLM pods: the agent as entrypoint, /dev/shm sized, checkpoint storage mounted.

    surge: replicas beyond spec.replicas (one while an automatic checkpoint runs,
    auto_checkpoint.surge), never from zero. Where each new pod goes is decided when
    it is created, not here (placement.py).
    """
    uid = str(((owner or {}).get("metadata") or {}).get("uid") or "")
    template = build_pod_template(spec, shm_bytes, fingerprint, uid, warm_placement)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec, deployment_name(spec.name), owner, "inference"),
        "spec": {
            "replicas": spec.replicas + surge if spec.replicas else 0,
            "selector": {"matchLabels": selector_labels(spec.name)},
            # spec.rollout; by default one surge pod at a time, none taken out first: a
            # rollout never runs two cold boots' worth of extra memory nor drops a replica.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.max_surge,
                    "maxUnavailable": spec.max_unavailable,
                },
            },
            "template": template,
        },
    }


def cleanup_job_name(checkpoint: str, uid: str) -> str:
    """Unique per Checkpoint object: a re-created Checkpoint of the same name gets its own Job."""
    return f"rm-{checkpoint[:50].rstrip('-')}-{uid[:8]}"


def build_cleanup_job(
    namespace: str,
    checkpoint: str,
    uid: str,
    path: str,
    volume: Mapping[str, Any],
    image: str,
    pull_policy: str = "IfNotPresent",
    sub_path: str = "",
    node: str = "",
    written_by_node_agent: bool = False,
    from_store: bool = False,
    from_node_cache: bool = False,
) -> Obj:
    """A Job that deletes one checkpoint's data (deletionPolicy Delete).

    The operator does not mount the storage itself; the runtime image (already
    on the node) does the rm, so no other image is needed. volume, subPath,
    node and image are recorded in the Checkpoint's status, so this works
    after the InferenceService is gone too. A hostPath volume is a directory
    of one node: the Job runs on the node the checkpointed pod ran on.
    written_by_node_agent: a copy the node agent published (owned by the pods'
    user, never immutable), in a namespace that may enforce Pod Security
    baseline: the Job runs as that user with no capability at all.
    from_store: the data is in the node agents' object store, which this Job
    cannot reach: it asks its node's agent (the node socket's emptyDir, as a
    serving pod does), which deletes only this namespace's checkpoints.
    from_node_cache: only node's cached copy goes (its node agent asked the same
    way; the published copy stays): the Job is bound to node.
    """
    if not path.startswith(CHECKPOINT_MOUNT + "/") or ".." in path.split("/"):
        raise ValueError(f"refusing to delete {path!r}: not below {CHECKPOINT_MOUNT}")
    if ".." in sub_path.split("/") or sub_path.startswith("/"):
        raise ValueError(f"refusing subPath {sub_path!r}")
    mount: Obj = {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}
    if sub_path:
        mount["subPath"] = sub_path
    pod_spec: Obj = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [
            {
                "name": "rm",
                "image": image,
                "imagePullPolicy": pull_policy,
                # The agent's CLI clears the pages images' immutable flag, then removes.
                "command": ["rekindle", "remove-checkpoint", path],
                "securityContext": _cleanup_security(written_by_node_agent),
                "volumeMounts": [mount],
            }
        ],
        "volumes": [{**volume, "name": "checkpoints"}],
    }
    if from_store or from_node_cache:
        container = pod_spec["containers"][0]
        flag = "--from-node-cache" if from_node_cache else "--from-store"
        container["command"] = ["rekindle", "remove-checkpoint", flag, path]
        container["securityContext"] = _cleanup_security(True)
        container["env"] = [
            {"name": NODE_SOCKET_ENV, "value": NODE_SOCKET},
            {"name": POD_UID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        ]
        container["volumeMounts"] = [{"name": NODE_SOCKET_VOLUME, "mountPath": NODE_SOCKET_DIR}]
        pod_spec["volumes"] = [{"name": NODE_SOCKET_VOLUME, "emptyDir": {}}]
    if from_node_cache:
        pod_spec["nodeName"] = node  # that node's cache: no scheduling, no cordon in the way
    if "hostPath" in volume and node and not from_store:
        pod_spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        }
        # The node may be cordoned or tainted: the data is there, so go there.
        pod_spec["tolerations"] = [{"operator": "Exists"}]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": cleanup_job_name(checkpoint, uid),
            "namespace": namespace,
            "labels": {COMPONENT_LABEL: "cleanup", MANAGED_BY_LABEL: MANAGED_BY},
            "annotations": {"rekindle.dev/checkpoint": checkpoint},
        },
        "spec": {
            "backoffLimit": 2,
            "ttlSecondsAfterFinished": 300,
            "activeDeadlineSeconds": 600,
            "template": {"metadata": {"labels": {COMPONENT_LABEL: "cleanup"}}, "spec": pod_spec},
        },
    }


def _cleanup_security(written_by_node_agent: bool) -> Obj:
    if written_by_node_agent:
        return {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "runAsNonRoot": True,
            "runAsUser": NODE_MODE_UID,
            "runAsGroup": NODE_MODE_UID,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"], "add": ["LINUX_IMMUTABLE"]},
    }


def checkpoint_path(checkpoint: str, uid: str) -> str:
    """A fresh directory per Checkpoint object (content is immutable once written).

    The path inside the pod, below the InferenceService's own subPath of the
    volume (storage_subpath): on the volume it is NAMESPACE/ISVC/NAME-UID8.
    """
    return f"{CHECKPOINT_MOUNT}/{checkpoint}-{uid[:8]}"
