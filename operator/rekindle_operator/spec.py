"""The InferenceService spec as typed values, with the CRD's defaults applied again.

The apiserver already defaults and validates (charts/rekindle/files/crds/); parsing
here once more keeps every builder a pure function of one typed value, and
lets unit tests build specs without a cluster.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rekindle_contract import lora as lora_rules
from rekindle_contract.pod import (
    API_KEY_ENV,
    CHECKPOINT_ENV,
    CHECKPOINT_SIGNATURE_ENV,
    IMAGE_ENV,
    METRICS_TOKEN_ENV,
    SERVICE_UID_ENV,
    SIGNING_KEY_ENV,
    TOKEN_ENV,
)
from rekindle_contract.vllm_argv import MM_AUTO_ENV, managed_flag

from rekindle_operator.constants import ANN_RESTART
from rekindle_operator.model_source import ModelSource, parse_model
from rekindle_operator.pod_template import EnvVar, PodTemplate, parse_extras
from rekindle_operator.quantity import to_bytes
from rekindle_operator.spec_error import SpecError

DEFAULT_IMAGE = "rekindle.local/runtime-cpu:dev"
# Pod env the operator sets itself: spec.env may not name these.
MANAGED_ENV = (
    CHECKPOINT_ENV,
    CHECKPOINT_SIGNATURE_ENV,
    SERVICE_UID_ENV,
    IMAGE_ENV,
    SIGNING_KEY_ENV,
    API_KEY_ENV,
    TOKEN_ENV,
    METRICS_TOKEN_ENV,
    MM_AUTO_ENV,
)


@dataclass(frozen=True)
class Storage:
    """Where checkpoints live: a PVC the operator creates (or an existing one), or a node path."""

    type: str = "pvc"  # pvc | hostPath | node
    size: str = "20Gi"
    storage_class: str | None = None
    # ReadWriteOnce (one node mounts it) or ReadWriteMany (replicas on several nodes).
    access_mode: str = "ReadWriteOnce"
    existing_claim: str | None = None
    host_path: str = "/var/lib/rekindle/checkpoints"
    # What happens to an operator-created PVC when the InferenceService goes:
    # Delete garbage-collects it with the InferenceService, Retain keeps it.
    deletion_policy: str = "Retain"
    # type node: where the node agent publishes proven checkpoints for other caches
    # to pull (none: they stay in the node's cache; pvc: the claim above).
    publish: str = "none"

    def uses_claim(self) -> bool:
        """Checkpoints (or their published copies) live on the PVC."""
        return self.type == "pvc" or (self.type == "node" and self.publish == "pvc")


@dataclass(frozen=True)
class KvStore:
    """spec.kvCache.sharedStore: a volume of KV chunks that every pod mounts (GPU only).

    Exactly one of claim_name (an existing PVC; ReadWriteMany for pods on several
    nodes) and host_path (a node directory, shared by the pods of that node).
    """

    claim_name: str | None = None
    host_path: str | None = None


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


@dataclass(frozen=True)
class Autoscaling:
    """spec.autoscaling: the KEDA ScaledObject the operator owns (builders.build_scaled_object).

    metric: which number of the front's /load the autoscaler divides by target
    ("requests": running + waiting + held; "waiting": waiting + held).
    scale_down_delay_s: seconds of low load before replicas go (KEDA's cooldown
    for the last one, the HPA's scale-down stabilization for the others).
    """

    min_replicas: int
    max_replicas: int
    metric: str = "requests"
    target: int = 8
    scale_down_delay_s: int = 300


AUTOSCALING_METRICS = ("requests", "waiting")


@dataclass(frozen=True)
class Lora:
    """spec.lora: vLLM serves LoRA adapters beside the base model.

    adapters: (name, directory) served from the start, each directory inside the
    model's and relative to it (rekindle_contract.lora); more can be loaded at
    run time through the agent's admin API.
    """

    max_adapters: int = 1
    max_rank: int = 16
    adapters: tuple[tuple[str, str], ...] = ()


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
    env: tuple[EnvVar, ...] = ()
    # spec.envFrom: each a canonical JSON {secretRef|configMapRef, prefix}; never resolved here.
    env_from: tuple[str, ...] = ()
    cpu: str | None = None
    memory: str = "8Gi"
    gpus: int = 0  # spec.resources.gpu.count (or the older spec.resources.gpus)
    gpu_resource: str = "nvidia.com/gpu"  # spec.resources.gpu.resourceName
    shm_size: str | None = None  # None: the operator computes it
    # spec.multimodal.enabled: True the model takes images, False it does not,
    # None (unset) the agent decides from the model's config.json at launch.
    mm_enabled: bool | None = None
    # The shared-memory multimodal cache is sized for and passed to the agent:
    # spec.multimodal.shmCache, and never for a model declared text-only.
    mm_shm_cache: bool = True
    mm_cache_bytes: int = 4 * 2**30
    mm_max_object_mib: int = 128
    # spec.multimodal.allowedMediaDomains: hosts vLLM may fetch media URLs from
    # (empty: any); allowMediaRedirects: whether those fetches follow redirects.
    mm_allowed_media_domains: tuple[str, ...] = ()
    mm_media_redirects: bool = False
    prefix_caching: bool = True
    kv_offload_bytes: int = 0
    # spec.kvCache.sharedStore; None: no store shared between pods.
    kv_store: KvStore | None = None
    storage: Storage = field(default_factory=Storage)
    restore_policy: str = "IfAvailable"  # IfAvailable | Never
    prefetch: bool = True
    # spec.coldStart.keepResident: bytes of the newest checkpoint each pod keeps
    # locked in its node's page cache (0: off).
    keep_resident_bytes: int = 0
    # spec.coldStart.checkpoint: the operator checkpoints each new spec by itself, and
    # keeps that many of its own checkpoints.
    auto_checkpoint: bool = False
    auto_keep: int = 2
    restart_token: str = ""  # bumped by `kubectl rekindle restore`
    # The user's Secret (name, key) holding the API key clients must send on the
    # serve port; None: no key. The operator mounts it, never reads it.
    api_key_secret: tuple[str, str] | None = None
    # spec.egress.cidrs: set, the pods may reach only cluster DNS and these
    # address ranges (the service's NetworkPolicy gains Egress); None: no limit.
    egress_cidrs: tuple[str, ...] | None = None
    # TLS on the agents' admin port; None: plain HTTP. Like the API key, left out
    # of the spec fingerprint (spec_fingerprint.py): the certificate is read by
    # the agent, in front of vLLM, and never reaches vLLM's process, so a
    # checkpoint made with or without it restores the same tree either way.
    admin_tls: AdminTLS | None = None
    # Where the weights come from (spec.model); model_source above is the path
    # vLLM loads them from inside the container (model.path).
    model: ModelSource = field(default_factory=ModelSource)
    # spec.podTemplate: placement, identity, extra labels, annotations and volumes.
    pod_template: PodTemplate = field(default_factory=PodTemplate)
    # spec.rollout: how many pods a rolling update may add above, and take out of,
    # spec.replicas at once (a count or a percentage, as a Deployment takes them).
    max_surge: int | str = 1
    max_unavailable: int | str = 0
    # spec.terminationGracePeriodSeconds: how long a stopping pod may let requests in
    # flight finish (the agent's --shutdown-drain is derived from it).
    termination_grace_s: int = 30
    # spec.disruptionBudget.maxUnavailable: an owned PodDisruptionBudget (None: none).
    disruption_max_unavailable: int | str | None = None
    # spec.maxConcurrentRequests: requests each pod's serve port forwards to vLLM at once
    # (the agent's --proxy-max-concurrency; beyond it 429 with Retry-After).
    max_concurrent_requests: int = 256
    # spec.autoscaling: scale on load through KEDA (None: spec.replicas is the user's).
    autoscaling: Autoscaling | None = None
    # spec.lora: LoRA adapters served beside the base model (None: LoRA off).
    lora: Lora | None = None

    @property
    def mm_cache_undecided(self) -> bool:
        """The cache is sized for, but the agent may leave it off (a text model's config.json)."""
        return self.mm_shm_cache and self.mm_enabled is None


def _get(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = d.get(key) or {}
    if not isinstance(v, Mapping):
        raise SpecError(f"spec.{key} must be an object")
    return v


# A media host as vLLM compares it (the URL's hostname): a DNS name or an IPv4
# address, lower case, no port, no wildcard.
MEDIA_DOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _media_domains(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError("spec.multimodal.allowedMediaDomains must be a list of host names")
    for host in value:
        if len(host) > 253 or not MEDIA_DOMAIN.match(host):
            raise SpecError(
                f"spec.multimodal.allowedMediaDomains: {host!r} is not a host name: give "
                "each host as a URL names it (images.example.com, 10.0.0.5), lower case, "
                "without scheme, port or wildcard"
            )
    return tuple(value)


def parse_spec(
    name: str, namespace: str, spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None
) -> IsvcSpec:
    """IsvcSpec from the object's spec; raises SpecError naming the field to fix."""
    model = _get(spec, "model")
    source = parse_model(model)
    runtime = _get(spec, "runtime")
    res = _get(spec, "resources")
    shm = _get(spec, "sharedMemory")
    mm = _get(spec, "multimodal")
    kv = _get(spec, "kvCache")
    cold = _get(spec, "coldStart")
    st = _get(cold, "storage")
    pvc = _get(st, "pvc")
    hp = _get(st, "hostPath")
    node_st = _get(st, "node")
    api_key = _get(spec, "apiKeySecretRef")
    admin_tls = _get(spec, "adminTLS")
    rollout = _get(spec, "rollout")

    tp = int(spec.get("tensorParallelSize", 1))
    replicas = int(spec.get("replicas", 1))
    device = str(runtime.get("device", "cpu"))
    extras = parse_extras(spec, res)
    vllm_args = tuple(str(a) for a in spec.get("vllmArgs", []) or [])
    out = IsvcSpec(
        name=name,
        namespace=namespace,
        model_source=source.path,
        model=source,
        served_name=str(model.get("servedName") or name),
        image=str(runtime.get("image", DEFAULT_IMAGE)),
        image_pull_policy=str(runtime.get("imagePullPolicy", "IfNotPresent")),
        device=device,
        replicas=replicas,
        tensor_parallel_size=tp,
        max_model_len=int(spec["maxModelLen"]) if spec.get("maxModelLen") else None,
        vllm_args=vllm_args,
        env=extras.env,
        env_from=extras.env_from,
        pod_template=extras.template,
        cpu=str(res["cpu"]) if res.get("cpu") is not None else None,
        memory=str(res.get("memory", "8Gi")),
        gpus=extras.gpu.count,
        gpu_resource=extras.gpu.resource_name,
        shm_size=str(shm["size"]) if shm.get("size") else None,
        mm_enabled=bool(mm["enabled"]) if mm.get("enabled") is not None else None,
        mm_shm_cache=bool(mm.get("shmCache", True)) and mm.get("enabled") is not False,
        mm_cache_bytes=to_bytes(mm.get("cacheSize", "4Gi")),
        mm_max_object_mib=int(mm.get("maxObjectMiB", 128)),
        mm_allowed_media_domains=_media_domains(mm.get("allowedMediaDomains")),
        mm_media_redirects=bool(mm.get("allowMediaRedirects", False)),
        prefix_caching=bool(kv.get("prefixCaching", True)),
        kv_offload_bytes=to_bytes(kv.get("cpuOffloadSize", 0)),
        kv_store=_kv_store(_get(kv, "sharedStore")) if kv.get("sharedStore") is not None else None,
        storage=Storage(
            type=str(st.get("type", "pvc")),
            size=str(pvc.get("size", "20Gi")),
            storage_class=pvc.get("storageClassName"),
            access_mode=str(pvc.get("accessMode", "ReadWriteOnce")),
            existing_claim=pvc.get("existingClaim"),
            host_path=str(hp.get("path", "/var/lib/rekindle/checkpoints")),
            deletion_policy=str(st.get("deletionPolicy", "Retain")),
            publish=str(node_st.get("publish", "none")),
        ),
        restore_policy=str(cold.get("restorePolicy", "IfAvailable")),
        prefetch=bool(cold.get("prefetch", True)),
        keep_resident_bytes=_keep_resident(_get(cold, "keepResident")),
        auto_checkpoint=bool(_get(cold, "checkpoint").get("auto", False)),
        auto_keep=int(_get(cold, "checkpoint").get("keep", 2)),
        restart_token=(annotations or {}).get(ANN_RESTART, ""),
        api_key_secret=(
            (str(api_key["name"]), str(api_key.get("key") or "api-key"))
            if api_key.get("name")
            else None
        ),
        admin_tls=(
            _admin_tls(name, namespace, admin_tls) if spec.get("adminTLS") is not None else None
        ),
        egress_cidrs=_egress(spec.get("egress")),
        max_surge=_int_or_percent(rollout, "spec.rollout", "maxSurge", 1),
        max_unavailable=_int_or_percent(rollout, "spec.rollout", "maxUnavailable", 0),
        termination_grace_s=int(spec.get("terminationGracePeriodSeconds", 30)),
        disruption_max_unavailable=_disruption_budget(spec.get("disruptionBudget")),
        max_concurrent_requests=int(spec.get("maxConcurrentRequests", 256)),
        autoscaling=_autoscaling(spec.get("autoscaling")),
        lora=_lora(spec.get("lora")),
    )
    validate(out)
    return out


MAX_CONCURRENT_REQUESTS = 65536

PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")


def _int_or_percent(obj: Mapping[str, Any], where: str, key: str, default: int) -> int | str:
    """WHERE.KEY (spec.rollout, spec.disruptionBudget): a count (>= 0) or a percentage of
    spec.replicas ("25%")."""
    value = obj.get(key, default)
    if isinstance(value, bool) or not (
        (isinstance(value, int) and value >= 0) or (isinstance(value, str) and PERCENT.match(value))
    ):
        raise SpecError(
            f"{where}.{key}: {value!r} is neither a count (0 or more) nor a percentage "
            "(such as 25%)"
        )
    return value


def _disruption_budget(value: object) -> int | str | None:
    """spec.disruptionBudget.maxUnavailable (at least 1, or a percentage above 0%)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or "maxUnavailable" not in value:
        raise SpecError(
            "spec.disruptionBudget needs maxUnavailable: how many replicas voluntary "
            "evictions (a node drain) may take out at once, such as 1 or 25%"
        )
    got = _int_or_percent(value, "spec.disruptionBudget", "maxUnavailable", 1)
    if got in (0, "0%"):
        raise SpecError(
            "spec.disruptionBudget.maxUnavailable is 0: no node could ever be drained; "
            "allow at least 1 (or remove spec.disruptionBudget)"
        )
    return got


def _autoscaling(value: object) -> Autoscaling | None:
    """spec.autoscaling, checked as the CRD checks it (specs may skip the apiserver)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or "maxReplicas" not in value:
        raise SpecError(
            "spec.autoscaling needs maxReplicas: the most replicas the autoscaler may run"
        )

    def count(key: str, default: int | None, low: int, high: int) -> int:
        got = value.get(key, default)
        if isinstance(got, bool) or not isinstance(got, int) or not low <= got <= high:
            raise SpecError(f"spec.autoscaling.{key}: {got!r} is not a whole number {low}-{high}")
        return got

    out = Autoscaling(
        min_replicas=count("minReplicas", 1, 0, 1000),
        max_replicas=count("maxReplicas", None, 1, 1000),
        metric=str(value.get("metric", "requests")),
        target=count("target", 8, 1, 100000),
        scale_down_delay_s=count("scaleDownDelay", 300, 0, 86400),
    )
    if out.metric not in AUTOSCALING_METRICS:
        raise SpecError(
            f"spec.autoscaling.metric: {out.metric!r}; use one of {', '.join(AUTOSCALING_METRICS)}"
        )
    if out.min_replicas > out.max_replicas:
        raise SpecError(
            f"spec.autoscaling: minReplicas ({out.min_replicas}) is above maxReplicas "
            f"({out.max_replicas})"
        )
    return out


def _lora(value: object) -> Lora | None:
    """spec.lora, checked as the CRD checks it (specs may skip the apiserver)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SpecError("spec.lora must be an object (maxAdapters, maxRank, adapters)")
    max_adapters, max_rank = value.get("maxAdapters", 1), value.get("maxRank", 16)
    if isinstance(max_adapters, bool) or not isinstance(max_adapters, int) or max_adapters < 1:
        raise SpecError(f"spec.lora.maxAdapters: {max_adapters!r} is not a whole number >= 1")
    if max_rank not in lora_rules.MAX_RANKS or isinstance(max_rank, bool):
        ranks = ", ".join(map(str, lora_rules.MAX_RANKS))
        raise SpecError(f"spec.lora.maxRank: {max_rank!r}; use one of {ranks}")
    pairs = []
    for i, a in enumerate(value.get("adapters") or []):
        if not isinstance(a, Mapping) or not a.get("name") or not a.get("path"):
            raise SpecError(f"spec.lora.adapters[{i}] needs name and path")
        pairs.append((str(a["name"]), str(a["path"])))
    try:
        lora_rules.parse_adapters(lora_rules.format_adapters(pairs))
    except lora_rules.LoraError as e:
        raise SpecError(f"spec.lora.adapters: {e}") from e
    return Lora(max_adapters, int(max_rank), tuple(pairs))


def _validate_lora(s: IsvcSpec) -> None:
    if s.lora is None:
        return
    if s.served_name in {n for n, _ in s.lora.adapters}:
        raise SpecError(
            f"spec.lora.adapters: {s.served_name!r} is the base model's name (spec.servedName "
            "or the service's name); give the adapter another"
        )
    if s.model.kind == "source" and not s.model_source.startswith("/"):
        raise SpecError(
            "spec.lora: adapters are directories inside the model's directory, and "
            f"spec.model.source {s.model_source!r} is a model id; use a directory (an "
            "absolute path in the image), or a pvc, hostPath, huggingFace or s3 model"
        )


def _validate_rollout(s: IsvcSpec) -> None:
    """What a Deployment refuses, said in the spec's words before it gets that far."""
    if s.max_surge in (0, "0%") and s.max_unavailable in (0, "0%"):
        raise SpecError(
            "spec.rollout: maxSurge and maxUnavailable are both 0, so a rolling update could "
            "never replace a pod: allow a surge (maxSurge: 1, the default) or an unavailable "
            "pod (maxUnavailable: 1)"
        )
    if not 5 <= s.termination_grace_s <= 3600:
        raise SpecError(
            f"spec.terminationGracePeriodSeconds: {s.termination_grace_s} is outside 5-3600: "
            "a stopping pod needs a few seconds to let requests in flight finish"
        )
    if not 1 <= s.max_concurrent_requests <= MAX_CONCURRENT_REQUESTS:
        raise SpecError(
            f"spec.maxConcurrentRequests: {s.max_concurrent_requests} is outside "
            f"1-{MAX_CONCURRENT_REQUESTS}: a pod forwards at least one request at once"
        )


def _egress(value: object) -> tuple[str, ...] | None:
    """spec.egress.cidrs as normalized networks; None when spec.egress is unset."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("cidrs", []), list):
        raise SpecError("spec.egress must be an object with a list cidrs")
    out = []
    for cidr in value.get("cidrs", []):
        try:
            out.append(str(ipaddress.ip_network(str(cidr), strict=True)))
        except ValueError as e:
            raise SpecError(
                f"spec.egress.cidrs: {cidr!r} is not a network in CIDR notation ({e}): "
                "write it as 10.0.0.0/8 or 2001:db8::/32, with no host bits set"
            ) from None
    return tuple(out)


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


def _keep_resident(kr: Mapping[str, Any]) -> int:
    """spec.coldStart.keepResident's budget in bytes; 0 when not enabled."""
    if not kr.get("enabled"):
        return 0
    size = to_bytes(kr.get("maxSize", 0))
    if size < 2**20:
        raise SpecError(
            "spec.coldStart.keepResident.enabled needs a maxSize of at least 1Mi (such as "
            "4Gi): the most of the newest checkpoint each pod keeps locked in the page cache"
        )
    return size


def _validate_keep_resident(s: IsvcSpec) -> None:
    """Locked page cache is charged to the pod's memory and cannot be reclaimed."""
    if s.keep_resident_bytes and s.keep_resident_bytes >= to_bytes(s.memory):
        raise SpecError(
            f"spec.coldStart.keepResident.maxSize ({s.keep_resident_bytes // 2**20}Mi) is not "
            f"below spec.resources.memory ({s.memory}): the locked checkpoint counts against "
            "the pod's memory limit beside vLLM itself; lower maxSize or raise the memory"
        )


def _kv_store(store: Mapping[str, Any]) -> KvStore:
    pvc = store.get("pvc") or {}
    hp = store.get("hostPath") or {}
    if bool(pvc) == bool(hp):
        raise SpecError(
            "spec.kvCache.sharedStore takes exactly one of pvc {claimName} (an existing "
            "claim, ReadWriteMany for pods on several nodes) or hostPath {path}"
        )
    if pvc and not pvc.get("claimName"):
        raise SpecError("spec.kvCache.sharedStore.pvc.claimName is required: an existing PVC")
    path = str(hp.get("path", "")) if hp else None
    if path is not None and (not path.startswith("/") or ".." in path.split("/")):
        raise SpecError(
            f"spec.kvCache.sharedStore.hostPath.path is {path!r}: use an absolute node path "
            "without '..'"
        )
    return KvStore(claim_name=str(pvc["claimName"]) if pvc else None, host_path=path)


def _validate_kv_cache(s: IsvcSpec) -> None:
    """What vLLM's KV offload runs on, and who configures its KV connector."""
    if s.kv_offload_bytes < 0:
        raise SpecError("spec.kvCache.cpuOffloadSize must be a non-negative quantity such as 8Gi")
    if s.kv_offload_bytes and s.device == "cpu":
        raise SpecError(
            "spec.kvCache.cpuOffloadSize needs spec.runtime.device gpu: vLLM's CPU build has "
            "no KV offload (its offload worker runs on CUDA and XPU only) and its KV cache "
            "already lives in host memory; set cpuOffloadSize to 0 (or remove it) on CPU"
        )
    if s.kv_store and (s.device == "cpu" or not s.kv_offload_bytes):
        raise SpecError(
            "spec.kvCache.sharedStore needs spec.runtime.device gpu and a spec.kvCache."
            "cpuOffloadSize above 0: vLLM moves KV blocks to the store through its CPU "
            "offload, which its CPU build does not have"
        )
    if s.kv_offload_bytes or s.kv_store:
        for arg in s.vllm_args:
            if arg.split("=", 1)[0] == "--kv-transfer-config":
                raise SpecError(
                    "spec.vllmArgs sets --kv-transfer-config, which spec.kvCache.cpuOffloadSize "
                    "and spec.kvCache.sharedStore configure: remove one or the other"
                )


def validate(s: IsvcSpec) -> None:
    """The CRD's CEL checks again, for specs that did not come through the apiserver."""
    if s.replicas < 0:
        raise SpecError(f"spec.replicas is {s.replicas}: use 0 or more")
    if s.tensor_parallel_size < 1:
        raise SpecError("spec.tensorParallelSize must be 1 or more")
    if s.device not in ("cpu", "gpu"):
        raise SpecError(f"spec.runtime.device is {s.device!r}: use 'cpu' or 'gpu'")
    tp = s.tensor_parallel_size
    if s.device == "gpu" and s.gpus < tp:
        raise SpecError(
            f"spec.resources.gpu.count ({s.gpus}) is below spec.tensorParallelSize ({tp}): "
            f"each tensor-parallel rank needs a GPU; set spec.resources.gpu.count (or the "
            f"older spec.resources.gpus) to at least {tp}, or lower spec.tensorParallelSize"
        )
    if s.device == "cpu" and s.gpus:
        raise SpecError(
            f"spec.resources.gpu.count is {s.gpus} but spec.runtime.device is cpu: set "
            "spec.runtime.device to gpu, or remove the GPU request"
        )
    for arg in s.vllm_args:
        flag = managed_flag(arg)
        if flag is not None:
            given = arg.split("=", 1)[0]
            spelled = "" if given == flag else f" (as {given}: vLLM reads it as {flag})"
            if flag == "--config":
                raise SpecError(
                    f"spec.vllmArgs passes {flag}{spelled}: a file of vLLM flags could set "
                    "those the operator manages; put the file's flags in spec.vllmArgs instead"
                )
            raise SpecError(
                f"spec.vllmArgs sets {flag}{spelled}, which the operator manages: "
                "use spec.model, spec.multimodal, spec.kvCache, spec.lora or "
                "spec.tensorParallelSize instead"
            )
    for name in (e.name for e in s.env):
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
    _validate_kv_cache(s)
    _validate_keep_resident(s)
    _validate_rollout(s)
    _validate_lora(s)
    if s.storage.type not in ("pvc", "hostPath", "node"):
        raise SpecError(
            f"spec.coldStart.storage.type is {s.storage.type!r}: use 'pvc', 'hostPath' or 'node'"
        )
    if s.storage.access_mode not in ("ReadWriteOnce", "ReadWriteMany"):
        raise SpecError(
            f"spec.coldStart.storage.pvc.accessMode is {s.storage.access_mode!r}: use "
            "ReadWriteMany (replicas on several nodes) or ReadWriteOnce (one node)"
        )
    if s.storage.publish not in ("none", "pvc", "objectStore"):
        raise SpecError(
            f"spec.coldStart.storage.node.publish is {s.storage.publish!r}: use 'none', 'pvc' "
            "or 'objectStore'"
        )
    if s.storage.publish != "none" and s.storage.type != "node":
        raise SpecError(
            "spec.coldStart.storage.node.publish needs spec.coldStart.storage.type: node "
            "(the node agent publishes); with type pvc the checkpoints are on the claim already"
        )
    if s.storage.type == "hostPath" and not s.storage.host_path.startswith("/"):
        raise SpecError("spec.coldStart.storage.hostPath.path must be an absolute path")
    if not 1 <= s.auto_keep <= 20:
        raise SpecError(
            f"spec.coldStart.checkpoint.keep is {s.auto_keep}: keep between 1 and 20 checkpoints"
        )
    if s.restore_policy not in ("IfAvailable", "Never"):
        raise SpecError(
            f"spec.coldStart.restorePolicy is {s.restore_policy!r}: use IfAvailable or Never"
        )
