"""The InferenceService spec as typed values, with the CRD's defaults applied again.

The apiserver already defaults and validates (charts/rekindle/files/crds/); parsing
here once more keeps every builder a pure function of one typed value, and
lets unit tests build specs without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rekindle_contract.pod import (
    API_KEY_ENV,
    CHECKPOINT_ENV,
    IMAGE_ENV,
    SIGNING_KEY_ENV,
    TOKEN_ENV,
)
from rekindle_contract.vllm_argv import MANAGED_VLLM_FLAGS

from rekindle_operator.constants import ANN_RESTART
from rekindle_operator.quantity import to_bytes

DEFAULT_IMAGE = "rekindle.local/runtime-cpu:dev"
# Pod env the operator sets itself: spec.env may not name these.
MANAGED_ENV = (CHECKPOINT_ENV, IMAGE_ENV, SIGNING_KEY_ENV, API_KEY_ENV, TOKEN_ENV)


class SpecError(ValueError):
    """A spec the operator refuses; the message says which field to change and how."""


@dataclass(frozen=True)
class Storage:
    """Where checkpoints live: a PVC the operator creates (or an existing one), or a node path."""

    type: str = "pvc"  # pvc | hostPath
    size: str = "20Gi"
    storage_class: str | None = None
    existing_claim: str | None = None
    host_path: str = "/var/lib/rekindle/checkpoints"
    # What happens to an operator-created PVC when the InferenceService goes:
    # Delete garbage-collects it with the InferenceService, Retain keeps it.
    deletion_policy: str = "Retain"


@dataclass(frozen=True)
class AdminTLS:
    """spec.adminTLS: the agents' admin port over HTTPS.

    secret_name: a Secret in the InferenceService's namespace with tls.crt,
    tls.key and ca.crt (what cert-manager writes); the pods mount the first
    two, the operator verifies with the third. server_name: the DNS name the
    certificate must carry (the operator connects to pod IPs, which no
    certificate names).
    """

    secret_name: str
    server_name: str


def default_server_name(name: str, namespace: str) -> str:
    """The Service's cluster DNS name: what a cert-manager Certificate for it would name."""
    return f"{name}.{namespace}.svc"


@dataclass(frozen=True)
class IsvcSpec:
    name: str
    namespace: str
    model_source: str
    served_name: str
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    device: str = "cpu"
    replicas: int = 1
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    vllm_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cpu: str | None = None
    memory: str = "8Gi"
    gpus: int = 0
    shm_size: str | None = None  # None: the operator computes it
    mm_shm_cache: bool = True
    mm_cache_bytes: int = 4 * 2**30
    mm_max_object_mib: int = 128
    prefix_caching: bool = True
    kv_offload_bytes: int = 0
    storage: Storage = field(default_factory=Storage)
    restore_policy: str = "IfAvailable"  # IfAvailable | Never
    prefetch: bool = True
    restart_token: str = ""  # bumped by `kubectl rekindle restore`
    # The user's Secret (name, key) holding the API key clients must send on the
    # serve port; None: no key. The operator mounts it, never reads it.
    api_key_secret: tuple[str, str] | None = None
    # TLS on the agents' admin port; None: plain HTTP. Like the API key, left out
    # of the spec fingerprint (spec_fingerprint.py): the certificate is read by
    # the agent, in front of vLLM, and never reaches vLLM's process, so a
    # checkpoint made with or without it restores the same tree either way.
    admin_tls: AdminTLS | None = None


def _get(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = d.get(key) or {}
    if not isinstance(v, Mapping):
        raise SpecError(f"spec.{key} must be an object")
    return v


def parse_spec(
    name: str, namespace: str, spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None
) -> IsvcSpec:
    """IsvcSpec from the object's spec; raises SpecError naming the field to fix."""
    model = _get(spec, "model")
    source = model.get("source")
    if not source:
        raise SpecError("spec.model.source is required: a local model directory or a model id")
    runtime = _get(spec, "runtime")
    res = _get(spec, "resources")
    shm = _get(spec, "sharedMemory")
    mm = _get(spec, "multimodal")
    kv = _get(spec, "kvCache")
    cold = _get(spec, "coldStart")
    st = _get(cold, "storage")
    pvc = _get(st, "pvc")
    hp = _get(st, "hostPath")
    api_key = _get(spec, "apiKeySecretRef")
    admin_tls = _get(spec, "adminTLS")

    tp = int(spec.get("tensorParallelSize", 1))
    replicas = int(spec.get("replicas", 1))
    device = str(runtime.get("device", "cpu"))
    gpus = int(res.get("gpus", 0))
    vllm_args = tuple(str(a) for a in spec.get("vllmArgs", []) or [])
    env = tuple((str(e["name"]), str(e.get("value", ""))) for e in spec.get("env", []) or [])
    out = IsvcSpec(
        name=name,
        namespace=namespace,
        model_source=str(source),
        served_name=str(model.get("servedName") or name),
        image=str(runtime.get("image", DEFAULT_IMAGE)),
        image_pull_policy=str(runtime.get("imagePullPolicy", "IfNotPresent")),
        device=device,
        replicas=replicas,
        tensor_parallel_size=tp,
        max_model_len=int(spec["maxModelLen"]) if spec.get("maxModelLen") else None,
        vllm_args=vllm_args,
        env=env,
        cpu=str(res["cpu"]) if res.get("cpu") is not None else None,
        memory=str(res.get("memory", "8Gi")),
        gpus=gpus,
        shm_size=str(shm["size"]) if shm.get("size") else None,
        mm_shm_cache=bool(mm.get("shmCache", True)),
        mm_cache_bytes=to_bytes(mm.get("cacheSize", "4Gi")),
        mm_max_object_mib=int(mm.get("maxObjectMiB", 128)),
        prefix_caching=bool(kv.get("prefixCaching", True)),
        kv_offload_bytes=to_bytes(kv.get("cpuOffloadSize", 0)),
        storage=Storage(
            type=str(st.get("type", "pvc")),
            size=str(pvc.get("size", "20Gi")),
            storage_class=pvc.get("storageClassName"),
            existing_claim=pvc.get("existingClaim"),
            host_path=str(hp.get("path", "/var/lib/rekindle/checkpoints")),
            deletion_policy=str(st.get("deletionPolicy", "Retain")),
        ),
        restore_policy=str(cold.get("restorePolicy", "IfAvailable")),
        prefetch=bool(cold.get("prefetch", True)),
        restart_token=(annotations or {}).get(ANN_RESTART, ""),
        api_key_secret=(
            (str(api_key["name"]), str(api_key.get("key") or "api-key"))
            if api_key.get("name")
            else None
        ),
        admin_tls=(
            _admin_tls(name, namespace, admin_tls) if spec.get("adminTLS") is not None else None
        ),
    )
    validate(out)
    return out


def _admin_tls(name: str, namespace: str, tls: Mapping[str, Any]) -> AdminTLS:
    if not tls.get("secretName"):
        raise SpecError(
            "spec.adminTLS.secretName is required: a kubernetes.io/tls Secret in this "
            "namespace with tls.crt, tls.key and ca.crt (e.g. a cert-manager Certificate's)"
        )
    return AdminTLS(
        secret_name=str(tls["secretName"]),
        server_name=str(tls.get("serverName") or default_server_name(name, namespace)),
    )


def validate(s: IsvcSpec) -> None:
    """The CRD's CEL checks again, for specs that did not come through the apiserver."""
    if s.replicas < 0:
        raise SpecError(f"spec.replicas is {s.replicas}: use 0 or more")
    if s.tensor_parallel_size < 1:
        raise SpecError("spec.tensorParallelSize must be 1 or more")
    if s.device not in ("cpu", "gpu"):
        raise SpecError(f"spec.runtime.device is {s.device!r}: use 'cpu' or 'gpu'")
    if s.device == "gpu" and s.gpus < s.tensor_parallel_size:
        raise SpecError(
            f"spec.resources.gpus ({s.gpus}) is below spec.tensorParallelSize "
            f"({s.tensor_parallel_size}): each tensor-parallel rank needs a GPU"
        )
    for arg in s.vllm_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_VLLM_FLAGS:
            raise SpecError(
                f"spec.vllmArgs sets {flag}, which the operator manages: "
                "use spec.model, spec.multimodal, spec.kvCache or spec.tensorParallelSize instead"
            )
    for name, _ in s.env:
        if name in MANAGED_ENV:
            raise SpecError(
                f"spec.env sets {name}, which the operator manages: remove it "
                "(use spec.apiKeySecretRef for the serve port's API key)"
            )
    if s.mm_shm_cache and s.mm_max_object_mib * 2**20 > s.mm_cache_bytes:
        raise SpecError(
            "spec.multimodal.maxObjectMiB is larger than spec.multimodal.cacheSize: "
            "lower maxObjectMiB or raise cacheSize"
        )
    if s.storage.type not in ("pvc", "hostPath"):
        raise SpecError(
            f"spec.coldStart.storage.type is {s.storage.type!r}: use 'pvc' or 'hostPath'"
        )
    if s.storage.type == "hostPath" and not s.storage.host_path.startswith("/"):
        raise SpecError("spec.coldStart.storage.hostPath.path must be an absolute path")
    if s.restore_policy not in ("IfAvailable", "Never"):
        raise SpecError(
            f"spec.coldStart.restorePolicy is {s.restore_policy!r}: use IfAvailable or Never"
        )
