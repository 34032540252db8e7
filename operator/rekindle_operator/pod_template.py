"""What a user may add to the vLLM pods: placement, identity, env, volumes, GPUs.

spec.podTemplate follows NVIDIA Dynamo's `extraPodSpec` in spirit: the user
gives pod-level settings the operator does not own (where the pod runs, who it
runs as, extra volumes), and the operator merges them into the pod it builds.
Unlike extraPodSpec it is a closed list: the fields the operator owns (the
container's command, its securityContext, the /dev/shm volume, the token and
checkpoint mounts) are not in the schema, so the apiserver refuses them at
apply, and volumes or mount paths that collide with the operator's are refused
by CEL (the same lists are here, checked again for specs that did not come
through the apiserver).

spec.env takes full Kubernetes EnvVars (value, or valueFrom a Secret,
ConfigMap, field or resource) and spec.envFrom whole Secrets or ConfigMaps:
the operator passes the references on, and never reads a referenced value,
so a secret never reaches the spec fingerprint, status, Events or its log.

Everything is kept as canonical JSON strings inside frozen dataclasses, so an
IsvcSpec stays an immutable value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rekindle_contract.model_cache import MODEL_CACHE_MOUNT, MODEL_MOUNT
from rekindle_contract.pod import API_KEY_DIR, CHECKPOINT_MOUNT, TOKEN_DIR

from rekindle_operator.spec_error import SpecError

Obj = dict[str, Any]

DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
# An extended resource name: a DNS domain with at least one dot, a slash, a name
# (nvidia.com/gpu, nvidia.com/mig-1g.10gb, amd.com/gpu, gpu.intel.com/i915).
GPU_RESOURCE_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)

# Pod-level fields spec.podTemplate.spec may set (the rest of a PodSpec is the operator's).
POD_FIELDS = (
    "nodeSelector",
    "tolerations",
    "affinity",
    "topologySpreadConstraints",
    "runtimeClassName",
    "priorityClassName",
    "schedulerName",
    "serviceAccountName",
    "imagePullSecrets",
    "volumes",
)
# Volumes the operator puts in every pod (a unit test checks the builders against
# this list, and the CRD's rule against it).
RESERVED_VOLUMES = (
    "dshm",
    "agent-token",
    "checkpoints",
    "api-key",
    "admin-tls",
    "model",
    "model-cache",
)
# Paths the operator mounts in the container: a user mount at or below one of
# these would hide or replace what the agent relies on.
RESERVED_MOUNT_PATHS = (
    "/dev/shm",
    TOKEN_DIR,
    API_KEY_DIR,
    "/var/run/rekindle-admin-tls",
    CHECKPOINT_MOUNT,
    MODEL_MOUNT,
    MODEL_CACHE_MOUNT,
)
VALUE_FROM_KINDS = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")
ENV_FROM_KINDS = ("secretRef", "configMapRef")


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class EnvVar:
    """One spec.env entry: a literal value, or a reference resolved by the kubelet."""

    name: str
    value: str | None = None
    value_from: str = ""  # canonical JSON of valueFrom; "" for a literal value

    def manifest(self) -> Obj:
        """The container's EnvVar."""
        if self.value_from:
            return {"name": self.name, "valueFrom": json.loads(self.value_from)}
        return {"name": self.name, "value": self.value or ""}

    def identity(self) -> list[Any]:
        """What the spec fingerprint records: the literal value the user wrote in the spec,
        or the reference (Secret/ConfigMap name and key), never what it resolves to."""
        if self.value_from:
            return [self.name, json.loads(self.value_from)]
        return [self.name, self.value or ""]


@dataclass(frozen=True)
class PodTemplate:
    """spec.podTemplate: extra pod labels/annotations, pod-level fields, extra mounts."""

    labels: tuple[tuple[str, str], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    spec_json: str = "{}"  # the POD_FIELDS the user set, canonical JSON
    volume_mounts_json: str = "[]"  # spec.podTemplate.spec.mainContainer.volumeMounts

    @property
    def spec(self) -> Obj:
        out: Obj = json.loads(self.spec_json)
        return out

    @property
    def volume_mounts(self) -> list[Obj]:
        out: list[Obj] = json.loads(self.volume_mounts_json)
        return out

    @property
    def runtime_class(self) -> str | None:
        value = self.spec.get("runtimeClassName")
        return str(value) if value else None


@dataclass(frozen=True)
class Gpu:
    """spec.resources.gpu: how many of which extended resource the container gets."""

    count: int = 0
    resource_name: str = DEFAULT_GPU_RESOURCE


@dataclass(frozen=True)
class PodExtras:
    """Everything this module parses out of an InferenceService spec."""

    env: tuple[EnvVar, ...] = ()
    env_from: tuple[str, ...] = ()  # canonical JSON of each envFrom source
    template: PodTemplate = field(default_factory=PodTemplate)
    gpu: Gpu = field(default_factory=Gpu)


def _obj(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where} must be an object")
    return value


def _list(value: Any, where: str) -> Sequence[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(f"{where} must be a list")
    return value


def _strings(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in _obj(value, where).items()))


def parse_env(items: Any) -> tuple[EnvVar, ...]:
    """spec.env: each item a literal value or exactly one valueFrom reference."""
    out = []
    for i, e in enumerate(_list(items, "spec.env")):
        e = _obj(e, f"spec.env[{i}]")
        name = str(e.get("name") or "")
        if not name:
            raise SpecError(f"spec.env[{i}] has no name: every variable needs one")
        if "valueFrom" in e and e["valueFrom"] is not None:
            if "value" in e and e["value"] is not None:
                raise SpecError(f"spec.env {name} sets both value and valueFrom: keep one of them")
            ref = _obj(e["valueFrom"], f"spec.env {name}.valueFrom")
            kinds = [k for k in VALUE_FROM_KINDS if ref.get(k)]
            if len(kinds) != 1 or set(ref) - set(VALUE_FROM_KINDS):
                raise SpecError(
                    f"spec.env {name}.valueFrom must hold exactly one of "
                    f"{', '.join(VALUE_FROM_KINDS)}"
                )
            out.append(EnvVar(name, None, _canon({kinds[0]: ref[kinds[0]]})))
        else:
            out.append(EnvVar(name, str(e.get("value") or "")))
    return tuple(out)


def parse_env_from(items: Any) -> tuple[str, ...]:
    """spec.envFrom: each item names exactly one Secret or ConfigMap (and an optional prefix)."""
    out = []
    for i, e in enumerate(_list(items, "spec.envFrom")):
        e = _obj(e, f"spec.envFrom[{i}]")
        kinds = [k for k in ENV_FROM_KINDS if e.get(k)]
        if len(kinds) != 1:
            raise SpecError(f"spec.envFrom[{i}] must name exactly one of secretRef or configMapRef")
        src: Obj = {kinds[0]: dict(e[kinds[0]])}
        if e.get("prefix"):
            src["prefix"] = str(e["prefix"])
        out.append(_canon(src))
    return tuple(out)


def parse_gpu(resources: Mapping[str, Any]) -> Gpu:
    """spec.resources.gpu {count, resourceName}; the older spec.resources.gpus is its count."""
    gpu = _obj(resources.get("gpu"), "spec.resources.gpu")
    legacy = int(resources.get("gpus") or 0)
    count = int(gpu["count"]) if gpu.get("count") is not None else legacy
    if gpu.get("count") is not None and legacy and legacy != count:
        raise SpecError(
            f"spec.resources.gpus ({legacy}) and spec.resources.gpu.count ({count}) disagree: "
            "remove spec.resources.gpus (spec.resources.gpu.count replaces it)"
        )
    name = str(gpu.get("resourceName") or DEFAULT_GPU_RESOURCE)
    if not re.match(GPU_RESOURCE_PATTERN, name) or name.split("/")[0].endswith("kubernetes.io"):
        raise SpecError(
            f"spec.resources.gpu.resourceName {name!r} is not an extended resource name: use "
            "DOMAIN/NAME as the device plugin advertises it, e.g. nvidia.com/gpu, "
            "nvidia.com/mig-1g.10gb or amd.com/gpu"
        )
    if count < 0:
        raise SpecError("spec.resources.gpu.count must be 0 or more")
    return Gpu(count, name)


def parse_pod_template(value: Any) -> PodTemplate:
    """spec.podTemplate: refuses the fields the operator owns with what to do instead."""
    tpl = _obj(value, "spec.podTemplate")
    unknown = set(tpl) - {"metadata", "spec"}
    if unknown:
        raise SpecError(f"spec.podTemplate.{sorted(unknown)[0]} is unknown: use metadata or spec")
    meta = _obj(tpl.get("metadata"), "spec.podTemplate.metadata")
    pod = dict(_obj(tpl.get("spec"), "spec.podTemplate.spec"))
    main = _obj(pod.pop("mainContainer", None), "spec.podTemplate.spec.mainContainer")
    owned = sorted(set(pod) - set(POD_FIELDS))
    if owned:
        raise SpecError(
            f"spec.podTemplate.spec.{owned[0]} is set by the operator (or not supported): "
            f"podTemplate.spec may set {', '.join(POD_FIELDS)} and mainContainer.volumeMounts"
        )
    if set(main) - {"volumeMounts"}:
        field_ = sorted(set(main) - {"volumeMounts"})[0]
        raise SpecError(
            f"spec.podTemplate.spec.mainContainer.{field_} is the operator's: only "
            "volumeMounts may be added (env: spec.env; resources: spec.resources)"
        )
    mounts = [dict(_obj(m, "a volumeMount")) for m in _list(main.get("volumeMounts"), "mounts")]
    check_volumes(_list(pod.get("volumes"), "spec.podTemplate.spec.volumes"), mounts)
    return PodTemplate(
        labels=_strings(meta.get("labels"), "spec.podTemplate.metadata.labels"),
        annotations=_strings(meta.get("annotations"), "spec.podTemplate.metadata.annotations"),
        spec_json=_canon(pod),
        volume_mounts_json=_canon(mounts),
    )


def reserved_path(path: str) -> str | None:
    """The operator's mount path that path equals or lies below (or above), else None."""
    clean = "/" + path.strip("/")
    for p in RESERVED_MOUNT_PATHS:
        if clean == p or clean.startswith(p + "/") or p.startswith(clean.rstrip("/") + "/"):
            return p
    return None


def check_volumes(volumes: Sequence[Any], mounts: Sequence[Mapping[str, Any]]) -> None:
    """The CRD's rules on extra volumes and mounts, again (names and paths the operator uses)."""
    names = set()
    for v in volumes:
        name = str(_obj(v, "a volume").get("name") or "")
        if name in RESERVED_VOLUMES:
            raise SpecError(
                f"spec.podTemplate.spec.volumes names {name!r}, a volume the operator adds: "
                f"rename it (reserved: {', '.join(RESERVED_VOLUMES)})"
            )
        names.add(name)
    for m in mounts:
        name, path = str(m.get("name") or ""), str(m.get("mountPath") or "")
        if name not in names:
            raise SpecError(
                f"spec.podTemplate.spec.mainContainer.volumeMounts mounts {name!r}, which is "
                "not in spec.podTemplate.spec.volumes: add the volume there"
            )
        hit = reserved_path(path)
        if hit is not None:
            raise SpecError(
                f"spec.podTemplate.spec.mainContainer.volumeMounts mounts {path!r}, which "
                f"collides with the operator's {hit}: mount it elsewhere"
            )


def parse_extras(spec: Mapping[str, Any], resources: Mapping[str, Any]) -> PodExtras:
    """env, envFrom, podTemplate and the GPU request of an InferenceService spec."""
    return PodExtras(
        env=parse_env(spec.get("env")),
        env_from=parse_env_from(spec.get("envFrom")),
        template=parse_pod_template(spec.get("podTemplate")),
        gpu=parse_gpu(resources),
    )


def merge_into(pod_template: Obj, container: Obj, template: PodTemplate) -> None:
    """Merge the user's podTemplate into the pod the operator built (in place).

    Labels and annotations: the operator's win (the Service's and the
    Deployment's selectors, the fingerprint and the TLS server name depend on
    them). Pod fields: the user's, which the operator never sets itself,
    except volumes, which are appended to the operator's.
    """
    meta = pod_template.setdefault("metadata", {})
    meta["labels"] = {**dict(template.labels), **meta.get("labels", {})}
    meta["annotations"] = {**dict(template.annotations), **meta.get("annotations", {})}
    pod = pod_template["spec"]
    for key, value in template.spec.items():
        if key == "volumes":
            pod["volumes"] = [*pod.get("volumes", []), *value]
        else:
            pod[key] = value
    if template.volume_mounts:
        container["volumeMounts"] = [*container.get("volumeMounts", []), *template.volume_mounts]


def env_from_manifest(env_from: Sequence[str]) -> list[Obj]:
    return [json.loads(s) for s in env_from]
