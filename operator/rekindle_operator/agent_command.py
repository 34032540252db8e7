"""Everything the operator assumes about the in-pod agent, in one place.

The agent's own contract module (rekindle_contract.api, stdlib-only) provides the
ports, paths, the manifest type and the client; this module adds how the
operator turns an InferenceService into the agent's command line (flags from
rekindle_agent/config.py and docs/agent.md). If the agent's flags change, this
is the one file to adapt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from rekindle_contract import api
from rekindle_contract.api import AgentClient, AgentError, Manifest, StatusReply

from rekindle_operator.quantity import gib_float
from rekindle_operator.spec import IsvcSpec

__all__ = [
    "ADMIN_PORT",
    "CHECKPOINT_ENV",
    "CHECKPOINT_MOUNT",
    "SERVE_PORT",
    "TOKEN_MOUNT_DIR",
    "AgentClient",
    "AgentError",
    "Manifest",
    "StatusReply",
    "agent_command",
    "manifest_summary",
]

SERVE_PORT = api.SERVE_PORT
ADMIN_PORT = api.ADMIN_PORT
PATH_HEALTHZ = api.PATH_HEALTHZ
PATH_READYZ = api.PATH_READYZ
TOKEN_MOUNT_DIR = api.DEFAULT_TOKEN_FILE.rsplit("/", 1)[0]
TOKEN_KEY = api.DEFAULT_TOKEN_FILE.rsplit("/", 1)[1]
CHECKPOINT_MOUNT = "/var/lib/rekindle/checkpoints"
# The checkpoint a new pod restores from: an env var filled from a ConfigMap
# key, so pointing new replicas at a newer checkpoint does not roll the
# running ones (env is resolved at container start). Empty: boot normally.
CHECKPOINT_ENV = "REKINDLE_CHECKPOINT"
# The runtime images put the agent on PYTHONPATH (not installed): run it as a module.
AGENT_ENTRYPOINT = ("python", "-m", "rekindle_dev.cli", "agent")
# A restored process tree keeps its sockets; a new pod has a new IP. vLLM's
# workers must therefore bind only to loopback (single-pod TP): gloo (CPU) and
# NCCL bootstrap pick the address of the pod's hostname otherwise, and the
# restore fails with "Can't bind inet socket: Cannot assign requested address".
POD_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}

_RESTORE_POLICY = {"IfAvailable": "if-present", "Never": "never"}


def vllm_args(spec: IsvcSpec) -> list[str]:
    """The vLLM flags the agent passes through (after `--`): shm cache, KV, user extras."""
    out: list[str] = []
    if spec.tensor_parallel_size > 1:
        out += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.mm_shm_cache:
        out += [
            "--mm-processor-cache-type",
            "shm",
            "--mm-processor-cache-gb",
            f"{gib_float(spec.mm_cache_bytes):g}",
            "--mm-shm-cache-max-object-size-mb",
            str(spec.mm_max_object_mib),
        ]
    if not spec.prefix_caching:
        out.append("--no-enable-prefix-caching")
    if spec.kv_offload_bytes:
        out += [
            "--kv-offloading-backend",
            "native",
            "--kv-offloading-size",
            f"{gib_float(spec.kv_offload_bytes):g}",
        ]
    return out + list(spec.vllm_args)


def agent_command(spec: IsvcSpec) -> list[str]:
    """The container's argv: the agent as PID 1, vLLM's flags after `--`.

    The agent adds --host/--port, --enforce-eager (CPU) or --enable-sleep-mode
    (GPU), the dev endpoints (VLLM_SERVER_DEV_MODE=1) and Rekindle's worker
    extension itself (rekindle_agent/vllm_server.py), so those are not here.
    """
    cmd = [
        *AGENT_ENTRYPOINT,
        "--model",
        spec.model_source,
        "--served-name",
        spec.served_name,
        "--device",
        "cpu" if spec.device == "cpu" else "cuda",
        "--serve-port",
        str(SERVE_PORT),
        "--admin-port",
        str(ADMIN_PORT),
        "--token-file",
        api.DEFAULT_TOKEN_FILE,
        "--checkpoint-root",
        CHECKPOINT_MOUNT,
        # Kubernetes expands $(VAR) from the container's env at start.
        "--checkpoint",
        f"$({CHECKPOINT_ENV})",
        "--restore-policy",
        _RESTORE_POLICY[spec.restore_policy],
        "--prefetch" if spec.prefetch else "--no-prefetch",
    ]
    if spec.max_model_len:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    return [*cmd, "--", *vllm_args(spec)]


def manifest_summary(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What a Checkpoint's status records from the agent's manifest."""
    files = manifest.get("files") or []
    size = sum(int(f.get("size", 0)) for f in files)
    timings = {k: round(float(v), 3) for k, v in (manifest.get("timings") or {}).items()}
    verified = manifest.get("verified") or {}
    return {
        "sizeBytes": size,
        "files": len(files),
        "phaseSeconds": timings,
        "agentFingerprint": _fingerprint_digest(manifest.get("fingerprint") or {}),
        "verified": bool(verified),
    }


def _fingerprint_digest(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
