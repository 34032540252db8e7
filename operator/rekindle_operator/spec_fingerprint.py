"""The spec fingerprint: which InferenceService settings a checkpoint depends on.

A checkpoint is a frozen vLLM process: it is only valid for the same image,
model, parallelism and vLLM flags. Replicas, resources, /dev/shm size and the
cold-start settings do not change the process image, so they are left out
(scaling or resizing must not invalidate checkpoints).

The model counts by what names its weights (model_source.model_identity: the
image directory, or a hub id and revision), never by how it is mounted: a
claim or node path that changes while the weights stay the same keeps the
checkpoints usable, and the agent's content digest of the model directory
refuses a restore when the bytes behind the mount differ.
"""

from __future__ import annotations

import hashlib
import json

from rekindle_operator.model_source import model_identity
from rekindle_operator.spec import IsvcSpec


def spec_fingerprint(spec: IsvcSpec) -> str:
    """sha256 (first 16 hex) of the settings that shape the vLLM process."""
    relevant = {
        "image": spec.image,
        # An image directory is its path (the value before other sources existed).
        "model": (spec.model_source if spec.model.kind == "source" else model_identity(spec.model)),
        "served": spec.served_name,
        "device": spec.device,
        "tp": spec.tensor_parallel_size,
        "maxModelLen": spec.max_model_len,
        "vllmArgs": list(spec.vllm_args),
        # Literal values as written, references by name and key: never a resolved secret.
        "env": sorted((e.identity() for e in spec.env), key=lambda i: (i[0], json.dumps(i[1]))),
        "mm": [spec.mm_shm_cache, spec.mm_cache_bytes, spec.mm_max_object_mib],
        "kv": [spec.prefix_caching, spec.kv_offload_bytes],
    }
    if spec.kv_store:
        # vLLM runs another KV connector (and its I/O threads) with a store; which
        # volume backs it is the pod's business, like the checkpoints' storage.
        relevant["kvStore"] = True
    if spec.lora is not None:
        # vLLM's LoRA flags and the adapters it loads at start (a spec without LoRA
        # keeps the fingerprint it had before spec.lora existed).
        relevant["lora"] = [
            spec.lora.max_adapters,
            spec.lora.max_rank,
            [list(a) for a in spec.lora.adapters],
        ]
    relevant.update(process_extras(spec))
    blob = json.dumps(relevant, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def process_extras(spec: IsvcSpec) -> dict[str, object]:
    """Pod settings that change what vLLM's process sees, each only when set (a spec
    without them keeps the fingerprint it had before they existed).

    In: envFrom (the Secret/ConfigMap names, never their data), the runtime
    class (it decides which driver libraries and devices the container gets),
    the extra mounts (files the process may open), the GPU resource (a MIG
    slice is a different device than a whole GPU), the multimodal decision
    when not plainly on. Out: scheduling and identity (nodeSelector,
    tolerations, affinity, spread, priority, scheduler, service account, pull
    secrets, labels, annotations) and the volumes' sources: they move the pod,
    not the process.
    """
    out: dict[str, object] = {}
    if spec.env_from:
        out["envFrom"] = sorted(spec.env_from)
    tpl = spec.pod_template
    if tpl.runtime_class:
        out["runtimeClass"] = tpl.runtime_class
    if tpl.volume_mounts:
        out["mounts"] = sorted(
            [m.get("mountPath"), m.get("subPath", ""), bool(m.get("readOnly"))]
            for m in tpl.volume_mounts
        )
    if spec.gpus:
        out["gpuResource"] = spec.gpu_resource
    if spec.mm_enabled is not True:
        out["mmEnabled"] = spec.mm_enabled
    if spec.mm_allowed_media_domains:
        out["mediaDomains"] = list(spec.mm_allowed_media_domains)
    if spec.mm_media_redirects:
        out["mediaRedirects"] = True
    return out
