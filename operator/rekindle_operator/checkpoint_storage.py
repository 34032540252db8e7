"""Checkpoint storage meets scheduling: which node a hostPath checkpoint ties restores to,
and when a ReadWriteOnce claim cannot serve where the replicas run.

A hostPath checkpoint is a directory on one node: only a pod on that node can
restore from it (elsewhere the directory is empty and the agent boots). The
operator therefore asks the scheduler to prefer that node for new pods, the
node recorded in the Checkpoint's status when it was taken (node_to_prefer
says when). Preferred rather than required: with required affinity, replicas
beyond what that node can fit would stay Pending forever, while on another
node they still boot normally.

A ReadWriteOnce PVC is attached to one node at a time: a replica scheduled on
a second node waits in ContainerCreating (Multi-Attach). The operator cannot
stop the scheduler from doing that, so it says so in a Warning Event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rekindle_operator.spec import IsvcSpec

Obj = dict[str, Any]
PREFER_WEIGHT = 100  # the most a preferred term can weigh: above the spreading scores


def restore_node(
    spec: IsvcSpec, checkpoints: Iterable[Mapping[str, Any]], in_use: str | None
) -> str:
    """The node holding the checkpoint new pods restore from, when that ties them to it.

    "" for PVC storage (any node that mounts the claim sees the data) and when
    no checkpoint is in use. A node-agent checkpoint is in one node's cache, like a
    hostPath one.
    """
    if spec.storage.type not in ("hostPath", "node") or not in_use:
        return ""
    for ck in checkpoints:
        if (ck.get("metadata") or {}).get("name") == in_use:
            return str((ck.get("status") or {}).get("node") or "")
    return ""


def preferred_nodes(deployment: Mapping[str, Any] | None) -> list[str]:
    """The nodes the Deployment's pod template already prefers (by name)."""
    pod_spec = (((deployment or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
    terms = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "preferredDuringSchedulingIgnoredDuringExecution"
    ) or []
    return [
        v
        for t in terms
        for f in (t.get("preference") or {}).get("matchFields") or []
        if f.get("key") == "metadata.name"
        for v in f.get("values") or []
    ]


def node_to_prefer(node: str, deployment: Mapping[str, Any] | None, pod_nodes: list[str]) -> str:
    """node when preferring it changes where a pod goes, else "".

    Changing the pod template rolls every replica, so the preference goes on
    only when it matters: while there are no replicas (nothing to roll), when
    a replica runs or waits on another node (it cannot restore there), or
    when the template already carries it (taking it off would roll them
    again). On a single node, or with every replica already on the
    checkpoint's node, a new checkpoint rolls nothing.
    """
    if not node:
        return ""
    if node in preferred_nodes(deployment) or not pod_nodes:
        return node
    return node if any(n != node for n in pod_nodes) else ""


def prefer_node(pod_spec: Obj, node: str) -> None:
    """Add a preferred node-affinity term for node to pod_spec, keeping any affinity already set."""
    if not node:
        return
    node_affinity = pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    node_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
        {
            "weight": PREFER_WEIGHT,
            "preference": {
                "matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]
            },
        }
    )


def rwo_spread_warning(
    spec: IsvcSpec, claim: str, access_modes: Iterable[str], nodes: Iterable[str]
) -> str | None:
    """The Warning's message when a ReadWriteOnce checkpoint claim meets pods on several nodes."""
    spread = sorted({n for n in nodes if n})
    if not spec.storage.uses_claim() or len(spread) < 2 or "ReadWriteMany" in access_modes:
        return None
    return (
        f"checkpoint PVC {claim} is ReadWriteOnce but replicas run on nodes "
        f"{', '.join(spread)}: only pods on the node that mounts it can start (Multi-Attach). "
        "Set spec.coldStart.storage.pvc.accessMode: ReadWriteMany with a storage class "
        "that offers it (or an existingClaim that is ReadWriteMany), or use hostPath storage"
    )
