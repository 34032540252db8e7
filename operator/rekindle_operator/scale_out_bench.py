"""`kubectl rekindle bench NAME --scale-out`: a service at N replicas gets one more, on
(a) a node whose cache holds the checkpoint, (b) a node that must pull it from the
shared store, (c) a naive boot; pod creation to first token, arms rotating per trial.

What it does per trial and arm, all through the Kubernetes API:

- cached: the new replica goes to the warm node (the node the checkpoint was made
  on, or one a replica restored it on);
- pull: first a Job on the cold node asks its node agent to drop that node's
  cached copy (`rekindle remove-checkpoint --from-node-cache`: the namespace's
  own checkpoint only, never one a replica there maps), then the new replica goes
  to the cold node, whose node agent pulls the checkpoint, verifies every byte
  and restores;
- naive: coldStart.restorePolicy Never (it reaches pods through the restore
  pointer only: no serving replica restarts), the new replica on the cold node.

The replica is steered by cordoning every other node from the scale request until
the new pod is bound (each node cordoned here is uncordoned right after, and on any
error): the bench needs `patch` on nodes, as `kubectl drain` does, and runs where a
brief cordon is acceptable. Timed from the scale request to the new pod's Ready
condition and to the first token of a one-token greedy completion sent to that pod
through the apiserver's pod proxy (the Service would route to the N replicas already
serving). Then the new pod gets the lowest pod-deletion-cost and the service goes
back to N. Residency: the service's status for the target node (cached, resident %)
just before each trial.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rekindle_operator import builders as b
from rekindle_operator import cluster_bench, pods
from rekindle_operator.kube import Kube
from rekindle_operator.selection import pod_ready
from rekindle_operator.spec import parse_spec

ARMS = ("cached", "pull", "naive")
# What the figures time, written into every results file.
TIMING = (
    "Per trial and arm (arms rotating): the service at N Ready replicas; every node but "
    "the target cordoned until the new pod is bound; from the request that scales it to "
    "N+1 to (ready_s) the new pod's Ready condition and (first_token_s) the first token "
    "of a one-token greedy completion answered by that pod through the apiserver's pod "
    "proxy, asked only once it is Ready; agent_ready_s: agent start to Ready on the "
    "agent's clock. cached: the target holds the checkpoint; pull: its node agent's copy "
    "was dropped just before; naive: restorePolicy Never. cache_before: the service's "
    "status for the target node just before."
)
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass
class ScaleOutTrial(cluster_bench.Trial):
    target_node: str = ""
    cache_before: dict[str, Any] = field(default_factory=dict)  # status.nodes[] of that node
    cold_start_path: str = ""  # boot | restore | restoreAfterPull, as the status said
    restore_seconds: dict[str, float] = field(default_factory=dict)  # its phases (pull first)


@dataclass(frozen=True)
class Plan:
    """What every trial needs, settled once before the first."""

    ns: str
    name: str
    model: str
    replicas: int  # N: the replicas serving before and after each trial
    warm_node: str
    cold_node: str
    checkpoint_path: str  # the name the node agents know the checkpoint by
    image: str
    pull_policy: str
    tolerations: list[dict[str, Any]]


def plan(kube: Kube, ns: str, name: str, warm: str | None, cold: str | None) -> Plan:
    """Check the service can be benched this way; pick the nodes (SystemExit: why not)."""
    isvc = kube.get("InferenceService", ns, name)
    if isvc is None:
        raise SystemExit(f"InferenceService {name} not found in namespace {ns}")
    spec, st = isvc["spec"], isvc.get("status") or {}
    storage = (spec.get("coldStart") or {}).get("storage") or {}
    publish = (storage.get("node") or {}).get("publish", "none")
    if storage.get("type") != "node" or publish not in ("objectStore", "pvc"):
        raise SystemExit(
            f"{name}: --scale-out's pull arm needs checkpoints a node agent publishes: set "
            "spec.coldStart.storage {type: node, node: {publish: objectStore}} (or pvc)"
        )
    if spec.get("apiKeySecretRef"):
        raise SystemExit(
            f"{name} requires an API key, and the apiserver's pod proxy drops the "
            "Authorization header: bench a copy of the service without apiKeySecretRef"
        )
    ck = kube.get("Checkpoint", ns, st.get("checkpoint") or "") if st.get("checkpoint") else None
    cst = (ck or {}).get("status") or {}
    if cst.get("phase") != "Ready":
        raise SystemExit(f"{name} has no Ready checkpoint: `kubectl rekindle checkpoint {name}`")
    replicas = int(spec.get("replicas", 1))
    ready = [p for p in _pods(kube, ns, name) if pod_ready(p)]
    if len(ready) != replicas:
        raise SystemExit(f"{name}: {len(ready)} of {replicas} replicas Ready; wait until all are")
    nodes = _schedulable_nodes(kube)
    holding = [n for n in [cst.get("node"), *(cst.get("cachedNodes") or [])] if n]
    warm = warm or next((n for n in holding if n in nodes), None)
    cold = cold or next((n for n in nodes if n not in holding), None)
    if not warm or warm not in nodes:
        raise SystemExit(f"--warm-node: none of {holding or 'no node'} is Ready and schedulable")
    if not cold or cold not in nodes or cold == warm:
        raise SystemExit(
            f"--cold-node: a Ready, schedulable node other than {warm} is needed (have {nodes})"
        )
    template = ((spec.get("podTemplate") or {}).get("spec")) or {}
    runtime = parse_spec(name, ns, spec)  # the runtime image as the operator resolves it
    return Plan(
        ns=ns,
        name=name,
        model=(spec.get("model") or {}).get("servedName") or name,
        replicas=replicas,
        warm_node=warm,
        cold_node=cold,
        checkpoint_path=str(cst.get("path", "")),
        image=runtime.image,
        pull_policy=runtime.image_pull_policy,
        tolerations=list(template.get("tolerations") or []),
    )


def run(
    kube: Kube, p: Plan, trials: int, progress: Callable[[str], None] = print
) -> list[ScaleOutTrial]:
    """Trials of every arm, the arms' order rotating per trial so drift hits each alike."""
    out: list[ScaleOutTrial] = []
    try:
        for i in range(trials):
            for arm in ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]:
                t = one_trial(kube, p, arm, i, progress)
                progress(
                    f"[{arm} {i + 1}/{trials}] on {t.node}: pod ready {t.ready_s:.2f}s, "
                    f"first token {t.first_token_s:.2f}s "
                    f"({t.origin}{': ' + t.reason if t.reason else ''})"
                )
                out.append(t)
    finally:
        _set_policy(kube, p, "IfAvailable")
    return out


def one_trial(
    kube: Kube,
    p: Plan,
    arm: str,
    i: int,
    progress: Callable[[str], None] = print,
    timeout: float = 900,
) -> ScaleOutTrial:
    target = p.warm_node if arm == "cached" else p.cold_node
    _set_policy(kube, p, "Never" if arm == "naive" else "IfAvailable")
    cluster_bench.wait_pointer(kube, p.ns, p.name, restore=arm != "naive")
    if arm == "pull":
        evict(kube, p, progress)
    before = {x["metadata"]["name"] for x in _pods(kube, p.ns, p.name)}
    cache = _node_status(kube, p, target)
    cordoned = _cordon_all_but(kube, target)
    pod: dict[str, Any] | None = None
    ready_s = first_s = None
    try:
        t0 = time.monotonic()
        cluster_bench.scale(kube, p.ns, p.name, p.replicas + 1)
        while first_s is None:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{arm} trial {i}: no first token within {timeout:.0f}s")
            new = [x for x in _pods(kube, p.ns, p.name) if x["metadata"]["name"] not in before]
            if new:
                pod = new[0]
            if pod and cordoned and (pod.get("spec") or {}).get("nodeName"):
                _uncordon(kube, cordoned)
                cordoned = []
            if pod and ready_s is None and pod_ready(pod):
                ready_s = time.monotonic() - t0
            if (
                pod
                and ready_s is not None
                and pods.pod_completion(kube, p.ns, pod["metadata"]["name"], p.model)
            ):
                first_s = time.monotonic() - t0
            time.sleep(0.2)
    finally:
        _uncordon(kube, cordoned)
    assert pod is not None and ready_s is not None
    pod_name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName") or ""
    origin, reason, agent_s = cluster_bench.pod_report(kube, p.ns, pod_name)
    images = cluster_bench.pod_images(kube.get("Pod", p.ns, pod_name) or pod)
    reported = _pod_status(kube, p, pod_name)
    _scale_back(kube, p, pod_name)
    if node != target:
        raise RuntimeError(f"{arm} trial {i}: the new replica ran on {node}, not {target}")
    return ScaleOutTrial(
        arm,
        i,
        ready_s,
        first_s,
        origin,
        reason,
        agent_s,
        pod_name,
        node,
        images,
        target,
        cache,
        str(reported.get("coldStartPath", "")),
        dict(reported.get("restoreSeconds") or {}),
    )


def evict(kube: Kube, p: Plan, progress: Callable[[str], None], timeout: float = 180) -> None:
    """Have the cold node's agent drop its copy; retried while a replica gone a moment
    ago still pins it there (the node agent unpins once it sees the pod gone)."""
    deadline = time.monotonic() + timeout
    while True:
        job = b.build_cleanup_job(
            p.ns,
            f"evict-{p.name}",
            uuid.uuid4().hex,
            p.checkpoint_path,
            {},
            p.image,
            p.pull_policy,
            node=p.cold_node,
            from_node_cache=True,
        )
        job["spec"]["template"]["spec"]["tolerations"] = [{"operator": "Exists"}]
        kube.create(job)
        state = _wait_job(kube, p.ns, job["metadata"]["name"], deadline)
        kube.request(
            "DELETE",
            f"/apis/batch/v1/namespaces/{p.ns}/jobs/{job['metadata']['name']}",
            query={"propagationPolicy": "Background"},
        )
        if state == "Complete":
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the node agent on {p.cold_node} kept the checkpoint (a replica there maps "
                f"it?): the pull arm needs that node without it; see the Job's logs"
            )
        progress(f"node {p.cold_node} still holds the checkpoint; asking again")
        time.sleep(2)


def _wait_job(kube: Kube, ns: str, name: str, deadline: float) -> str:
    while time.monotonic() < deadline:
        st = (kube.get("Job", ns, name) or {}).get("status") or {}
        for c in st.get("conditions") or []:
            if c.get("status") == "True" and c.get("type") in ("Complete", "Failed"):
                return str(c["type"])
        if st.get("failed"):  # one pod failed: the evict answered "kept"
            return "Failed"
        time.sleep(0.5)
    return "Timeout"


def _scale_back(kube: Kube, p: Plan, pod: str) -> None:
    """Back to N, removing the new replica (the lowest deletion cost goes first)."""
    kube.merge_patch("Pod", p.ns, pod, {"metadata": {"annotations": {DELETION_COST: "-1000000"}}})
    cluster_bench.scale(kube, p.ns, p.name, p.replicas)
    deadline = time.monotonic() + 180
    while kube.get("Pod", p.ns, pod) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pod {pod} still present 180s after the scale-down")
        time.sleep(0.5)


def _pod_status(kube: Kube, p: Plan, pod: str, wait_s: float = 30) -> dict[str, Any]:
    """That replica's entry in the service's status once it says how the replica came
    up (coldStartPath; restoreSeconds: the restore's phases). The status is refreshed
    every few seconds: waited for, bounded; {} if it never said."""
    deadline = time.monotonic() + wait_s
    while True:
        st = (kube.get("InferenceService", p.ns, p.name) or {}).get("status") or {}
        for x in st.get("pods") or []:
            if x.get("name") == pod and x.get("coldStartPath"):
                return dict(x)
        if time.monotonic() >= deadline:
            return {}
        time.sleep(1)


def _set_policy(kube: Kube, p: Plan, policy: str) -> None:
    patch = {"spec": {"coldStart": {"restorePolicy": policy}}}
    kube.merge_patch("InferenceService", p.ns, p.name, patch)


def _node_status(kube: Kube, p: Plan, node: str) -> dict[str, Any]:
    st = (kube.get("InferenceService", p.ns, p.name) or {}).get("status") or {}
    for n in st.get("nodes") or []:
        if n.get("name") == node:
            keep = ("checkpointCached", "residentPercent")
            return {k: n[k] for k in keep if k in n}
    return {}


def _pods(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    return [
        x
        for x in kube.list("Pod", ns, b.selector_string(name))
        if not x["metadata"].get("deletionTimestamp")
    ]


def _nodes(kube: Kube) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kube.request("GET", "/api/v1/nodes").get("items", [])
    return items


def _schedulable_nodes(kube: Kube) -> list[str]:
    out = []
    for n in _nodes(kube):
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (n.get("status") or {}).get("conditions") or []
        )
        if ready and not (n.get("spec") or {}).get("unschedulable"):
            out.append(n["metadata"]["name"])
    return sorted(out)


def _cordon_all_but(kube: Kube, keep: str) -> list[str]:
    """Cordon every schedulable node but keep; the ones cordoned here."""
    done: list[str] = []
    try:
        for n in _schedulable_nodes(kube):
            if n != keep:
                _set_unschedulable(kube, n, True)
                done.append(n)
    except BaseException:
        _uncordon(kube, done)
        raise
    return done


def _uncordon(kube: Kube, nodes: list[str]) -> None:
    for n in nodes:
        _set_unschedulable(kube, n, False)


def _set_unschedulable(kube: Kube, node: str, value: bool) -> None:
    kube.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"spec": {"unschedulable": value or None}},
        content_type="application/merge-patch+json",
    )
