"""Checkpoints the operator takes by itself, and how many of them it keeps.

spec.coldStart.checkpoint.auto: once a replica of a spec that has no usable
checkpoint is Ready, the operator creates Checkpoint NAME-auto-FINGERPRINT
(the first ten hex digits), so every new spec (image, model, vLLM flags...)
gets its own without anyone running `kubectl rekindle checkpoint`. The name
is the idempotency: one automatic checkpoint per spec, created once; a failed
one stays Failed (its reason in status) and is not retried in a loop.

It carries keepServing: it starts only while another ready replica stays in
the Service, and while it is unfinished the Deployment runs one replica more
(surge), so a one-replica service never has no replica serving.

spec.coldStart.checkpoint.keep: the newest `keep` Ready automatic checkpoints
stay; older ones, and failed ones of specs no longer current, are deleted
(with deletionPolicy Delete their data goes too, once no replica maps it).
The one new replicas restore from is never deleted; checkpoints made by hand
never are.

Pure functions over the apiserver's dicts, as selection.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rekindle_operator.constants import (
    API_VERSION,
    CKPT_FAILED,
    CKPT_KIND,
    CKPT_READY,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NAME_LABEL,
)
from rekindle_operator.selection import belongs_to

Body = Mapping[str, Any]

AUTO_LABEL = "rekindle.dev/auto-checkpoint"  # "true" on the Checkpoints made here
SPEC_LABEL = "rekindle.dev/spec-fingerprint"  # the spec it was made for


def auto_name(isvc: str, fingerprint: str) -> str:
    return f"{isvc}-auto-{fingerprint[:10]}"


def is_auto(c: Body) -> bool:
    return ((c.get("metadata") or {}).get("labels") or {}).get(AUTO_LABEL) == "true"


def _phase(c: Body) -> str:
    return str((c.get("status") or {}).get("phase") or "Pending")


def unfinished(checkpoints: Iterable[Body], isvc: str) -> list[Body]:
    """isvc's Checkpoints not yet Ready or Failed (and not being deleted)."""
    return [
        c
        for c in checkpoints
        if belongs_to(c, isvc)
        and _phase(c) not in (CKPT_READY, CKPT_FAILED)
        and not (c.get("metadata") or {}).get("deletionTimestamp")
    ]


def surge(checkpoints: Iterable[Body], isvc: str) -> int:
    """Replicas to run beyond the spec's: one while a keepServing Checkpoint is unfinished."""
    keep_serving = [
        c for c in unfinished(checkpoints, isvc) if (c.get("spec") or {}).get("keepServing")
    ]
    return 1 if keep_serving else 0


def due(
    isvc: str,
    fingerprint: str,
    checkpoints: Sequence[Body],
    usable: Body | None,
    ready_current: int,
) -> bool:
    """Whether to create isvc's automatic Checkpoint for fingerprint now.

    usable: the newest usable checkpoint of this spec (none: one is due);
    ready_current: Ready replicas running this spec (at least one to dump).
    """
    if usable is not None or ready_current < 1:
        return False
    if unfinished(checkpoints, isvc):
        return False  # one at a time; the one running may be for this spec already
    name = auto_name(isvc, fingerprint)
    return not any((c.get("metadata") or {}).get("name") == name for c in checkpoints)


def build(isvc: str, namespace: str, fingerprint: str) -> dict[str, Any]:
    """The automatic Checkpoint for fingerprint: its data deleted with it."""
    return {
        "apiVersion": API_VERSION,
        "kind": CKPT_KIND,
        "metadata": {
            "name": auto_name(isvc, fingerprint),
            "namespace": namespace,
            "labels": {
                NAME_LABEL: isvc,
                AUTO_LABEL: "true",
                SPEC_LABEL: fingerprint,
                MANAGED_BY_LABEL: MANAGED_BY,
            },
        },
        "spec": {"inferenceService": isvc, "deletionPolicy": "Delete", "keepServing": True},
    }


def _newest_first_key(c: Body) -> tuple[str, str]:
    st, meta = c.get("status") or {}, c.get("metadata") or {}
    return (str(st.get("completedAt") or meta.get("creationTimestamp") or ""), meta["name"])


def to_delete(
    checkpoints: Iterable[Body], isvc: str, fingerprint: str, keep: int, in_use: str | None
) -> list[str]:
    """Names of isvc's automatic Checkpoints past retention, oldest last."""
    mine = [
        c
        for c in checkpoints
        if belongs_to(c, isvc) and is_auto(c) and not c["metadata"].get("deletionTimestamp")
    ]
    ready = sorted(
        (c for c in mine if _phase(c) == CKPT_READY), key=_newest_first_key, reverse=True
    )
    out = [c["metadata"]["name"] for c in ready[keep:]]
    out += [
        c["metadata"]["name"]
        for c in mine
        if _phase(c) == CKPT_FAILED
        and (c["metadata"].get("labels") or {}).get(SPEC_LABEL) != fingerprint
    ]
    return [n for n in out if n != in_use]
