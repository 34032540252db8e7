"""The spec fingerprint: which InferenceService settings a checkpoint depends on.

A checkpoint is a frozen vLLM process: it is only valid for the same image,
model, parallelism and vLLM flags. Replicas, resources, /dev/shm size and the
cold-start settings do not change the process image, so they are left out
(scaling or resizing must not invalidate checkpoints).
"""

from __future__ import annotations

import hashlib
import json

from rekindle_operator.spec import IsvcSpec


def spec_fingerprint(spec: IsvcSpec) -> str:
    """sha256 (first 16 hex) of the settings that shape the vLLM process."""
    relevant = {
        "image": spec.image,
        "model": spec.model_source,
        "served": spec.served_name,
        "device": spec.device,
        "tp": spec.tensor_parallel_size,
        "maxModelLen": spec.max_model_len,
        "vllmArgs": list(spec.vllm_args),
        "env": sorted(spec.env),
        "mm": [spec.mm_shm_cache, spec.mm_cache_bytes, spec.mm_max_object_mib],
        "kv": [spec.prefix_caching, spec.kv_offload_bytes],
    }
    blob = json.dumps(relevant, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
