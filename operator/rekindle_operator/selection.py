"""Which checkpoint new replicas restore from, and which checkpoints are stale.

Pure functions over Checkpoint bodies (dicts as the apiserver returns them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rekindle_operator.constants import ANN_FINGERPRINT, CKPT_READY

Body = Mapping[str, Any]


def _status(c: Body) -> Mapping[str, Any]:
    return c.get("status") or {}


def belongs_to(c: Body, isvc: str) -> bool:
    return bool((c.get("spec") or {}).get("inferenceService") == isvc)


def is_stale(c: Body, fingerprint: str) -> bool:
    """A checkpoint of a different spec (image, model, vLLM flags...) must not be restored."""
    fp = _status(c).get("fingerprint")
    return bool(fp) and fp != fingerprint


def is_usable(c: Body, isvc: str, fingerprint: str) -> bool:
    st = _status(c)
    return (
        belongs_to(c, isvc)
        and st.get("phase") == CKPT_READY
        and bool(st.get("path"))
        and not is_stale(c, fingerprint)
        and not (c.get("metadata") or {}).get("deletionTimestamp")
    )


def _completed_key(c: Body) -> tuple[str, str]:
    # RFC 3339 UTC timestamps sort lexically; the name breaks ties deterministically.
    st = _status(c)
    meta = c.get("metadata") or {}
    return (str(st.get("completedAt") or meta.get("creationTimestamp") or ""), meta.get("name", ""))


def newest_usable(checkpoints: Iterable[Body], isvc: str, fingerprint: str) -> Body | None:
    """The newest Ready checkpoint of isvc whose fingerprint matches its current spec."""
    usable = [c for c in checkpoints if is_usable(c, isvc, fingerprint)]
    return max(usable, key=_completed_key) if usable else None


def stale_changes(checkpoints: Iterable[Body], isvc: str, fingerprint: str) -> dict[str, bool]:
    """name -> new status.stale for the checkpoints of isvc whose flag must change."""
    out: dict[str, bool] = {}
    for c in checkpoints:
        if not belongs_to(c, isvc) or _status(c).get("phase") != CKPT_READY:
            continue
        stale = is_stale(c, fingerprint)
        if bool(_status(c).get("stale", False)) != stale:
            out[c["metadata"]["name"]] = stale
    return out


def ready_pods(pods: Iterable[Body], wanted: str | None = None) -> list[Body]:
    """Checkpoint candidates, best first: ready, with an IP, not terminating."""
    candidates = []
    for p in pods:
        meta = p.get("metadata") or {}
        if meta.get("deletionTimestamp") or (wanted and meta.get("name") != wanted):
            continue
        if pod_ready(p) and (p.get("status") or {}).get("podIP"):
            candidates.append(p)
    # Oldest first: the longest-lived pod is the most warmed-up and least likely to be scaled away.
    candidates.sort(
        key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"])
    )
    return candidates


def pod_ready(p: Body) -> bool:
    for cond in (p.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def current_spec_pods(pods: list[Body], fingerprint: str) -> tuple[list[Body], list[str]]:
    """The pods started from the current spec, and why the others are passed over.

    A Checkpoint records the current spec's fingerprint, so it must dump a pod
    that runs that spec: during a rollout, older pods run an older one.
    """
    ok, skipped = [], []
    for pod in pods:
        theirs = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANN_FINGERPRINT)
        if theirs == fingerprint:
            ok.append(pod)
        else:
            skipped.append(
                f"pod {pod['metadata']['name']}: runs an older spec (fingerprint {theirs}, "
                f"current {fingerprint})"
            )
    return ok, skipped
