"""InferenceService status from what the operator observes (pure functions).

Inputs: the parsed spec, the Deployment, its pods, what each pod's agent said
(or why it could not be asked), the checkpoint in use. Output: the status
dict, and the transitions worth an Event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rekindle_contract.api import StatusReply

from rekindle_operator.constants import (
    ANN_AGENT_READY,
    COND_CHECKPOINT_READY,
    COND_READY,
    COND_RESTORED,
    COND_SHM_SIZED,
)
from rekindle_operator.selection import pod_ready

Body = Mapping[str, Any]


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(ts: str) -> datetime:
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


@dataclass(frozen=True)
class PodBoot:
    """How one pod's vLLM came up, as its agent reports it."""

    name: str
    ready: bool
    origin: str  # booted | restored | unknown
    reason: str  # why it booted rather than restored ("" when restored)
    checkpoint: str | None
    cold_start_seconds: float | None  # pod creation -> Ready
    agent_ready_seconds: float | None = None  # agent start -> first Ready (agent's clock)
    memory: str = ""  # restored: "mmap" (mapped from the images) or "copy"
    memory_reason: str = ""  # why the agent chose that path
    stuck: bool = False  # Kubernetes holds the pod back (reason: pod_problem's words)
    # Its checkpoint in the node's page cache, as the agent measured it (vmtouch).
    page_cache: Mapping[str, Any] | None = None
    node: str = ""  # the node it runs on
    path: str = ""  # how it came up: COLD_START_PATHS, "" while not known
    # Restored: each phase of its restore, in seconds, as its agent reports them.
    restore_seconds: Mapping[str, float] | None = None


# How a replica came up: booted vLLM; restored a checkpoint its node held (the node
# cache or the pod's volume); restored after its node agent pulled the checkpoint
# from shared storage (a PVC or the object store), verifying it on the way.
COLD_START_PATHS = ("boot", "restore", "restoreAfterPull")


def cold_start_path(agent: StatusReply) -> str:
    if agent.origin == "booted":
        return "boot"
    if agent.origin != "restored":
        return ""
    return "restoreAfterPull" if "pull" in (agent.timings.get("restore") or {}) else "restore"


def page_cache(agent: StatusReply | None) -> dict[str, Any] | None:
    """The agent's residency report, for the pod's status: percent and bytes."""
    doc = agent.residency if agent is not None else None
    if not doc:
        return None
    return {
        "residentPercent": float(doc.get("percent", 0.0)),
        "residentBytes": int(doc.get("resident_bytes", 0)),
        "bytes": int(doc.get("bytes", 0)),
    }


def cold_start_seconds(pod: Body) -> float | None:
    """Pod creation to its Ready condition: the user-visible cold start."""
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    for cond in (pod.get("status") or {}).get("conditions") or []:
        ready_at = cond.get("lastTransitionTime")
        if cond.get("type") == "Ready" and cond.get("status") == "True" and created and ready_at:
            return (parse_time(ready_at) - parse_time(created)).total_seconds()
    return None


def agent_ready_seconds(pod: Body, agent: StatusReply | None) -> float | None:
    """Agent start to its first Ready: recorded on the pod once, else from the agent.

    The agent's ready_at is its latest Ready; after a checkpoint (drain, dump,
    verify, Ready again) it no longer measures the start, so only an agent that
    has not checkpointed yet is asked.
    """
    recorded = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANN_AGENT_READY)
    if recorded:
        try:
            return float(recorded)
        except ValueError:
            pass
    if agent is None or agent.last_checkpoint is not None:
        return None
    return agent.start_to_ready_seconds()


# Container waiting reasons that are the normal way up, not a problem to report.
_STARTING = ("ContainerCreating", "PodInitializing")
# What an agent says goes into status only this long: a pod's answer is not trusted to be
# small, and status is read by every kubectl get and watch.
MAX_AGENT_TEXT = 512


def clip(text: object, limit: int = MAX_AGENT_TEXT) -> str:
    """text as a string of at most limit characters (an ellipsis marks a cut)."""
    out = str(text)
    return out if len(out) <= limit else out[: limit - 1] + "…"


def pod_problem(pod: Body) -> str | None:
    """Why a pod is not running, as Kubernetes says it: the scheduler's refusal
    (Unschedulable: ... untolerated taint, insufficient nvidia.com/gpu) or a
    container stuck waiting (ImagePullBackOff, CreateContainerConfigError for a
    missing Secret key, CrashLoopBackOff). None while it is on its normal way up.
    """
    st = pod.get("status") or {}
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            reason = cond.get("reason") or "NotScheduled"
            return f"{reason}: {cond.get('message') or 'not scheduled yet'}"[:500]
    statuses = [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason not in _STARTING:
            msg = waiting.get("message") or ""
            return f"{reason}: {cs.get('name')}" + (f": {msg}" if msg else "")
    return None


def pod_boot(pod: Body, agent: StatusReply | None, agent_error: str | None) -> PodBoot:
    """Combine the pod object with its agent's /v1/status reply (or the error asking it)."""
    name = pod["metadata"]["name"]
    if agent is None or agent.origin not in ("booted", "restored"):
        problem = pod_problem(pod) if agent is None else None
        why = problem or agent_error or "agent not answering"
        if agent is not None:  # still booting or restoring: how it comes up is not known yet
            why = f"agent is {agent.state}" + (f": {agent.message}" if agent.message else "")
        return PodBoot(
            name,
            pod_ready(pod),
            "unknown",
            clip(why),
            None,
            cold_start_seconds(pod),
            agent_ready_seconds(pod, agent),
            stuck=problem is not None,
        )
    origin = agent.origin
    fallback = agent.last_fallback or {}
    reason = ""
    if origin != "restored":
        reason = str(fallback.get("reason") or "no checkpoint to restore")
        if fallback.get("message"):
            reason += f": {fallback['message']}"
    memory = (agent.restore_memory or {}) if origin == "restored" else {}
    return PodBoot(
        name,
        pod_ready(pod),
        origin,
        clip(reason),
        clip(agent.checkpoint) if agent.checkpoint else agent.checkpoint,
        cold_start_seconds(pod),
        agent_ready_seconds(pod, agent),
        clip(memory.get("path") or "", 64),
        clip(memory.get("why") or ""),
        page_cache=page_cache(agent),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        path=cold_start_path(agent),
        restore_seconds=restore_phases(agent) if origin == "restored" else None,
    )


MAX_RESTORE_PHASES = 32  # the agent reports about 15


def restore_phases(agent: StatusReply) -> dict[str, float]:
    """The agent's restore phases, bounded: its report is its own word, not ours."""
    out = {}
    for k, v in list((agent.timings.get("restore") or {}).items())[:MAX_RESTORE_PHASES]:
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[clip(str(k), 64)] = round(float(v), 3)
    return out


def set_condition(
    conditions: list[dict[str, Any]], ctype: str, status: bool, reason: str, message: str
) -> list[dict[str, Any]]:
    """A new list with ctype set; lastTransitionTime moves only when the status flips."""
    value = "True" if status else "False"
    out = [dict(c) for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    ts = old["lastTransitionTime"] if old and old.get("status") == value else now_iso()
    out.append(
        {
            "type": ctype,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": ts,
        }
    )
    return sorted(out, key=lambda c: str(c["type"]))


@dataclass(frozen=True)
class Observed:
    spec_replicas: int
    deployment: Body | None
    pods: tuple[PodBoot, ...]
    checkpoint: str | None  # name of the Checkpoint new pods restore from
    shm_bytes: int
    shm_need: Mapping[str, int]
    shm_error: str | None
    selector: str
    endpoint: str
    checkpoint_path: str | None = None  # that Checkpoint's directory (what agents report)


def node_summary(pods: tuple[PodBoot, ...], checkpoint: str | None) -> list[dict[str, Any]]:
    """Per node that runs a replica: how many, how its Ready ones came up (the slowest
    per path: boot, restore, restoreAfterPull), and whether the node holds the current
    checkpoint (a replica there restored from it: its node agent verified it into the
    node's cache) and how much of it is resident.

    What placement prefers and `kubectl rekindle status` prints. A node whose
    replicas all booted may still hold it (pulled for a replica that then failed):
    this says only what the replicas prove.
    """
    out = []
    for node in sorted({p.node for p in pods if p.node}):
        mine = [p for p in pods if p.node == node]
        holding = [p for p in mine if p.origin == "restored" and p.checkpoint == checkpoint]
        resident = [
            float(p.page_cache.get("residentPercent", 0.0)) for p in holding if p.page_cache
        ]
        doc: dict[str, Any] = {
            "name": node,
            "replicas": len(mine),
            "ready": sum(1 for p in mine if p.ready),
            "checkpointCached": bool(checkpoint) and bool(holding),
        }
        if resident:
            doc["residentPercent"] = max(resident)
        seconds = _slowest_by_path([p for p in mine if p.ready and p.path])
        if seconds:
            doc["coldStartSeconds"] = seconds
        out.append(doc)
    return out


def _slowest_by_path(pods: list[PodBoot]) -> dict[str, float]:
    """Per cold-start path, the slowest of these replicas (pod creation to Ready)."""
    out: dict[str, float] = {}
    for p in pods:
        if p.cold_start_seconds is not None:
            out[p.path] = max(out.get(p.path, 0.0), round(p.cold_start_seconds, 1))
    return out


def compute_status(old: Body, obs: Observed) -> dict[str, Any]:
    """The InferenceService status for obs; old supplies conditions and last timings."""
    dep_status = (obs.deployment or {}).get("status") or {}
    replicas = int(dep_status.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    conds: list[dict[str, Any]] = list(old.get("conditions") or [])

    if obs.shm_error:
        conds = set_condition(conds, COND_SHM_SIZED, False, "BelowNeed", obs.shm_error)
        phase = "Failed"
    else:
        conds = set_condition(
            conds, COND_SHM_SIZED, True, "Sized", f"/dev/shm is {obs.shm_bytes // 2**20}Mi"
        )
        if obs.deployment is None:
            phase = "Pending"
        elif obs.spec_replicas == 0:
            phase = "ScaledToZero" if replicas == 0 else "Progressing"
        elif ready >= obs.spec_replicas and replicas == obs.spec_replicas:
            phase = "Ready"
        elif ready > 0:
            phase = "Degraded" if replicas >= obs.spec_replicas else "Progressing"
        else:
            phase = "Progressing"

    if ready > 0:
        conds = set_condition(conds, COND_READY, True, "ReplicasReady", f"{ready} ready")
    else:
        why = "ScaledToZero" if obs.spec_replicas == 0 else "NoReadyReplica"
        msg = f"0 of {obs.spec_replicas} ready"
        stuck = [p for p in obs.pods if p.stuck]
        if stuck and obs.spec_replicas:
            # The first pod's problem (Unschedulable, ImagePullBackOff...) where
            # `kubectl get`/`describe` of the InferenceService shows it.
            msg += f": pod {stuck[0].name} {stuck[0].reason}"
        conds = set_condition(conds, COND_READY, False, why, msg[:1000])

    if obs.checkpoint:
        conds = set_condition(
            conds,
            COND_CHECKPOINT_READY,
            True,
            "Available",
            f"new replicas restore from Checkpoint {obs.checkpoint}",
        )
    else:
        conds = set_condition(
            conds,
            COND_CHECKPOINT_READY,
            False,
            "NoCheckpoint",
            "no Ready checkpoint matches the current spec: `kubectl rekindle checkpoint` makes one",
        )

    known = [p for p in obs.pods if p.origin in ("booted", "restored")]
    if known:
        restored = [p for p in known if p.origin == "restored"]
        booted = [p for p in known if p.origin == "booted"]
        msg = "; ".join(
            [f"{p.name} restored from {p.checkpoint}" for p in restored]
            + [f"{p.name} booted: {p.reason}" for p in booted]
        )
        conds = set_condition(
            conds, COND_RESTORED, not booted, "AllRestored" if not booted else "SomeBooted", msg
        )

    last = dict(old.get("lastColdStartSeconds") or {})
    for p in obs.pods:
        if p.ready and p.cold_start_seconds is not None and p.origin in ("booted", "restored"):
            last[p.origin] = round(p.cold_start_seconds, 1)
            if p.path == "restoreAfterPull":
                last["restoredAfterPull"] = round(p.cold_start_seconds, 1)

    return {
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": obs.selector,
        "endpoint": obs.endpoint,
        "checkpoint": obs.checkpoint or "",
        "sharedMemory": {"size": f"{obs.shm_bytes // 2**20}Mi", **obs.shm_need},
        "lastColdStartSeconds": last,
        "pods": [
            {
                "name": p.name,
                "ready": p.ready,
                "origin": p.origin,
                "reason": p.reason,
                "checkpoint": p.checkpoint or "",
                **_seconds("coldStartSeconds", p.cold_start_seconds),
                **_seconds("agentReadySeconds", p.agent_ready_seconds),
                **({"memory": p.memory, "memoryReason": p.memory_reason[:300]} if p.memory else {}),
                **({"pageCache": dict(p.page_cache)} if p.page_cache else {}),
                **({"node": p.node} if p.node else {}),
                **({"coldStartPath": p.path} if p.path else {}),
                **({"restoreSeconds": dict(p.restore_seconds)} if p.restore_seconds else {}),
            }
            for p in obs.pods
        ],
        "nodes": node_summary(obs.pods, obs.checkpoint_path),
        "conditions": conds,
    }


def _seconds(key: str, value: float | None) -> dict[str, float]:
    return {} if value is None else {key: round(value, 1)}


# What a node agent says when it restored a checkpoint by copying because a replica
# restored from it with mapped memory died (rekindle_node.operations.mapped_failed).
MAPPED_RESTORE_OFF = "died after a mapped restore"


def transitions(old: Body, new: Body) -> list[tuple[str, str, str]]:
    """(type Normal|Warning, reason, message) for each phase or condition change, and for
    each pod newly restored by copying because a mapped restore of its checkpoint died."""
    events: list[tuple[str, str, str]] = []
    seen = {
        p.get("name")
        for p in old.get("pods") or []
        if MAPPED_RESTORE_OFF in str(p.get("memoryReason"))
    }
    for p in new.get("pods") or []:
        why = str(p.get("memoryReason") or "")
        if p.get("memory") == "copy" and MAPPED_RESTORE_OFF in why and p.get("name") not in seen:
            events.append(("Warning", "MappedRestoreOff", f"pod {p.get('name')}: {why}"))
    if old.get("phase") != new.get("phase"):
        kind = "Warning" if new.get("phase") in ("Failed", "Degraded") else "Normal"
        events.append((kind, f"Phase{new.get('phase')}", f"phase is now {new.get('phase')}"))
    old_c = {c["type"]: c for c in old.get("conditions") or []}
    for c in new.get("conditions") or []:
        prev = old_c.get(c["type"])
        if prev is None or prev.get("status") != c["status"] or prev.get("reason") != c["reason"]:
            # Not-yet-true at first sight (no replica ready yet, no checkpoint yet)
            # is the normal start, not a warning; a real problem always is one.
            expected = prev is None and c["type"] != COND_SHM_SIZED
            ok = c["status"] == "True" or expected or c["reason"] == "ScaledToZero"
            kind = "Normal" if ok else "Warning"
            events.append((kind, f"{c['type']}{c['reason']}", str(c["message"])[:1000]))
    return events
