"""Where a new replica goes: toward every node whose cache holds the checkpoint it will
restore from, the ones with it in the page cache first.

A checkpoint kept by the node agent (storage node) or on a hostPath lives on
nodes, and a replica elsewhere must pull it first (or boot). A Deployment's pod
template is shared by every replica and changing it rolls them all, so it cannot
follow the set of warm nodes as it grows. Instead the template creates each pod
gated (GATE, Pod Scheduling Readiness, Kubernetes 1.30+), and the operator,
watching the service's pods, releases it with one update that adds preferred
node-affinity terms for the warm nodes of that moment (a gated pod's preferred
terms may change: KEP-3838). Preferred, never required: with no room on a warm
node the pod schedules elsewhere and restores after a pull, or boots. The
operator removes only its own gate and keeps every affinity term the user set.

Warm: the node the checkpoint was made on (the Checkpoint's status.node) and
every node where a replica restored from it (status.cachedNodes, which the
operator records: that node agent verified it into its cache). Resident: one of
those where a running replica reports at least RESIDENT_PERCENT of it in the
page cache. A gated pod waits for the operator: while the operator is down, new
replicas of such services stay Pending (SchedulingGated).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

GATE = "rekindle.dev/warm-placement"
WARM_WEIGHT = 50  # a warm node (its cache holds the checkpoint)
RESIDENT_WEIGHT = 50  # added for a warm node with the checkpoint in its page cache
RESIDENT_PERCENT = 90.0
MAX_CACHED_NODES = 64  # status.cachedNodes is bounded: the newest are kept
MAX_PREFERRED = 32  # terms added per pod: the resident nodes first, then the warm ones

Obj = dict[str, Any]


def uses_gate(storage_type: str) -> bool:
    """Whether a service's pods are created gated: its checkpoints are node-local."""
    return storage_type in ("node", "hostPath")


def gated(pod: Mapping[str, Any]) -> bool:
    """Whether pod still waits for the operator to place it."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == GATE for g in gates)


def warm_nodes(checkpoint: Mapping[str, Any] | None) -> list[str]:
    """The nodes whose cache holds this Checkpoint (made there, or a replica restored it)."""
    st = (checkpoint or {}).get("status") or {}
    nodes = [str(st["node"])] if st.get("node") else []
    nodes += [str(n) for n in st.get("cachedNodes") or [] if n]
    return sorted(set(nodes))


def resident_nodes(isvc_status: Mapping[str, Any]) -> list[str]:
    """Nodes whose running replicas restored the current checkpoint and have it resident."""
    return sorted(
        str(n["name"])
        for n in isvc_status.get("nodes") or []
        if n.get("checkpointCached") and float(n.get("residentPercent", 0.0)) >= RESIDENT_PERCENT
    )


def _terms(weight: int, nodes: Sequence[str]) -> list[Obj]:
    """One term per node: a node field selector takes exactly one value per In."""
    return [
        {
            "weight": weight,
            "preference": {
                "matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]
            },
        }
        for node in nodes
    ]


def release_patch(pod: Mapping[str, Any], warm: Sequence[str], resident: Sequence[str]) -> Obj:
    """The merge patch that releases pod: GATE removed (other gates kept) and, when there
    are warm nodes, preferred terms for them (one per node, at most MAX_PREFERRED)
    added to the pod's own affinity; empty warm: the gate alone."""
    spec = pod.get("spec") or {}
    out: Obj = {
        "spec": {
            "schedulingGates": [
                g for g in spec.get("schedulingGates") or [] if g.get("name") != GATE
            ]
        }
    }
    hot = [n for n in resident if n in warm][: MAX_PREFERRED // 2]
    warm = [*hot, *[n for n in warm if n not in hot]][: MAX_PREFERRED - len(hot)]
    terms = _terms(WARM_WEIGHT, sorted(warm)) + _terms(RESIDENT_WEIGHT, hot)
    if terms:
        affinity = dict(spec.get("affinity") or {})
        node_affinity = dict(affinity.get("nodeAffinity") or {})
        key = "preferredDuringSchedulingIgnoredDuringExecution"
        node_affinity[key] = [*(node_affinity.get(key) or []), *terms]
        affinity["nodeAffinity"] = node_affinity
        out["spec"]["affinity"] = affinity
    return out


def cached_nodes(checkpoint: Mapping[str, Any], restored_on: Iterable[str]) -> list[str] | None:
    """The Checkpoint's new status.cachedNodes with the nodes replicas restored it on,
    or None when that adds nothing."""
    st = checkpoint.get("status") or {}
    old = [str(n) for n in st.get("cachedNodes") or []]
    new = [n for n in sorted(set(restored_on)) if n and n not in old and n != st.get("node")]
    if not new:
        return None
    return [*old, *new][-MAX_CACHED_NODES:]
