"""Let go of the operator's finalizers before it is uninstalled (the chart's pre-delete hook).

kopf puts its finalizer (`rekindle.dev/finalizer`) on InferenceServices (for
their status timer) and on Checkpoints (while unfinished, and while they have
data to delete). Once the operator is uninstalled nothing would remove it, and
deleting such an object, or its namespace, would hang for good. The hook first
stops the operator (scales its Deployment to 0 and waits for its pods to go,
else it would put the finalizers straight back), then removes the finalizer
from every InferenceService and Checkpoint in the watched namespaces.
Checkpoint data stays where it is: the Checkpoint objects stay too (helm never
deletes CRDs or their objects), and reinstalling the operator takes them over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from rekindle_operator.constants import CKPT_PLURAL, GROUP, ISVC_PLURAL, VERSION
from rekindle_operator.kube import Kube, KubeError

FINALIZER = f"{GROUP}/finalizer"


def stop_operator(
    kube: Kube, namespace: str, deployment: str, selector: str, timeout: float = 120.0
) -> None:
    """Scale the operator's Deployment to 0 and wait until its pods are gone."""
    try:
        kube.merge_patch("Deployment", namespace, deployment, {"spec": {"replicas": 0}})
    except KubeError as e:
        if e.status != 404:
            raise
    deadline = time.monotonic() + timeout
    while kube.list("Pod", namespace, selector) and time.monotonic() < deadline:
        time.sleep(2)


def _items(kube: Kube, plural: str, namespace: str | None) -> list[dict[str, Any]]:
    where = f"/namespaces/{namespace}" if namespace else ""
    out = kube.request("GET", f"/apis/{GROUP}/{VERSION}{where}/{plural}")
    items: list[dict[str, Any]] = out.get("items", [])
    return items


def release_finalizers(
    kube: Kube, namespaces: Iterable[str], say: Callable[[str], None] = print
) -> int:
    """Remove FINALIZER from every InferenceService and Checkpoint; returns how many."""
    count = 0
    scopes: list[str | None] = [*namespaces] or [None]  # None: all namespaces
    for ns in scopes:
        for plural, kind in ((CKPT_PLURAL, "Checkpoint"), (ISVC_PLURAL, "InferenceService")):
            for obj in _items(kube, plural, ns):
                meta = obj["metadata"]
                finalizers = list(meta.get("finalizers") or [])
                if FINALIZER not in finalizers:
                    continue
                keep = [f for f in finalizers if f != FINALIZER]
                kube.merge_patch(
                    kind,
                    meta["namespace"],
                    meta["name"],
                    {"metadata": {"finalizers": keep or None}},
                )
                path = (obj.get("status") or {}) if isinstance(obj.get("status"), dict) else {}
                where = f" (its data stays at {path.get('path')})" if path.get("path") else ""
                say(f"released {kind} {meta['namespace']}/{meta['name']}{where}")
                count += 1
    return count
