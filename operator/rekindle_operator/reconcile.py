"""Level-based reconcile of one InferenceService: owned objects, pointer, status.

Called on create/update/resume and from a timer, so every step is idempotent:
server-side apply for what the operator fully owns, create-if-absent for
one-time values (the token, the PVC).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

from rekindle_operator import agent_command as ac
from rekindle_operator import builders as b
from rekindle_operator.constants import ANN_BOOT_PATH, ANN_BOOT_REASON
from rekindle_operator.spec_fingerprint import spec_fingerprint
from rekindle_operator.kube import Kube
from rekindle_operator.selection import newest_usable, stale_changes
from rekindle_operator.shm_sizing import shm_need
from rekindle_operator.spec import IsvcSpec, SpecError, parse_spec
from rekindle_operator.status import Observed, PodBoot, compute_status, pod_boot, transitions

Emit = Callable[[str, str, str], None]  # (Normal|Warning, reason, message)
Body = Mapping[str, Any]
AgentAsk = Callable[[str, str], tuple[dict[str, Any] | None, str | None]]


def spec_of(body: Body) -> IsvcSpec:
    meta = body["metadata"]
    return parse_spec(
        meta["name"], meta["namespace"], body.get("spec") or {}, meta.get("annotations")
    )


def read_token(kube: Kube, namespace: str, isvc: str) -> str:
    sec = kube.get("Secret", namespace, b.secret_name(isvc))
    if not sec:
        raise RuntimeError(f"Secret {b.secret_name(isvc)} is missing; the operator recreates it")
    return base64.b64decode(sec["data"][ac.TOKEN_KEY]).decode()


def agent_url(pod: Body) -> str:
    return f"http://{pod['status']['podIP']}:{ac.ADMIN_PORT}"


def ask_agent(url: str, token: str) -> tuple[dict[str, Any] | None, str | None]:
    """GET /v1/status of one agent: (reply, None) or (None, why not)."""
    try:
        return ac.AgentClient(url, token, timeout=3).status().raw, None
    except Exception as e:  # any failure is reported in status, never raised
        return None, f"agent status unavailable: {e}"


def update_pointer(
    kube: Kube, body: Body, spec: IsvcSpec, checkpoints: list[dict[str, Any]]
) -> str | None:
    """Point new replicas at the newest usable checkpoint; returns its name if they will use it."""
    best = newest_usable(checkpoints, spec.name, spec_fingerprint(spec))
    path = str(best["status"]["path"]) if best else ""
    kube.apply(b.build_configmap(spec, path, owner=body))
    if best is None or spec.restore_policy == "Never":
        return None
    return str(best["metadata"]["name"])


def mark_stale(kube: Kube, spec: IsvcSpec, checkpoints: list[dict[str, Any]], emit: Emit) -> None:
    for name, stale in stale_changes(checkpoints, spec.name, spec_fingerprint(spec)).items():
        kube.merge_patch("Checkpoint", spec.namespace, name, {"status": {"stale": stale}}, "status")
        if stale:
            emit(
                "Warning",
                "CheckpointStale",
                f"Checkpoint {name} no longer matches the spec (fingerprint changed); not used",
            )


def ensure_objects(kube: Kube, body: Body, spec: IsvcSpec, shm_bytes: int) -> None:
    kube.create_if_absent(b.build_secret(spec, owner=body))
    pvc = b.build_pvc(spec, owner=body)
    if pvc is not None:
        kube.create_if_absent(pvc)
    kube.apply(b.build_service(spec, owner=body))
    kube.apply(b.build_deployment(spec, shm_bytes, spec_fingerprint(spec), owner=body))


def observe_pods(kube: Kube, spec: IsvcSpec, ask: AgentAsk) -> tuple[PodBoot, ...]:
    pods = kube.list("Pod", spec.namespace, b.selector_string(spec.name))
    token: str | None = None
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        reply: dict[str, Any] | None = None
        err: str | None = "pod has no IP yet"
        if (pod.get("status") or {}).get("podIP"):
            if token is None:
                token = read_token(kube, spec.namespace, spec.name)
            reply, err = ask(agent_url(pod), token)
        boot = pod_boot(pod, reply, err)
        mirror_boot_annotations(kube, pod, boot)
        out.append(boot)
    return tuple(out)


def mirror_boot_annotations(kube: Kube, pod: Body, boot: PodBoot) -> None:
    """Pods say how they came up (kubectl get pod -o yaml shows it without the agent)."""
    if boot.origin not in ("booted", "restored"):
        return
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    want = {ANN_BOOT_PATH: boot.origin, ANN_BOOT_REASON: boot.reason[:500]}
    if all(ann.get(k) == v for k, v in want.items()):
        return
    kube.merge_patch(
        "Pod",
        pod["metadata"]["namespace"],
        pod["metadata"]["name"],
        {"metadata": {"annotations": want}},
    )


def reconcile(kube: Kube, body: Body, emit: Emit, ask: AgentAsk = ask_agent) -> dict[str, Any]:
    """Bring owned objects in line with body's spec and return the new status."""
    old: Body = body.get("status") or {}
    meta = body["metadata"]
    try:
        spec = spec_of(body)
    except (SpecError, ValueError) as e:
        new = {**old, "phase": "Failed", "message": str(e)}
        if old.get("message") != str(e):
            emit("Warning", "InvalidSpec", str(e))
        return new

    need = shm_need(spec)
    shm_error = b.shm_shortfall(spec, need)
    shm_bytes = b.effective_shm_bytes(spec, need)
    checkpoints = kube.list("Checkpoint", spec.namespace)
    mark_stale(kube, spec, checkpoints, emit)
    in_use = None
    if shm_error is None:
        # The pointer first: a pod the Deployment change starts must see it.
        in_use = update_pointer(kube, body, spec, checkpoints)
        ensure_objects(kube, body, spec, shm_bytes)
    deployment = kube.get("Deployment", spec.namespace, b.deployment_name(spec.name))
    pods = observe_pods(kube, spec, ask) if deployment else ()
    obs = Observed(
        spec_replicas=spec.replicas,
        deployment=deployment,
        pods=pods,
        checkpoint=in_use,
        shm_bytes=shm_bytes,
        shm_need=need.as_status(),
        shm_error=shm_error,
        selector=b.selector_string(spec.name),
        endpoint=f"http://{b.service_name(spec.name)}.{meta['namespace']}.svc:{ac.SERVE_PORT}/v1",
    )
    new = compute_status(old, obs)
    new["observedGeneration"] = meta.get("generation", 0)
    new["fingerprint"] = spec_fingerprint(spec)
    for kind, reason, message in transitions(old, new):
        emit(kind, reason, message)
    return new
