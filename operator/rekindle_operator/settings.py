"""Operator settings from its environment (the chart sets them; all optional).

REKINDLE_ALLOWED_IMAGES: runtime images InferenceServices may use, comma or
newline separated; an entry ending in `*` is a prefix. Empty: any image. The
chart's ValidatingAdmissionPolicy refuses the others at `kubectl apply`; this
is the operator's own check (phase Failed, reason in the message).

REKINDLE_OPERATOR_NAMESPACE, REKINDLE_OPERATOR_POD_LABELS (`k=v,k=v`): where
the operator's pods run and their labels. With both set, each InferenceService
gets a NetworkPolicy that lets only those pods reach the agent's admin port,
and hostPath data of a Checkpoint in a terminating namespace is removed by a
Job in the operator's namespace.

REKINDLE_DELETE_TIMEOUT: seconds a Checkpoint's deletion may keep retrying to
create its cleanup Job before its finalizer is dropped with a Warning Event
(default 300).

REKINDLE_WARM_PLACEMENT: `false` creates the pods of node-local storage without
the placement gate (placement.py): they schedule without the operator, where
the scheduler puts them. Default true.

REKINDLE_FRONT_URL: where KEDA reaches the front (the chart's front Service,
such as http://rekindle-front.rekindle.svc:8080). InferenceServices with
spec.autoscaling get a ScaledObject reading URL/load/NAMESPACE/NAME; unset,
spec.autoscaling is refused with a reason in the status.

REKINDLE_PREWARM: `false` stops the operator asking one replica per node to have
its node agent pull the checkpoint in use (services of storage type node that
publish): new replicas there then pull it when they start. Default true.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_DELETE_TIMEOUT_S = 300.0


def _split(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.replace("\n", ",").split(",") if p.strip())


def image_allowed(image: str, patterns: tuple[str, ...]) -> bool:
    """True if image is in patterns (exact, or a prefix entry ending in `*`); no patterns: any."""
    if not patterns:
        return True
    return any(image == p or (p.endswith("*") and image.startswith(p[:-1])) for p in patterns)


@dataclass(frozen=True)
class Settings:
    allowed_images: tuple[str, ...] = ()
    operator_namespace: str = ""
    operator_labels: dict[str, str] = field(default_factory=dict)
    delete_timeout_s: float = DEFAULT_DELETE_TIMEOUT_S
    warm_placement: bool = True
    prewarm: bool = True
    front_url: str = ""

    @property
    def network_policy(self) -> bool:
        return bool(self.operator_namespace and self.operator_labels)


def from_env(env: dict[str, str] | None = None) -> Settings:
    e = dict(os.environ if env is None else env)
    labels = {}
    for item in _split(e.get("REKINDLE_OPERATOR_POD_LABELS", "")):
        k, _, v = item.partition("=")
        labels[k.strip()] = v.strip()
    return Settings(
        allowed_images=_split(e.get("REKINDLE_ALLOWED_IMAGES", "")),
        operator_namespace=e.get("REKINDLE_OPERATOR_NAMESPACE", "").strip(),
        operator_labels=labels,
        delete_timeout_s=float(e.get("REKINDLE_DELETE_TIMEOUT") or DEFAULT_DELETE_TIMEOUT_S),
        warm_placement=e.get("REKINDLE_WARM_PLACEMENT", "true").strip().lower() != "false",
        prewarm=e.get("REKINDLE_PREWARM", "true").strip().lower() != "false",
        front_url=e.get("REKINDLE_FRONT_URL", "").strip(),
    )
