"""Names inside a Rekindle pod: env vars, mount paths, files the agent expects."""

from __future__ import annotations

# The agent's bearer token: a Secret key mounted read-only at TOKEN_FILE.
TOKEN_DIR = "/var/run/rekindle"
TOKEN_KEY = "token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
TOKEN_ENV = "REKINDLE_AGENT_TOKEN_FILE"

# Which CRIU binary the agent runs (the runtime image sets it to the patched one).
CRIU_ENV = "REKINDLE_CRIU"

# The checkpoint a new pod restores from: an env var filled from a ConfigMap
# key, so pointing new replicas at a newer checkpoint does not roll the
# running ones (env is resolved at container start). Empty: boot normally.
CHECKPOINT_ENV = "REKINDLE_CHECKPOINT"
CHECKPOINT_MOUNT = "/var/lib/rekindle/checkpoints"

# vLLM's log and TMPDIR: the same path in every pod, so a restored tree finds
# its sockets and temp files where it left them.
RUN_DIR = "/tmp/rekindle-agent"

# A restored process tree keeps its sockets; a new pod has a new IP. vLLM's
# workers must therefore bind only to loopback (single-pod TP): gloo (CPU) and
# NCCL bootstrap pick the address of the pod's hostname otherwise, and the
# restore fails with "Can't bind inet socket: Cannot assign requested address".
LOOPBACK_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}
