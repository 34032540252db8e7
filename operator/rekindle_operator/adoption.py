"""Which existing objects an InferenceService may take over: only its own.

The operator derives its objects' names from the InferenceService's (`NAME`,
`NAME-agent-token`, ...). Server-side apply with force, or a create that
treats "already exists" as done, would otherwise take over whatever already
has that name: a Service `api` of another application (its selector
rewritten), or a `NAME-signing-key` Secret someone created beforehand (its
creator knows the key that signs the service's checkpoints). An object is
the service's own only if it carries a controller owner reference to this
InferenceService's UID; any other object with a derived name stops the
reconcile before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rekindle_operator import builders as b
from rekindle_operator.kube import Kube
from rekindle_operator.spec import IsvcSpec


def derived_objects(spec: IsvcSpec, network_policy: bool) -> list[tuple[str, str]]:
    """(kind, name) of every object the operator creates for spec and owns. The
    checkpoint claim is not here: with deletionPolicy Retain it has no owner by
    design (it outlives the service), so it is found by name."""
    out = [
        ("Secret", b.secret_name(spec.name)),
        ("Secret", b.signing_secret_name(spec.name)),
        ("Secret", b.metrics_secret_name(spec.name)),
        ("ConfigMap", b.configmap_name(spec.name)),
        ("Service", b.service_name(spec.name)),
        ("Deployment", b.deployment_name(spec.name)),
    ]
    if network_policy:
        out.append(("NetworkPolicy", b.network_policy_name(spec.name)))
    if spec.disruption_max_unavailable is not None:
        out.append(("PodDisruptionBudget", b.disruption_budget_name(spec.name)))
    if spec.autoscaling is not None:
        out.append(("ScaledObject", b.scaled_object_name(spec.name)))
    return out


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def foreign_object(kube: Kube, spec: IsvcSpec, uid: str, network_policy: bool) -> str:
    """A message naming the first object with a derived name that is not this
    InferenceService's, or "" when every one is absent or its own."""
    for kind, name in derived_objects(spec, network_policy):
        obj = kube.get(kind, spec.namespace, name)
        if obj is not None and not owned_by(obj, uid):
            return (
                f"{kind} {name} exists and is not ours: it has no controller owner reference "
                f"to InferenceService {spec.name} (uid {uid}), so the operator will not take "
                f"it over; delete or rename that {kind}, or give the InferenceService another "
                "name"
            )
    return ""
