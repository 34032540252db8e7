"""Drive one Checkpoint in short steps: pick a pod, take it out of rotation, ask its agent, record.

A state machine on status.phase: Pending -> Running -> Ready | Failed. A timer
calls step() every few seconds while the phase is unfinished; each call does
one short piece of work and returns, so the operator's workers stay free for
every other object while an agent spends minutes draining, dumping and
verifying. The agent's blocking POST runs in a background thread (pods.py);
steps look at it, and at the agent's status, until it has answered.

The Running phase, the pod and the path are written to the apiserver before
the agent is asked, so an operator restarted mid-checkpoint finds "Running"
and goes on from there: it has no thread of its own for the call any more,
so it watches the agent's status until the agent is idle and records the
checkpoint if the agent reports it finished at that path, else fails it with
a clear reason. The pod is put back in rotation in every case.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from rekindle_contract.api import StatusReply
from rekindle_contract.pod import CHECKPOINT_MOUNT

from rekindle_operator import builders as b
from rekindle_operator.constants import (
    ANN_BOOT_PATH,
    ANN_RESTORED_FROM,
    CKPT_FAILED,
    CKPT_KIND,
    CKPT_PENDING,
    CKPT_READY,
    CKPT_RUNNING,
    ISVC_KIND,
    SERVING_LABEL,
)
from rekindle_operator.kube import Kube, KubeError
from rekindle_operator.pods import BUSY_STATES, Agents, CheckpointCall, read_token, service_pods
from rekindle_operator.quantity import human_bytes
from rekindle_operator.reconcile import (
    Emit,
    mapped_checkpoints,
    spec_of,
    update_pointer,
    with_mapped,
)
from rekindle_operator.selection import current_spec_pods, ready_pods
from rekindle_operator.settings import Settings, from_env, image_allowed
from rekindle_operator.spec_fingerprint import spec_fingerprint
from rekindle_operator.status import clip, now_iso, parse_time

Body = Mapping[str, Any]
Status = dict[str, Any]

DEFAULT_TIMEOUT_S = 1800
FINISHED = (CKPT_READY, CKPT_FAILED)


class Retry(Exception):
    """Not possible yet; the handler retries after `delay` seconds."""

    def __init__(self, message: str, delay: float = 10.0) -> None:
        super().__init__(message)
        self.delay = delay


def unfinished(status: Mapping[str, Any] | None) -> bool:
    return (status or {}).get("phase") not in FINISHED


def step(kube: Kube, body: Body, emit: Emit, agents: Agents) -> Status:
    """Advance one Checkpoint by one short step; returns its status afterwards."""
    meta = body["metadata"]
    # The caller's copy may predate this operator's own last write: read it fresh.
    current = kube.get(CKPT_KIND, meta["namespace"], meta["name"])
    if current is None or current["metadata"].get("deletionTimestamp"):
        return dict((current or body).get("status") or {})
    status = dict(current.get("status") or {})
    phase = status.get("phase") or CKPT_PENDING
    if phase in FINISHED:
        return status
    if phase == CKPT_RUNNING:
        return _watch(kube, current, emit, agents)
    return _start(kube, current, emit, agents)


def _start(kube: Kube, body: Body, emit: Emit, agents: Agents) -> Status:
    """Pending: find a pod whose agent is Ready, mark Running, start the agent's checkpoint."""
    meta, spec = body["metadata"], body.get("spec") or {}
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
    ahead = checkpoint_ahead(kube.list(CKPT_KIND, ns), body)
    if ahead:
        return _wait_for_turn(kube, body, emit, isvc_name, ahead)
    isvc_spec = spec_of(isvc)
    fingerprint = spec_fingerprint(isvc_spec)
    # Only pods the service's Deployment made may be checkpointed (and get its token).
    ours = service_pods(kube, ns, isvc_name)
    ready = ready_pods(ours, spec.get("pod"))
    if spec.get("keepServing") and len(ready_pods(ours)) < 2:
        return _wait_for_pod(
            kube,
            body,
            emit,
            isvc_name,
            ["keepServing: a second ready replica first, so one keeps serving"],
        )
    candidates, skipped = current_spec_pods(ready, fingerprint)
    token = read_token(kube, ns, isvc_name) if candidates else ""
    tls = isvc_spec.admin_tls is not None
    pod, not_ready = _checkpointable(candidates, token, agents, tls)
    if pod is None:
        return _wait_for_pod(kube, body, emit, isvc_name, skipped + not_ready)

    pod_name = pod["metadata"]["name"]
    path = b.checkpoint_path(meta["name"], meta["uid"])
    running = {
        "phase": CKPT_RUNNING,
        "reason": "Checkpointing",
        "message": f"pod {pod_name} is out of rotation while its agent checkpoints",
        "pod": pod_name,
        "path": path,
        # The pod runs this spec (current_spec_pods), so the data matches it.
        "fingerprint": fingerprint,
        "startedAt": now_iso(),
        # What deleting the data needs, even once the InferenceService is gone.
        "volume": b.checkpoint_volume(isvc_spec),
        "subPath": b.storage_subpath(ns, isvc_name),
        "storageType": isvc_spec.storage.type,
        # Where the node agent publishes it once proven (objectStore: deleting it asks one).
        "published": isvc_spec.storage.publish,
        "node": (pod.get("spec") or {}).get("nodeName", ""),
        "image": isvc_spec.image,
        "imagePullPolicy": isvc_spec.image_pull_policy,
        # The pod is reached over HTTPS from now on, whatever the spec becomes.
        "adminTLS": tls,
    }
    _set_status(kube, body, running)
    emit("Normal", "CheckpointStarted", f"checkpointing pod {pod_name} into {path}")
    set_serving(kube, ns, pod_name, False)
    agents.start_checkpoint(
        meta["uid"],
        pod,
        token,
        path,
        timeout=_timeout(body),
        # Back in the Service as soon as the agent answers, whatever the answer.
        then=lambda: set_serving(kube, ns, pod_name, True),
        tls_required=tls,
    )
    return running


def _watch(kube: Kube, body: Body, emit: Emit, agents: Agents) -> Status:
    """Running: record the agent's answer once there is one; meanwhile note its state."""
    uid = body["metadata"]["uid"]
    call = agents.checkpoint_call(uid)
    if call is not None and call.done():
        agents.forget(uid)
        return _record(kube, body, emit, call)
    pod, reply, error = _ask_agent(kube, body, agents)
    if call is None:  # started by an operator process that is gone
        return _recover(kube, body, emit, pod, reply, error)
    status = dict(body.get("status") or {})
    if reply is not None and status.get("agentState") != reply.state:
        status["agentState"] = reply.state
        _set_status(kube, body, {"agentState": reply.state})
    return status


def _ask_agent(
    kube: Kube, body: Body, agents: Agents
) -> tuple[Body | None, StatusReply | None, str | None]:
    """The Running checkpoint's pod (None if gone) and what its agent says now."""
    meta, status = body["metadata"], body.get("status") or {}
    pod = kube.get("Pod", meta["namespace"], status["pod"]) if status.get("pod") else None
    if pod is None or not (pod.get("status") or {}).get("podIP"):
        return None, None, "pod gone"
    token = read_token(kube, meta["namespace"], body["spec"]["inferenceService"])
    return (pod, *agents.ask_status(pod, token, bool(status.get("adminTLS"))))


def _record(kube: Kube, body: Body, emit: Emit, call: CheckpointCall) -> Status:
    status = body.get("status") or {}
    set_serving(kube, body["metadata"]["namespace"], call.pod, True)
    if call.manifest is not None and call.error is None:
        # The agent verified the checkpoint by restoring it in this pod: its
        # memory now maps the new files, so they are kept while the pod lives.
        mark_mapped(kube, body["metadata"]["namespace"], call.pod, call.path)
    if call.error is not None or call.manifest is None:
        return _fail(
            kube,
            body,
            emit,
            "AgentCheckpointFailed",
            f"pod {call.pod} kept serving; the agent said: {call.error}",
        )
    result = _result_status(call.manifest, status.get("startedAt") or now_iso(), "", call.published)
    _set_status(kube, body, result)
    emit(
        "Normal",
        "CheckpointReady",
        f"{result['size']} in {result['totalSeconds']:.1f}s from pod {call.pod}",
    )
    _point_new_replicas(kube, body)
    return {**status, **result}


def _recover(
    kube: Kube,
    body: Body,
    emit: Emit,
    pod: Body | None,
    reply: StatusReply | None,
    error: str | None,
) -> Status:
    """The operator restarted while this Checkpoint was Running: finish or fail it cleanly."""
    meta, status = body["metadata"], body.get("status") or {}
    ns, pod_name, path = meta["namespace"], status.get("pod", ""), status.get("path", "")
    if pod is None:
        return _fail(
            kube,
            body,
            emit,
            "PodGone",
            f"pod {pod_name!r} went away during the checkpoint: create a new Checkpoint",
        )
    busy = reply is None or reply.state in BUSY_STATES
    if busy and not _timed_out(body):
        return dict(status)  # the agent is still at it (or briefly unreachable): look again
    set_serving(kube, ns, pod_name, True)
    last = (reply.last_checkpoint if reply else None) or {}
    if last.get("dir") == path and last.get("ok"):
        mark_mapped(kube, ns, pod_name, path)  # verified by restoring it in this pod
        result = _result_status(
            {"timings": last.get("timings") or {}},
            status.get("startedAt") or now_iso(),
            " (recorded after an operator restart, from the agent's status)",
            last.get("published"),
        )
        _set_status(kube, body, result)
        emit(
            "Normal", "CheckpointReady", f"pod {pod_name} finished it while the operator restarted"
        )
        _point_new_replicas(kube, body)
        return result
    if last.get("dir") == path:
        return _fail(
            kube,
            body,
            emit,
            "AgentCheckpointFailed",
            f"pod {pod_name} kept serving; the agent said: {last.get('error')}",
        )
    return _fail(
        kube,
        body,
        emit,
        "OperatorRestarted",
        f"the operator restarted while pod {pod_name} was checkpointing and the agent "
        f"({_describe(reply, error)}) reports no finished checkpoint at {path}; pod "
        f"{pod_name} is serving again: create a new Checkpoint",
    )


def has_data(body: Body) -> bool:
    """A Checkpoint whose deletion must do something: data to remove, or an agent to wait for."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    if status.get("phase") == CKPT_RUNNING:
        return True
    if "emptyDir" in (status.get("volume") or {}) and not _in_object_store(status):
        return False  # in a node agent's cache: evicted there by its budget, nothing to remove
    return bool(
        status.get("path")
        and status.get("volume")
        and status.get("image")
        and spec.get("deletionPolicy", "Delete") == "Delete"
    )


def _in_object_store(status: Mapping[str, Any]) -> bool:
    return status.get("published") == "objectStore"


def delete_data(
    kube: Kube,
    body: Body,
    emit: Emit,
    agents: Agents,
    waited_s: float = 0.0,
    settings: Settings | None = None,
) -> str:
    """Apply spec.deletionPolicy when a Checkpoint is deleted; returns what was done.

    Raises Retry while that must wait: a Checkpoint deleted while its agent
    still writes waits for the agent (its files would be half removed
    otherwise), then puts the pod back in rotation; the data of a checkpoint
    that live pods were restored from waits until those pods are gone (their
    memory maps its files). Creating the cleanup Job is retried for at most
    settings.delete_timeout_s (waited_s: seconds since the deletion was first
    handled); then, or at once when the namespace is being deleted, the
    Checkpoint is let go with a Warning Event naming the data left behind, so
    a finalizer never holds a namespace forever.
    """
    settings = settings or from_env()
    meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
    ns = meta["namespace"]
    if status.get("phase") == CKPT_RUNNING:
        _wait_until_agent_done(kube, body, agents)
        set_serving(kube, ns, status.get("pod", ""), True)
    path = status.get("path")
    if not path or not status.get("volume") or not status.get("image"):
        return "nothing to delete"
    if spec.get("deletionPolicy", "Delete") == "Retain":
        return f"retained {path}"
    # Replicas restored from it map the node cache's copy, never the published one:
    # the store's copy goes at once (a node agent keeps a mapped cache entry).
    from_store = _in_object_store(status)
    users = (
        []
        if from_store
        else pods_using(kube, body, unknown_too=waited_s < settings.delete_timeout_s)
    )
    if users:
        raise Retry(
            f"keeping {path} while pods {', '.join(users)} use it "
            "(restored memory maps its files); deleted once they are gone",
            delay=10,
        )
    where = _data_location(status, path)
    if not image_allowed(status["image"], settings.allowed_images):
        return _let_go(emit, f"{where} left in place: its image is no longer allowed")
    job = b.build_cleanup_job(
        ns,
        meta["name"],
        meta["uid"],
        path,
        status["volume"],
        status["image"],
        status.get("imagePullPolicy", "IfNotPresent"),
        sub_path=status.get("subPath", ""),
        node=status.get("node", ""),
        written_by_node_agent=status.get("storageType") == "node",
        from_store=from_store,
    )
    try:
        kube.create_if_absent(job)
    except KubeError as e:
        if not (e.status == 403 and "being terminated" in e.message):
            if waited_s < settings.delete_timeout_s:
                raise Retry(f"cannot create the cleanup Job yet: {e}", delay=15) from e
            return _let_go(
                emit, f"{where} left in place: no cleanup Job after {waited_s:.0f}s ({e})"
            )
        # The namespace is going away: no new Job may start in it. hostPath data
        # outlives it, so remove it from the operator's own namespace if known.
        if "hostPath" in status["volume"] and settings.operator_namespace:
            job["metadata"]["namespace"] = settings.operator_namespace
            job["metadata"]["name"] = b.cleanup_job_name(f"{ns}-{meta['name']}", meta["uid"])
            try:
                kube.create_if_absent(job)
            except KubeError as e2:
                return _let_go(emit, f"{where} left in place: namespace {ns} is terminating ({e2})")
        else:
            return _let_go(
                emit,
                f"{where} left in place: namespace {ns} is terminating"
                + (
                    " (the PVC goes with it)" if "persistentVolumeClaim" in status["volume"] else ""
                ),
            )
    emit("Normal", "CheckpointDataDeleted", f"deleting {where} (deletionPolicy Delete)")
    return f"deleting {path}"


def _data_location(status: Mapping[str, Any], path: str) -> str:
    vol = status.get("volume") or {}
    sub = status.get("subPath", "")
    rel = path.removeprefix(CHECKPOINT_MOUNT).lstrip("/")
    if _in_object_store(status):
        return f"checkpoint {rel} in the node agents' object store"
    if "hostPath" in vol:
        host = "/".join(p for p in (vol["hostPath"].get("path", ""), sub, rel) if p)
        return f"checkpoint data {host} on node {status.get('node') or '?'}"
    claim = (vol.get("persistentVolumeClaim") or {}).get("claimName", "?")
    return f"checkpoint data {'/'.join(p for p in (sub, rel) if p)} on PVC {claim}"


def _let_go(emit: Emit, message: str) -> str:
    emit("Warning", "CheckpointDataRetained", message)
    return message


def pods_using(kube: Kube, body: Body, unknown_too: bool = True) -> list[str]:
    """Live pods of the Checkpoint's InferenceService whose memory may map its files.

    Known: pods whose agent reported a restore from it (annotation
    ANN_RESTORED_FROM, also set on the pod that made it, which verified it by
    restoring). With unknown_too: pods created since it became Ready that have
    not reported how they came up yet (they may be restoring from it now).
    """
    meta, status = body["metadata"], body.get("status") or {}
    path, completed = status.get("path", ""), status.get("completedAt") or ""
    isvc = (body.get("spec") or {}).get("inferenceService", "")
    out = []
    for pod in kube.list("Pod", meta["namespace"], b.selector_string(isvc)):
        pmeta = pod.get("metadata") or {}
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        unknown = (
            not (pmeta.get("annotations") or {}).get(ANN_BOOT_PATH)
            and completed
            and pmeta.get("creationTimestamp", "") >= completed
        )
        if path in mapped_checkpoints(pod) or (unknown_too and unknown):
            out.append(pmeta["name"])
    return sorted(out)


def mark_mapped(kube: Kube, namespace: str, pod: str, path: str) -> None:
    """Record on pod that its memory maps files of the checkpoint at path."""
    current = kube.get("Pod", namespace, pod)
    if current is None:
        return
    ann = current["metadata"].get("annotations") or {}
    value = with_mapped(ann, path)
    if ann.get(ANN_RESTORED_FROM) != value:
        kube.merge_patch(
            "Pod", namespace, pod, {"metadata": {"annotations": {ANN_RESTORED_FROM: value}}}
        )


def _wait_until_agent_done(kube: Kube, body: Body, agents: Agents) -> None:
    uid = body["metadata"]["uid"]
    call = agents.checkpoint_call(uid)
    if call is not None and not call.done():
        raise Retry(f"pod {call.pod} is still checkpointing into {call.path}")
    agents.forget(uid)
    if call is None:  # started by an operator process that is gone: ask the agent
        _, reply, _ = _ask_agent(kube, body, agents)
        if reply is not None and reply.state in BUSY_STATES and not _timed_out(body):
            raise Retry(f"the agent is still checkpointing ({reply.state})")


def set_serving(kube: Kube, namespace: str, pod: str, serving: bool) -> None:
    """Add or remove the label the Service selects on; a vanished pod is fine."""
    if not pod:
        return
    value = "true" if serving else None
    try:
        kube.merge_patch("Pod", namespace, pod, {"metadata": {"labels": {SERVING_LABEL: value}}})
    except KubeError as e:
        if e.status != 404:
            raise


def _checkpointable(
    candidates: list[Body], token: str, agents: Agents, tls_required: bool = False
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
        reply, error = agents.ask_status(pod, token, tls_required)
        if reply is None:
            skipped.append(f"pod {name}: {error}")
        elif reply.state != "Ready":
            skipped.append(f"pod {name}: agent is {reply.state}, not Ready")
        else:
            ready.append((reply.restored_with_mmap, pod))
    if not ready:
        return None, skipped
    return min(ready, key=lambda r: r[0])[1], skipped


def checkpoint_ahead(checkpoints: list[dict[str, Any]], body: Body) -> str:
    """The Checkpoint of the same InferenceService this one waits for, or "".

    One at a time per service: each takes a replica out of rotation, and two at
    once could take every replica. A Running one goes first, then Pending ones
    in order of creation (name breaks ties), so two Pending ones stepped at the
    same moment never both start.
    """
    meta = body["metadata"]
    isvc = (body.get("spec") or {}).get("inferenceService")
    mine = (meta.get("creationTimestamp") or "", meta["name"])
    for c in sorted(
        checkpoints,
        key=lambda c: (c["metadata"].get("creationTimestamp") or "", c["metadata"]["name"]),
    ):
        m, st = c["metadata"], c.get("status") or {}
        if m["name"] == meta["name"] or (c.get("spec") or {}).get("inferenceService") != isvc:
            continue
        if m.get("deletionTimestamp") or st.get("phase") in FINISHED:
            continue
        ahead = st.get("phase") == CKPT_RUNNING
        older = (m.get("creationTimestamp") or "", m["name"]) < mine
        if ahead or older:
            return str(m["name"])
    return ""


def _wait(
    kube: Kube, body: Body, emit: Emit, reason: str, why: str, failure: tuple[str, str]
) -> Status:
    """Stay Pending with reason and why (written only when it changes), or, once the
    Checkpoint is older than its timeout, fail with failure (reason, message)."""
    meta, status = body["metadata"], body.get("status") or {}
    age = (parse_time(now_iso()) - parse_time(meta["creationTimestamp"])).total_seconds()
    if age > _timeout(body):
        return _fail(kube, body, emit, *failure)
    waiting = {"phase": CKPT_PENDING, "reason": reason, "message": why}
    if status.get("message") != why:
        _set_status(kube, body, waiting)
    return {**status, **waiting}


def _wait_for_turn(kube: Kube, body: Body, emit: Emit, isvc_name: str, ahead: str) -> Status:
    why = (
        f"waiting for Checkpoint {ahead} of {isvc_name} to finish: one checkpoint per "
        "InferenceService at a time (each takes a replica out of rotation)"
    )
    busy = (
        f"Checkpoint {ahead} of {isvc_name} was still in progress after {_timeout(body)}s; "
        "retry once it is finished"
    )
    return _wait(kube, body, emit, "WaitingForCheckpoint", why, ("CheckpointBusy", busy))


def _wait_for_pod(kube: Kube, body: Body, emit: Emit, isvc_name: str, skipped: list[str]) -> Status:
    why = f"waiting for a pod of {isvc_name} to checkpoint: " + (
        "; ".join(skipped) or "none is ready"
    )
    none = f"no ready pod of {isvc_name} within {_timeout(body)}s: scale it up and retry"
    return _wait(kube, body, emit, "WaitingForPod", why, ("NoReadyPod", none))


def _point_new_replicas(kube: Kube, body: Body) -> None:
    ns = body["metadata"]["namespace"]
    isvc = kube.get(ISVC_KIND, ns, body["spec"]["inferenceService"])
    if isvc is not None:
        update_pointer(kube, isvc, spec_of(isvc), kube.list(CKPT_KIND, ns))


def _adopt(kube: Kube, body: Body, isvc: Body) -> None:
    """Checkpoint objects go with their InferenceService (its data per deletionPolicy)."""
    refs = body["metadata"].get("ownerReferences") or []
    if any(r.get("uid") == isvc["metadata"]["uid"] for r in refs):
        return
    ref = {**b.owner_reference({**isvc, "kind": ISVC_KIND}), "controller": False}
    kube.merge_patch(
        CKPT_KIND,
        body["metadata"]["namespace"],
        body["metadata"]["name"],
        {"metadata": {"ownerReferences": [*refs, ref]}},
    )


def _timeout(body: Body) -> int:
    return int((body.get("spec") or {}).get("timeoutSeconds") or DEFAULT_TIMEOUT_S)


def _timed_out(body: Body) -> bool:
    started = (body.get("status") or {}).get("startedAt")
    if not started:
        return False
    return (parse_time(now_iso()) - parse_time(started)).total_seconds() > _timeout(body)


def _describe(reply: StatusReply | None, error: str | None) -> str:
    return f"now {reply.state}" if reply is not None else (error or "not answering")


def _set_status(kube: Kube, body: Body, status: Mapping[str, Any]) -> None:
    meta, patch = body["metadata"], dict(status)
    if patch.get("phase") in FINISHED:
        patch["agentState"] = None  # only meaningful while Running (merge patch: removed)
    kube.merge_patch(CKPT_KIND, meta["namespace"], meta["name"], {"status": patch}, "status")


def _fail(kube: Kube, body: Body, emit: Emit, reason: str, message: str) -> Status:
    st = {"phase": CKPT_FAILED, "reason": reason, "message": message, "completedAt": now_iso()}
    _set_status(kube, body, st)
    emit("Warning", reason, message)
    return {**(body.get("status") or {}), **st}


def _result_status(
    manifest: Mapping[str, Any], started: str, how: str, published: str | None = None
) -> Status:
    """Ready: the agent answers success only after it restored the new checkpoint once.
    published: where the node agent published it, or why not (the agent's words)."""
    summary = {**manifest_summary(manifest), "verified": True}
    out = {
        "phase": CKPT_READY,
        "reason": "Verified",
        "message": f"checkpoint written and restored once by the agent{how}",
        "totalSeconds": (parse_time(now_iso()) - parse_time(started)).total_seconds(),
        "completedAt": now_iso(),
        "stale": False,
        **summary,
    }
    if published:
        out["publication"] = clip(str(published), 500)
    if summary["files"]:
        out["size"] = human_bytes(summary["sizeBytes"])
    else:  # recovered from the agent's status: no file list, so no size
        out.pop("sizeBytes")
        out.pop("files")
    return out


MAX_PHASES = 32  # phase timings recorded from a manifest (the agent reports about 10)


def manifest_summary(manifest: Mapping[str, Any]) -> Status:
    """What a Checkpoint's status records from the agent's manifest."""
    files = manifest.get("files") or []
    fingerprint = json.dumps(manifest.get("fingerprint") or {}, sort_keys=True).encode()
    return {
        "sizeBytes": sum(int(f.get("size", 0)) for f in files),
        "files": len(files),
        # The agent's phase names, bounded: its manifest is its own word, not ours.
        "phaseSeconds": {
            clip(k, 64): round(float(v), 3)
            for k, v in list((manifest.get("timings") or {}).items())[:MAX_PHASES]
        },
        "agentFingerprint": hashlib.sha256(fingerprint).hexdigest()[:16],
        "verified": bool(manifest.get("verified")),
        **weights_summary(manifest),
    }


def weights_summary(manifest: Mapping[str, Any]) -> Status:
    """weightsBytes (the dump a restore reloads) and, on GPU, gpuMemoryAfterSleepBytes
    (what cuda-checkpoint copied to host memory), where the manifest has them."""
    out: Status = {}
    weights = manifest.get("weights") or {}
    prefix = str(weights.get("dir") or "weights").rstrip("/") + "/"
    dumped = [int(f.get("size", 0)) for f in manifest.get("files") or []]
    names = [str(f.get("path", "")) for f in manifest.get("files") or []]
    total = sum(n for n, p in zip(dumped, names, strict=True) if p.startswith(prefix))
    if weights.get("released") and total:
        out["weightsBytes"] = total
    left = weights.get("gpu_memory_after_release_bytes")
    if isinstance(left, int) and not isinstance(left, bool) and left >= 0:
        out["gpuMemoryAfterSleepBytes"] = left
    return out
