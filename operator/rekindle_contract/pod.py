"""Names inside a Rekindle pod: env vars, mount paths, files the agent expects."""

from __future__ import annotations

# The agent's bearer token: a Secret key mounted read-only at TOKEN_FILE.
TOKEN_DIR = "/var/run/rekindle"
TOKEN_KEY = "token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
TOKEN_ENV = "REKINDLE_AGENT_TOKEN_FILE"

# A second bearer token that reads GET /metrics on the admin port and nothing
# else: the one handed to Prometheus, so a scrape credential cannot trigger a
# checkpoint or read the agent's status. A Secret of its own (key TOKEN_KEY),
# mounted beside the admin token at METRICS_TOKEN_FILE.
METRICS_TOKEN_NAME = "metrics-token"
METRICS_TOKEN_FILE = f"{TOKEN_DIR}/{METRICS_TOKEN_NAME}"
METRICS_TOKEN_ENV = "REKINDLE_METRICS_TOKEN_FILE"

# The key that signs checkpoint manifests (HMAC-SHA256), one per
# InferenceService: a key of the same Secret as the token is the natural home
# (mounted at SIGNING_KEY_FILE); the agent reads it with --signing-key-file or
# SIGNING_KEY_ENV. Unset: checkpoints are unsigned (the agent says so in status).
SIGNING_KEY_KEY = "signing-key"
SIGNING_KEY_FILE = f"{TOKEN_DIR}/{SIGNING_KEY_KEY}"
SIGNING_KEY_ENV = "REKINDLE_SIGNING_KEY_FILE"

# The API key clients send on the serve port (the user's Secret), mounted at
# API_KEY_FILE; the agent reads it with --api-key-file or API_KEY_ENV.
API_KEY_DIR = "/var/run/rekindle-api-key"
API_KEY_KEY = "api-key"
API_KEY_FILE = f"{API_KEY_DIR}/{API_KEY_KEY}"
API_KEY_ENV = "REKINDLE_API_KEY_FILE"

# The runtime image's reference (the operator sets it from the container's
# image): part of a checkpoint's fingerprint, so a restore never runs a tree
# dumped from one image on top of another image's files.
IMAGE_ENV = "REKINDLE_IMAGE"

# Which CRIU binary the agent runs (the runtime image sets it to the patched one).
CRIU_ENV = "REKINDLE_CRIU"

# The checkpoint a new pod restores from: an env var filled from a ConfigMap
# key, so pointing new replicas at a newer checkpoint does not roll the
# running ones (env is resolved at container start). Empty: boot normally.
CHECKPOINT_ENV = "REKINDLE_CHECKPOINT"
# The operator's signature of that pointer (rekindle_contract.restore_pointer),
# from the same ConfigMap, and the InferenceService's UID it is bound to. A pod
# with SERVICE_UID_ENV set restores only from a pointer with a valid signature.
CHECKPOINT_SIGNATURE_ENV = "REKINDLE_CHECKPOINT_SIGNATURE"
SERVICE_UID_ENV = "REKINDLE_SERVICE_UID"
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

# The node agent's socket in a serving pod: the pod mounts an emptyDir (default
# medium) named NODE_SOCKET_VOLUME at NODE_SOCKET_DIR; the node agent, which sees
# the pod's containers through the runtime, binds NODE_SOCKET_NAME inside that
# volume. Only that pod sees it; no hostPath in the pod.
NODE_SOCKET_VOLUME = "rekindle-node"
NODE_SOCKET_DIR = "/run/rekindle-node"
NODE_SOCKET_NAME = "node.sock"
NODE_SOCKET = f"{NODE_SOCKET_DIR}/{NODE_SOCKET_NAME}"

# The node agent's socket, for the in-pod agent (set: CRIU runs in the node agent,
# checkpoints live in its cache; unset: the agent runs CRIU itself, privileged).
NODE_SOCKET_ENV = "REKINDLE_NODE_SOCKET"
# The pod's own UID (downward API): what the in-pod agent asks the node agent about.
POD_UID_ENV = "REKINDLE_POD_UID"
