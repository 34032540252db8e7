"""The pod's container command: an InferenceService spec as the agent's arguments.

The agent's flags are declared once, in rekindle_contract.agent_args; this
module only maps spec fields onto them. vLLM features (tensor parallel, the
shared-memory multimodal cache, prefix caching, KV offload, LoRA) are agent
settings, and the agent turns them into vLLM flags (rekindle_contract.vllm_argv),
so the operator never writes a vLLM flag itself; the user's spec.vllmArgs pass
through after `--`.
"""

from __future__ import annotations

from rekindle_contract import lora
from rekindle_contract.agent_args import CUDA_PLUGIN_DIR, AgentArgs, agent_argv
from rekindle_contract.pod import CHECKPOINT_MOUNT

from rekindle_operator import admin_tls
from rekindle_operator.quantity import gib_float
from rekindle_operator.spec import IsvcSpec

# Where spec.kvCache.sharedStore's volume is mounted in the pod (the same in every pod).
KV_STORE_MOUNT = "/var/lib/rekindle/kv-store"


def agent_args(spec: IsvcSpec) -> AgentArgs:
    """The agent's settings for spec; ports, token file and run dir keep the contract's defaults."""
    return AgentArgs(
        model=spec.model_source,
        served_name=spec.served_name,
        device="cpu" if spec.device == "cpu" else "cuda",
        max_model_len=spec.max_model_len,
        tensor_parallel_size=spec.tensor_parallel_size,
        mm_shm_cache_gb=gib_float(spec.mm_cache_bytes) if spec.mm_shm_cache else None,
        mm_shm_max_object_mb=spec.mm_max_object_mib if spec.mm_shm_cache else None,
        prefix_caching=spec.prefix_caching,
        kv_offload_gb=gib_float(spec.kv_offload_bytes) if spec.kv_offload_bytes else None,
        kv_store_dir=KV_STORE_MOUNT if spec.kv_store else None,
        checkpoint_root=CHECKPOINT_MOUNT,
        # The checkpoint to restore from comes by env from the restore pointer
        # (CHECKPOINT_ENV, with its signature), never through argv: a value that
        # starts with "-" would be read as a flag.
        # spec.coldStart.restorePolicy reaches pods through the restore pointer alone
        # (blank for Never, builders.build_configmap), not through argv: switching it
        # applies to pods started from then on and restarts no serving replica.
        prefetch=spec.prefetch,
        keep_resident_mb=spec.keep_resident_bytes >> 20,
        # CRIU's CUDA plugin is only loaded from a directory given with -L: without
        # it a GPU dump meets /dev/nvidia* and fails (docs/gpu.md).
        criu_plugins=CUDA_PLUGIN_DIR if spec.device != "cpu" else None,
        # Flags rather than env (unlike the token and key files): an agent too old
        # to know them stops with a usage error instead of serving plain HTTP.
        admin_tls_cert=admin_tls.CERT_FILE if spec.admin_tls else None,
        admin_tls_key=admin_tls.KEY_FILE if spec.admin_tls else None,
        # The node agent's socket comes by env (builders); publishing by flag, so an
        # agent too old to know it stops with a usage error instead of not publishing.
        node_publish=spec.storage.publish == "pvc",
        node_store=spec.storage.publish == "objectStore",
        allowed_media_domains=",".join(spec.mm_allowed_media_domains) or None,
        media_redirects=spec.mm_media_redirects,
        shutdown_drain=shutdown_drain(spec.termination_grace_s),
        proxy_max_concurrency=spec.max_concurrent_requests,
        lora_max_adapters=spec.lora.max_adapters if spec.lora else 0,
        lora_max_rank=spec.lora.max_rank if spec.lora else 16,
        lora_adapters=(
            lora.format_adapters(list(spec.lora.adapters))
            if spec.lora and spec.lora.adapters
            else None
        ),
        vllm_args=list(spec.vllm_args),
    )


def shutdown_drain(grace_s: int) -> float:
    """Seconds the agent lets requests in flight finish after SIGTERM: the pod's grace,
    less a margin (5 s, or a fifth of a short grace) to kill vLLM's tree and exit before
    the kubelet's SIGKILL."""
    return grace_s - min(5.0, grace_s / 5)


def agent_command(spec: IsvcSpec) -> list[str]:
    """The container's argv: the agent as PID 1, the user's vLLM flags after `--`."""
    return agent_argv(agent_args(spec))
