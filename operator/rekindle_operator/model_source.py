"""spec.model: where the weights come from, and the pod parts that bring them in.

Five kinds, exactly one per InferenceService (the CRD's CEL says the same):

- ``source``: a directory inside the runtime image (or a model id vLLM
  resolves itself); nothing is mounted. Manifests written before the other
  kinds existed keep meaning what they meant.
- ``pvc``: a PersistentVolumeClaim (optionally a ``subPath`` of it), mounted
  read-only at rekindle_contract.model_cache.MODEL_MOUNT.
- ``hostPath``: a directory on the node, mounted read-only at the same place.
- ``huggingFace``: a hub id and ``revision``; an init container
  (``rekindle fetch-model``, the runtime image) downloads it into a cache
  volume shared by the replicas on a node (a hostPath directory by default,
  or a PVC), keyed by id and revision, before the agent starts. The token
  comes from a Secret through secretKeyRef and reaches only that container.
- ``s3``: every object below a prefix of a bucket of an S3-compatible store
  (the source KServe users know as ``storageUri: s3://``); the same init
  container, with parallel ranged reads, into the same kind of cache, keyed
  by endpoint, bucket and prefix. The keys come from a Secret the same way.

Mount details (claim, node path, cache volume) are not part of a
checkpoint's identity: model_identity() names the weights, and the agent's
content digest of the model directory catches different bytes behind the
same mount.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rekindle_contract.model_cache import (
    DEFAULT_REVISION,
    MODEL_CACHE_MOUNT,
    MODEL_MOUNT,
    model_path,
    s3_model_path,
    valid_repo_id,
    valid_revision,
)

from rekindle_operator.spec_error import SpecError

Obj = dict[str, Any]

DEFAULT_CACHE_HOST_PATH = "/var/lib/rekindle/model-cache"
DEFAULT_TOKEN_KEY = "HF_TOKEN"
FETCH_CONTAINER = "fetch-model"
MODEL_VOLUME = "model"
CACHE_VOLUME = "model-cache"
KINDS = ("source", "pvc", "hostPath", "huggingFace", "s3")
# The keys of spec.model.s3.secretRef's Secret (the node agent's store Secret uses the same).
S3_KEY_ID, S3_SECRET_KEY = "accessKeyID", "secretAccessKey"
_DNS = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


@dataclass(frozen=True)
class ModelSource:
    """One spec.model, parsed. kind is one of KINDS; only its own fields are set."""

    kind: str = "source"
    source: str = ""  # kind source: the directory in the image (or a model id)
    claim_name: str = ""  # kind pvc
    sub_path: str = ""  # kind pvc
    host_path: str = ""  # kind hostPath
    hf_id: str = ""  # kind huggingFace
    revision: str = DEFAULT_REVISION  # kind huggingFace
    # (Secret name, key) of the hub token; None: anonymous (public models).
    token_secret: tuple[str, str] | None = None
    endpoint: str = ""  # the hub's URL (HF_ENDPOINT); "" = the client's default
    cache_host_path: str = DEFAULT_CACHE_HOST_PATH  # the cache on each node...
    cache_claim: str = ""  # ...or this PVC instead
    bucket: str = ""  # kind s3 (with endpoint)
    prefix: str = ""  # kind s3
    region: str = "us-east-1"  # kind s3
    s3_secret: str = ""  # kind s3: the Secret with S3_KEY_ID and S3_SECRET_KEY

    @property
    def fetched(self) -> bool:
        """Downloaded into the cache by the init container (huggingFace, s3)."""
        return self.kind in ("huggingFace", "s3")

    @property
    def path(self) -> str:
        """Where vLLM loads the model from inside the container (the agent's --model)."""
        if self.kind == "source":
            return self.source
        if self.kind == "huggingFace":
            return model_path(self.hf_id, self.revision)
        if self.kind == "s3":
            return s3_model_path(self.endpoint, self.bucket, self.prefix)
        return MODEL_MOUNT


def _obj(d: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    v = d.get(key) or {}
    if not isinstance(v, Mapping):
        raise SpecError(f"{where}.{key} must be an object")
    return v


def parse_model(model: Mapping[str, Any]) -> ModelSource:
    """spec.model as a ModelSource; raises SpecError saying what to change."""
    kinds = [k for k in KINDS if model.get(k)]
    if len(kinds) != 1:
        raise SpecError(
            "spec.model needs exactly one of spec.model.source (a directory in the image), "
            ".pvc, .hostPath, .huggingFace or .s3; "
            + (f"it has {', '.join(kinds)}: keep one" if kinds else "it has none: set one")
        )
    kind = kinds[0]
    if model.get("revision") and kind != "huggingFace":
        raise SpecError(
            "spec.model.revision pins a Hugging Face revision: remove it, or use "
            "spec.model.huggingFace (a PVC, node path or image directory has no revision)"
        )
    if kind == "source":
        return ModelSource(source=str(model["source"]))
    if kind == "pvc":
        return _pvc(_obj(model, "pvc", "spec.model"))
    if kind == "hostPath":
        return _host_path(_obj(model, "hostPath", "spec.model"))
    if kind == "s3":
        return _s3(_obj(model, "s3", "spec.model"))
    return _hugging_face(
        _obj(model, "huggingFace", "spec.model"), str(model.get("revision") or DEFAULT_REVISION)
    )


def _pvc(pvc: Mapping[str, Any]) -> ModelSource:
    claim = str(pvc.get("claimName") or "")
    if not claim:
        raise SpecError("spec.model.pvc.claimName is required: the PVC that holds the model")
    sub = str(pvc.get("subPath") or "")
    if sub.startswith("/") or ".." in sub.split("/"):
        raise SpecError(
            f"spec.model.pvc.subPath {sub!r} must be relative to the volume's root, "
            "without '..' (e.g. models/tiny)"
        )
    return ModelSource(kind="pvc", claim_name=claim, sub_path=sub)


def _host_path(hp: Mapping[str, Any]) -> ModelSource:
    path = str(hp.get("path") or "")
    if not path.startswith("/") or ".." in path.split("/"):
        raise SpecError(
            f"spec.model.hostPath.path {path!r} must be an absolute node path without '..'"
        )
    return ModelSource(kind="hostPath", host_path=path)


def _hugging_face(hf: Mapping[str, Any], revision: str) -> ModelSource:
    repo = str(hf.get("id") or "")
    if not valid_repo_id(repo):
        raise SpecError(
            f"spec.model.huggingFace.id {repo!r} is not a hub model id: use ORG/NAME "
            "(letters, digits, '.', '_', '-'; no '--' or '..')"
        )
    if not valid_revision(revision):
        raise SpecError(
            f"spec.model.revision {revision!r} is not a branch, tag or commit: "
            "use e.g. main, v1.0 or a 40-hex commit id"
        )
    token = _obj(hf, "tokenSecretRef", "spec.model.huggingFace")
    if token and not token.get("name"):
        raise SpecError(
            "spec.model.huggingFace.tokenSecretRef.name is required: the Secret "
            "holding the hub token"
        )
    endpoint = str(hf.get("endpoint") or "")
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise SpecError(
            f"spec.model.huggingFace.endpoint {endpoint!r} must be an http:// or https:// URL"
        )
    cache_path, cache_claim = _cache(_obj(hf, "cache", "spec.model.huggingFace"), "huggingFace")
    return ModelSource(
        kind="huggingFace",
        hf_id=repo,
        revision=revision,
        token_secret=(
            (str(token["name"]), str(token.get("key") or DEFAULT_TOKEN_KEY)) if token else None
        ),
        endpoint=endpoint,
        cache_host_path=cache_path,
        cache_claim=cache_claim,
    )


def _cache(cache: Mapping[str, Any], kind: str) -> tuple[str, str]:
    """(node directory, claim) of spec.model.KIND.cache; the claim "" when on the node."""
    where = f"spec.model.{kind}.cache"
    cache_hp = _obj(cache, "hostPath", where)
    cache_pvc = _obj(cache, "pvc", where)
    if cache_hp and cache_pvc:
        raise SpecError(f"{where} takes hostPath or pvc, not both: keep one")
    cache_path = str(cache_hp.get("path") or DEFAULT_CACHE_HOST_PATH)
    if not cache_path.startswith("/") or ".." in cache_path.split("/"):
        raise SpecError(
            f"{where}.hostPath.path {cache_path!r} must be an absolute node path without '..'"
        )
    if cache_pvc and not cache_pvc.get("claimName"):
        raise SpecError(f"{where}.pvc.claimName is required: the PVC to cache models in")
    return cache_path, str(cache_pvc.get("claimName") or "")


def _s3(s3: Mapping[str, Any]) -> ModelSource:
    endpoint = str(s3.get("endpoint") or "").rstrip("/")
    if not re.fullmatch(r"https?://[^/]+", endpoint):
        raise SpecError(
            f"spec.model.s3.endpoint {endpoint!r} must be http(s)://HOST[:PORT] "
            "(the bucket and prefix go in their own fields)"
        )
    bucket = str(s3.get("bucket") or "")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise SpecError(f"spec.model.s3.bucket {bucket!r} is not a bucket name")
    prefix = str(s3.get("prefix") or "")
    if not prefix or prefix.startswith("/") or ".." in prefix.split("/"):
        raise SpecError(
            f"spec.model.s3.prefix {prefix!r} must be the model's key prefix in the bucket, "
            "relative, without '..' (e.g. models/smollm2/)"
        )
    secret = _obj(s3, "secretRef", "spec.model.s3")
    if not secret.get("name"):
        raise SpecError(
            "spec.model.s3.secretRef.name is required: the Secret with the store's "
            f"{S3_KEY_ID} and {S3_SECRET_KEY}"
        )
    cache_path, cache_claim = _cache(_obj(s3, "cache", "spec.model.s3"), "s3")
    return ModelSource(
        kind="s3",
        endpoint=endpoint,
        bucket=bucket,
        prefix=prefix.rstrip("/") + "/",
        region=str(s3.get("region") or "us-east-1"),
        s3_secret=str(secret["name"]),
        cache_host_path=cache_path,
        cache_claim=cache_claim,
    )


def model_identity(src: ModelSource) -> Any:
    """What names the weights, for the spec fingerprint; never a mount detail.

    An image directory keeps today's value (its path), so existing
    checkpoints stay valid. A PVC or a node path is the same mount point
    whichever claim or directory backs it: the agent compares a content
    digest of the model directory before restoring, which is what tells two
    volumes apart. A hub model is its id and revision.
    """
    if src.kind == "source":
        return src.source
    if src.kind == "huggingFace":
        return {"huggingFace": src.hf_id, "revision": src.revision}
    if src.kind == "s3":
        return {"s3": f"{src.endpoint}/{src.bucket}/{src.prefix}"}
    return {"volume": MODEL_MOUNT}


def model_volumes(src: ModelSource) -> list[Obj]:
    """The pod's volumes for the model (none for an image directory)."""
    if src.kind == "pvc":
        return [
            {
                "name": MODEL_VOLUME,
                "persistentVolumeClaim": {"claimName": src.claim_name, "readOnly": True},
            }
        ]
    if src.kind == "hostPath":
        # Directory, not DirectoryOrCreate: a missing model is an error the pod shows.
        return [{"name": MODEL_VOLUME, "hostPath": {"path": src.host_path, "type": "Directory"}}]
    if src.fetched:
        if src.cache_claim:
            return [{"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": src.cache_claim}}]
        return [
            {
                "name": CACHE_VOLUME,
                "hostPath": {"path": src.cache_host_path, "type": "DirectoryOrCreate"},
            }
        ]
    return []


def model_mounts(src: ModelSource) -> list[Obj]:
    """The serving container's mounts for the model: always read-only."""
    if src.kind in ("pvc", "hostPath"):
        mount: Obj = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}
        if src.sub_path:
            mount["subPath"] = src.sub_path
        return [mount]
    if src.fetched:
        return [{"name": CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT, "readOnly": True}]
    return []


def fetch_init_container(src: ModelSource, image: str, pull_policy: str) -> Obj | None:
    """The init container that fills the cache before the agent starts (hub and S3
    models only).

    It runs the runtime image's `rekindle fetch-model`, unprivileged, with the
    token as HF_TOKEN (S3: the keys as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)
    from the Secret (secretKeyRef: the value never passes through the operator or
    the pod spec). A revision (a listing) already in the cache costs one lookup;
    replicas on a node share one download (a lock).
    """
    if src.kind == "s3":
        return _fetch_container(
            image,
            pull_policy,
            [
                "--s3-endpoint",
                src.endpoint,
                "--s3-bucket",
                src.bucket,
                "--s3-prefix",
                src.prefix,
                "--s3-region",
                src.region,
            ],
            [
                {"name": env, "valueFrom": {"secretKeyRef": {"name": src.s3_secret, "key": key}}}
                for env, key in (
                    ("AWS_ACCESS_KEY_ID", S3_KEY_ID),
                    ("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY),
                )
            ],
        )
    if src.kind != "huggingFace":
        return None
    env: list[Obj] = [
        # The hub client's own files (token cache, telemetry state) go to a scratch dir.
        {"name": "HF_HOME", "value": "/tmp/hf-home"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if src.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": src.endpoint})
    if src.token_secret:
        name, key = src.token_secret
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    return _fetch_container(
        image, pull_policy, ["--id", src.hf_id, "--revision", src.revision], env
    )


def _fetch_container(image: str, pull_policy: str, args: list[str], env: list[Obj]) -> Obj:
    return {
        "name": FETCH_CONTAINER,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["rekindle", "fetch-model", *args, "--cache", MODEL_CACHE_MOUNT],
        "env": env,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT}],
    }
