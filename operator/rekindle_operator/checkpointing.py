"""Drive one Checkpoint: pick a pod, take it out of rotation, ask its agent, record.

A state machine on status.phase, so the same function serves create, resume
after an operator restart, and retries: Pending -> Running -> Ready | Failed.
The phase is written to the apiserver *before* the agent is called, so an
operator killed mid-checkpoint finds "Running" on restart and recovers: it
waits for the agent to finish, records the result if the agent reports it,
else fails the Checkpoint with a clear reason; the pod is put back in rotation
in every case.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from rekindle_operator import agent_command as ac
from rekindle_operator import builders as b
from rekindle_operator.constants import (
    CKPT_FAILED,
    CKPT_PENDING,
    CKPT_READY,
    CKPT_RUNNING,
    ISVC_KIND,
    SERVING_LABEL,
)
from rekindle_operator.spec_fingerprint import spec_fingerprint
from rekindle_operator.kube import Kube
from rekindle_operator.quantity import human_bytes
from rekindle_operator.reconcile import Emit, agent_url, read_token, spec_of, update_pointer
from rekindle_operator.selection import ready_pods
from rekindle_operator.status import now_iso, parse_time

Body = Mapping[str, Any]
ClientFactory = Callable[[str, str], Any]  # (base_url, token) -> AgentClient-like

DEFAULT_TIMEOUT_S = 1800
BUSY_STATES = ("Draining", "Checkpointing", "Restoring")


class Retry(Exception):
    """Not possible yet (no ready pod); the handler retries after `delay` seconds."""

    def __init__(self, message: str, delay: float = 10.0) -> None:
        super().__init__(message)
        self.delay = delay


def _set_status(kube: Kube, body: Body, status: Mapping[str, Any]) -> None:
    meta = body["metadata"]
    kube.merge_patch(
        "Checkpoint", meta["namespace"], meta["name"], {"status": dict(status)}, "status"
    )


def _fail(kube: Kube, body: Body, emit: Emit, reason: str, message: str) -> dict[str, Any]:
    st = {"phase": CKPT_FAILED, "reason": reason, "message": message, "completedAt": now_iso()}
    _set_status(kube, body, st)
    emit("Warning", reason, message)
    return st


def set_serving(kube: Kube, namespace: str, pod: str, serving: bool) -> None:
    """Add or remove the label the Service selects on; a vanished pod is fine."""
    value = "true" if serving else None
    try:
        kube.merge_patch("Pod", namespace, pod, {"metadata": {"labels": {SERVING_LABEL: value}}})
    except Exception as e:
        if getattr(e, "status", None) != 404:
            raise


def _adopt(kube: Kube, body: Body, isvc: Body) -> None:
    """Checkpoint objects go with their InferenceService (its data per deletionPolicy)."""
    refs = body["metadata"].get("ownerReferences") or []
    if any(r.get("uid") == isvc["metadata"]["uid"] for r in refs):
        return
    ref = {**b.owner_reference({**isvc, "kind": ISVC_KIND}), "controller": False}
    kube.merge_patch(
        "Checkpoint",
        body["metadata"]["namespace"],
        body["metadata"]["name"],
        {"metadata": {"ownerReferences": [*refs, ref]}},
    )


def _result_status(manifest: Mapping[str, Any], started: str, how: str) -> dict[str, Any]:
    """Ready: the agent answers success only after it restored the new checkpoint once."""
    summary = {**ac.manifest_summary(manifest), "verified": True}
    total = (parse_time(now_iso()) - parse_time(started)).total_seconds()
    out = {
        "phase": CKPT_READY,
        "reason": "Verified",
        "message": f"checkpoint written and restored once by the agent{how}",
        "totalSeconds": total,
        "completedAt": now_iso(),
        "stale": False,
        **summary,
    }
    if summary["files"]:
        out["size"] = human_bytes(summary["sizeBytes"])
    else:  # recovered from the agent's status: no file list, so no size
        out.pop("sizeBytes")
        out.pop("files")
    return out


def _checkpointable(
    candidates: list[Body], token: str, client_for: ClientFactory
) -> tuple[Body | None, list[str]]:
    """The best candidate whose agent is Ready, and why the others were passed over.

    Pods whose vLLM was not restored with the mmap restore come first: only the
    patched CRIU can dump memory still mapped from an old image (the agent
    answers 409 otherwise, which then fails the Checkpoint with its reason).
    """
    skipped = []
    ready: list[tuple[bool, Body]] = []
    for pod in candidates:
        name = pod["metadata"]["name"]
        try:
            reply = client_for(agent_url(pod), token).status()
        except Exception as e:
            skipped.append(f"pod {name}: agent not answering ({e})")
            continue
        if reply.state != "Ready":
            skipped.append(f"pod {name}: agent is {reply.state}, not Ready")
            continue
        ready.append((bool(reply.raw.get("restored_with_mmap")), pod))
    if not ready:
        return None, skipped
    return min(ready, key=lambda r: r[0])[1], skipped


def run_checkpoint(
    kube: Kube,
    body: Body,
    emit: Emit,
    client_for: ClientFactory = ac.AgentClient,
    poll_s: float = 2.0,
) -> dict[str, Any]:
    """Advance one Checkpoint as far as possible; returns the status it ended with."""
    meta, spec = body["metadata"], body.get("spec") or {}
    status = dict(body.get("status") or {})
    phase = status.get("phase") or CKPT_PENDING
    if phase in (CKPT_READY, CKPT_FAILED):
        return status
    ns, isvc_name = meta["namespace"], spec.get("inferenceService", "")
    isvc = kube.get(ISVC_KIND, ns, isvc_name)
    if isvc is None:
        return _fail(
            kube,
            body,
            emit,
            "InferenceServiceNotFound",
            f"InferenceService {isvc_name!r} does not exist in namespace {ns}: "
            "set spec.inferenceService to an existing one (kubectl get rkis)",
        )
    _adopt(kube, body, isvc)
    if phase == CKPT_RUNNING:
        return recover(kube, body, emit, client_for, poll_s)

    isvc_spec = spec_of(isvc)
    candidates = ready_pods(kube.list("Pod", ns, b.selector_string(isvc_name)), spec.get("pod"))
    timeout = int(spec.get("timeoutSeconds") or DEFAULT_TIMEOUT_S)
    token = read_token(kube, ns, isvc_name) if candidates else ""
    pod, skipped = _checkpointable(candidates, token, client_for)
    if pod is None:
        age = (parse_time(now_iso()) - parse_time(meta["creationTimestamp"])).total_seconds()
        if age > timeout:
            return _fail(
                kube,
                body,
                emit,
                "NoReadyPod",
                f"no ready pod of {isvc_name} within {timeout}s: scale it up and retry",
            )
        why = f"waiting for a pod of {isvc_name} to checkpoint: " + (
            "; ".join(skipped) or "none is ready"
        )
        if status.get("message") != why:
            _set_status(
                kube, body, {"phase": CKPT_PENDING, "reason": "WaitingForPod", "message": why}
            )
        raise Retry(why)

    pod_name = pod["metadata"]["name"]
    path = b.checkpoint_path(isvc_name, meta["name"], meta["uid"])
    started = now_iso()
    running = {
        "phase": CKPT_RUNNING,
        "reason": "Checkpointing",
        "message": f"pod {pod_name} is out of rotation while its agent checkpoints",
        "pod": pod_name,
        "path": path,
        "fingerprint": spec_fingerprint(isvc_spec),
        "startedAt": started,
        # What deleting the data needs, even once the InferenceService is gone.
        "volume": b.checkpoint_volume(isvc_spec),
        "image": isvc_spec.image,
        "imagePullPolicy": isvc_spec.image_pull_policy,
    }
    _set_status(kube, body, running)
    emit("Normal", "CheckpointStarted", f"checkpointing pod {pod_name} into {path}")
    set_serving(kube, ns, pod_name, False)
    try:
        manifest = client_for(agent_url(pod), token).checkpoint(path, timeout=timeout)
    except Exception as e:
        return _fail(
            kube,
            body,
            emit,
            "AgentCheckpointFailed",
            f"pod {pod_name} kept serving; the agent said: {e}",
        )
    finally:
        set_serving(kube, ns, pod_name, True)
    result = _result_status(manifest, started, "")
    _set_status(kube, body, result)
    emit(
        "Normal",
        "CheckpointReady",
        f"{result['size']} in {result['totalSeconds']:.1f}s from pod {pod_name}",
    )
    update_pointer(kube, isvc, isvc_spec, kube.list("Checkpoint", ns))
    return {**running, **result}


def recover(
    kube: Kube, body: Body, emit: Emit, client_for: ClientFactory, poll_s: float
) -> dict[str, Any]:
    """The operator restarted while this Checkpoint was Running: finish or fail it cleanly."""
    meta, status = body["metadata"], body.get("status") or {}
    ns, isvc_name = meta["namespace"], body["spec"]["inferenceService"]
    pod_name, path = status.get("pod", ""), status.get("path", "")
    pod = kube.get("Pod", ns, pod_name) if pod_name else None
    if pod is None or not (pod.get("status") or {}).get("podIP"):
        return _fail(
            kube,
            body,
            emit,
            "PodGone",
            f"pod {pod_name!r} went away during the checkpoint: create a new Checkpoint",
        )
    try:
        client = client_for(agent_url(pod), read_token(kube, ns, isvc_name))
        deadline = time.monotonic() + int(body["spec"].get("timeoutSeconds") or DEFAULT_TIMEOUT_S)
        reply = client.status()
        while reply.state in BUSY_STATES and time.monotonic() < deadline:
            time.sleep(poll_s)
            reply = client.status()
        last = reply.raw.get("last_checkpoint") or {}
    finally:
        set_serving(kube, ns, pod_name, True)
    if last.get("dir") == path and last.get("ok"):
        result = _result_status(
            {"timings": last.get("timings") or {}},
            status.get("startedAt") or now_iso(),
            " (recorded after an operator restart, from the agent's status)",
        )
        _set_status(kube, body, result)
        emit(
            "Normal", "CheckpointReady", f"pod {pod_name} finished it while the operator restarted"
        )
        isvc = kube.get(ISVC_KIND, ns, isvc_name)
        if isvc is not None:
            update_pointer(kube, isvc, spec_of(isvc), kube.list("Checkpoint", ns))
        return result
    return _fail(
        kube,
        body,
        emit,
        "OperatorRestarted",
        f"the operator restarted while pod {pod_name} was checkpointing and the agent "
        f"(now {reply.state}) reports no finished checkpoint at {path}; pod {pod_name} is "
        "serving again: create a new Checkpoint",
    )


def delete_data(kube: Kube, body: Body, emit: Emit) -> str:
    """Apply spec.deletionPolicy when a Checkpoint is deleted; returns what was done."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    path = status.get("path")
    if not path or not status.get("volume") or not status.get("image"):
        return "nothing to delete"
    if spec.get("deletionPolicy", "Delete") == "Retain":
        return f"retained {path}"
    job = b.build_cleanup_job(
        body["metadata"]["namespace"],
        body["metadata"]["name"],
        path,
        status["volume"],
        status["image"],
        status.get("imagePullPolicy", "IfNotPresent"),
    )
    kube.create_if_absent(job)
    emit("Normal", "CheckpointDataDeleted", f"deleting {path} (deletionPolicy Delete)")
    return f"deleting {path}"
