"""Names shared by the CRDs, the builders, the handlers and the kubectl plugin."""

from __future__ import annotations

GROUP = "rekindle.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
ISVC_PLURAL = "inferenceservices"
ISVC_KIND = "InferenceService"
CKPT_PLURAL = "checkpoints"
CKPT_KIND = "Checkpoint"

# Labels every owned object carries; the Deployment selects on NAME_LABEL only.
NAME_LABEL = "rekindle.dev/inferenceservice"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "rekindle-operator"
# The Service also requires SERVING_LABEL: removing it from one pod takes that pod
# out of rotation (for a checkpoint) without its ReplicaSet replacing it, because
# the Deployment's selector does not include it.
SERVING_LABEL = "rekindle.dev/serving"

# Annotations.
ANN_FINGERPRINT = "rekindle.dev/fingerprint"  # on the pod template: the spec it runs
ANN_RESTART = "rekindle.dev/restartedAt"  # on the isvc: `kubectl rekindle restore` bumps it
ANN_BOOT_PATH = "rekindle.dev/boot-path"  # on pods: restored|booted, mirrored from the agent
ANN_BOOT_REASON = "rekindle.dev/boot-reason"
# On pods: the checkpoint directory their vLLM was restored from (mirrored from the
# agent); its data is kept while such a pod lives (restored memory maps its files).
ANN_RESTORED_FROM = "rekindle.dev/restored-from"
# On pods: seconds from the agent's start to its first Ready, on the agent's own
# clock (the pod-level cold start `kubectl rekindle bench` reports).
ANN_AGENT_READY = "rekindle.dev/agent-ready-seconds"

# Phases.
CKPT_PENDING = "Pending"
CKPT_RUNNING = "Running"
CKPT_READY = "Ready"
CKPT_FAILED = "Failed"

# Condition types.
COND_READY = "Ready"
COND_CHECKPOINT_READY = "CheckpointReady"
COND_SHM_SIZED = "SharedMemorySized"
COND_RESTORED = "Restored"
