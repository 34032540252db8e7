"""Cold-start benchmark of an InferenceService: scale 0 -> 1, naive boot vs restore.

Each trial scales to zero, waits until no pod is left and the operator has
pointed the restore ConfigMap at the checkpoint (restore) or away from it
(naive), scales to one and measures from the scale request to (a) the pod
Ready and (b) the first generated token: a one-token greedy completion sent
to the Service through the apiserver's service proxy, so it runs wherever
kubectl does, and only once the pod is Ready (the Service routes to Ready pods
only; a request to the pod itself before that would time what no user sees).
It also reports (c) the pod's own figure, agent start to Ready on the agent's
clock, which the operator copies from the agent's status onto the pod.
Everything goes through the Kubernetes API; no pod IP is contacted.

The naive arm sets coldStart.restorePolicy=Never (not part of the checkpoint
fingerprint, so the checkpoint stays usable); the restore arm IfAvailable.
environment() records what the results depend on that the plugin can see: the
node (kernel, kubelet, CPUs, memory), the images the pods ran (the agent is in
the runtime image), the operator's image and version, this plugin's version,
and the load of the machine kubectl ran on. The plugin ships without git: the
commit is added by `rekindle-dev bench report --stamp-cluster` (scripts/demo).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rekindle_operator import builders as b
from rekindle_operator.constants import ANN_AGENT_READY, ANN_BOOT_PATH, ANN_BOOT_REASON
from rekindle_operator.kube import Kube, KubeError
from rekindle_operator.pods import service_completion
from rekindle_operator.selection import pod_ready

ARMS = ("naive", "restore")


@dataclass
class Trial:
    arm: str
    trial: int
    ready_s: float
    first_token_s: float
    origin: str
    reason: str
    agent_ready_s: float | None = None  # agent start -> Ready, the agent's own clock
    pod: str = ""
    node: str = ""
    images: dict[str, str] = field(default_factory=dict)  # container -> image (digest)


# (Trial field, table column, plot title)
_COLUMNS = (
    ("agent_ready_s", "agent ready", "agent start → Ready (in the pod)"),
    ("ready_s", "pod ready", "scale 0→1 → pod Ready"),
    ("first_token_s", "first token", "scale 0→1 → first token"),
)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, max, and the interquartile range when n >= 4)."""
    v = sorted(values)
    out = {"n": float(len(v)), "median": statistics.median(v), "min": v[0], "max": v[-1]}
    if len(v) >= 4:
        q = statistics.quantiles(v, n=4)
        out["p25"], out["p75"] = q[0], q[2]
    return out


def summarize_trials(
    trials: Sequence[Trial], arms: Sequence[str] = ARMS
) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm in arms:
        rows = [t for t in trials if t.arm == arm]
        for key, _, _ in _COLUMNS:
            values = [v for v in (getattr(t, key) for t in rows) if v is not None]
            if values:
                out.setdefault(arm, {})[key] = summarize(values)
    return out


def table(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    """Median [min-max] per arm and metric, and the first-token speedup."""
    lines = [f"{'arm':<8} {'n':>3}" + "".join(f" {short:>22}" for _, short, _ in _COLUMNS)]
    for arm, s in summary.items():
        n = int(s["first_token_s"]["n"]) if "first_token_s" in s else 0
        cells = []
        for key, _, _ in _COLUMNS:
            m = s.get(key)
            cells.append(f"{m['median']:.2f}s [{m['min']:.2f}-{m['max']:.2f}]" if m else "-")
        lines.append(f"{arm:<8} {n:>3}" + "".join(f" {c:>22}" for c in cells))
    naive = summary.get("naive", {}).get("first_token_s")
    for arm, s in summary.items():
        other = s.get("first_token_s")
        if naive and other and arm != "naive":
            speedup = naive["median"] / max(other["median"], 1e-9)
            lines.append(f"first-token speedup (median naive / median {arm}): {speedup:.1f}x")
    return "\n".join(lines)


def plot(trials: Sequence[Trial], out: Path, title: str, arms: Sequence[str] = ARMS) -> None:
    """One panel per metric: bars at the median, whiskers to min/max, dots for every trial."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [(k, t) for k, _, t in _COLUMNS if any(getattr(x, k) is not None for x in trials)]
    fig, axes = plt.subplots(
        1, len(metrics), figsize=(4.5 * len(metrics), 4), sharey=True, squeeze=False
    )
    for ax, (key, label) in zip(axes[0], metrics, strict=True):
        shown = [a for a in arms if any(t.arm == a and getattr(t, key) is not None for t in trials)]
        for i, arm in enumerate(shown):
            vals = [getattr(t, key) for t in trials if t.arm == arm and getattr(t, key) is not None]
            med = statistics.median(vals)
            ax.bar(i, med, color=("#999999" if arm == "naive" else "#d9772b"), width=0.6)
            ax.errorbar(i, med, yerr=[[med - min(vals)], [max(vals) - med]], color="k", capsize=6)
            ax.scatter([i] * len(vals), vals, color="k", s=10, zorder=3)
            ax.text(i, med, f" {med:.1f}s", va="bottom", ha="left")
        ax.set_xticks(range(len(shown)), shown)
        ax.set_title(label)
        ax.set_ylabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _pods(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in kube.list("Pod", ns, b.selector_string(name))
        if not p["metadata"].get("deletionTimestamp")
    ]


def scale(kube: Kube, ns: str, name: str, replicas: int, policy: str | None = None) -> None:
    patch: dict[str, Any] = {"spec": {"replicas": replicas}}
    if policy:
        patch["spec"]["coldStart"] = {"restorePolicy": policy}
    kube.merge_patch("InferenceService", ns, name, patch)


def wait_gone(kube: Kube, ns: str, name: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while kube.list("Pod", ns, b.selector_string(name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pods of {name} still present after {timeout:.0f}s")
        time.sleep(0.5)


def wait_pointer(kube: Kube, ns: str, name: str, restore: bool, timeout: float = 60) -> None:
    """Until the operator has pointed the restore ConfigMap at the checkpoint (restore)
    or away from it (naive): a pod started before would take the other arm's path."""
    deadline = time.monotonic() + timeout
    while not pointed(kube, ns, name, restore):
        if time.monotonic() > deadline:
            want = "at the checkpoint" if restore else "away from the checkpoint"
            raise TimeoutError(f"the operator did not point {name}'s ConfigMap {want} in time")
        time.sleep(0.2)


def pointed(kube: Kube, ns: str, name: str, restore: bool) -> bool:
    """Whether the restore ConfigMap says what the arm needs. A caller who may not read
    ConfigMaps waits for the status to catch up with the spec instead: the reconcile
    that wrote the ConfigMap (it writes it first) has then run."""
    try:
        cm = kube.get("ConfigMap", ns, b.configmap_name(name)) or {}
    except KubeError as e:
        if e.status != 403:
            raise
        isvc = kube.get("InferenceService", ns, name) or {}
        seen = (isvc.get("status") or {}).get("observedGeneration", -1)
        return bool(seen >= (isvc.get("metadata") or {}).get("generation", 0))
    return bool((cm.get("data") or {}).get("checkpoint")) == restore


def one_trial(
    kube: Kube,
    ns: str,
    name: str,
    model: str,
    arm: str,
    i: int,
    timeout: float = 600,
    before_start: Callable[[], object] | None = None,
) -> Trial:
    """Scale name to 0 and back to 1 and time it; before_start runs just before the
    clock starts, with no pod of it left (a cold-cache bench drops the page cache)."""
    policy = "Never" if arm == "naive" else "IfAvailable"
    scale(kube, ns, name, 0, policy)
    wait_gone(kube, ns, name)
    wait_pointer(kube, ns, name, restore=arm != "naive")
    if before_start is not None:
        before_start()
    t0 = time.monotonic()
    scale(kube, ns, name, 1)
    ready_s = first_s = None
    pod: dict[str, Any] | None = None
    while first_s is None or ready_s is None:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{arm} trial {i}: no first token within {timeout:.0f}s")
        pods = _pods(kube, ns, name)
        pod = pods[0] if pods else None
        if pod and ready_s is None and pod_ready(pod):
            ready_s = time.monotonic() - t0
        # The Service sends requests only to Ready pods: no point asking before.
        ready = ready_s is not None
        if ready and first_s is None and service_completion(kube, ns, b.service_name(name), model):
            first_s = time.monotonic() - t0
        time.sleep(0.2)
    assert pod is not None
    pod_name = pod["metadata"]["name"]
    origin, reason, agent_s = pod_report(kube, ns, pod_name)
    node = (pod.get("spec") or {}).get("nodeName") or ""
    images = pod_images(kube.get("Pod", ns, pod_name) or pod)
    return Trial(arm, i, ready_s, first_s, origin, reason, agent_s, pod_name, node, images)


def pod_report(kube: Kube, ns: str, pod: str, wait_s: float = 15) -> tuple[str, str, float | None]:
    """(origin, reason, agent start -> Ready): the operator mirrors them onto the pod."""
    deadline = time.monotonic() + wait_s
    while True:
        p = kube.get("Pod", ns, pod) or {}
        ann: dict[str, str] = p.get("metadata", {}).get("annotations") or {}
        if ann.get(ANN_BOOT_PATH) and ann.get(ANN_AGENT_READY):
            return ann[ANN_BOOT_PATH], ann.get(ANN_BOOT_REASON, ""), float(ann[ANN_AGENT_READY])
        if time.monotonic() >= deadline:
            break
        time.sleep(1)
    if ann.get(ANN_BOOT_PATH):  # an agent that does not report when it became Ready
        return ann[ANN_BOOT_PATH], ann.get(ANN_BOOT_REASON, ""), None
    return "unknown", "the operator did not report the boot path in time", None


def run(
    kube: Kube,
    ns: str,
    name: str,
    trials: int,
    progress: Callable[[str], None] = print,
) -> list[Trial]:
    """Interleave the arms (naive, restore, naive, ...) so drift hits both equally."""
    isvc = kube.get("InferenceService", ns, name)
    if isvc is None:
        raise SystemExit(f"InferenceService {name} not found in namespace {ns}")
    if not (isvc.get("status") or {}).get("checkpoint"):
        raise SystemExit(
            f"{name} has no Ready checkpoint to restore from: run `kubectl rekindle checkpoint "
            f"{name} --wait` first"
        )
    if isvc["spec"].get("apiKeySecretRef"):
        # kube-apiserver deletes the Authorization header once it has authenticated
        # the caller, so a completion through its service proxy can never carry the key.
        raise SystemExit(
            f"{name} requires an API key (spec.apiKeySecretRef), and bench measures the first "
            "token through the apiserver's service proxy, which drops the Authorization "
            "header: bench a copy of the service without apiKeySecretRef"
        )
    model = isvc["spec"]["model"].get("servedName") or name
    replicas = int(isvc["spec"].get("replicas", 1))
    policy = isvc["spec"].get("coldStart", {}).get("restorePolicy", "IfAvailable")
    out: list[Trial] = []
    try:
        for i in range(trials):
            for arm in ARMS:
                t = one_trial(kube, ns, name, model, arm, i)
                agent = "-" if t.agent_ready_s is None else f"{t.agent_ready_s:.2f}s"
                progress(
                    f"[{arm} {i + 1}/{trials}] agent ready {agent}, pod ready {t.ready_s:.2f}s, "
                    f"first token {t.first_token_s:.2f}s "
                    f"({t.origin}{': ' + t.reason if t.reason else ''})"
                )
                out.append(t)
    finally:
        scale(kube, ns, name, replicas, policy)
    return out


# What the figures time, written into every results file.
TIMING = (
    "Per trial: scale the InferenceService to 0, wait until its pods are gone and the "
    "operator has pointed the restore ConfigMap at the checkpoint (restore) or away from it "
    "(naive); then from the request that scales it to 1 to (ready_s) the pod's Ready "
    "condition and (first_token_s) the first token of a one-token greedy completion answered "
    "through the Service (the apiserver's service proxy), asked only once the pod is Ready; "
    "agent_ready_s: agent start to Ready on the agent's own clock. Arms interleaved."
)


def _node_facts(kube: Kube, node: str) -> dict[str, Any]:
    """Kernel, OS, kubelet, runtime, CPUs and memory of a node, as its status reports them."""
    try:
        obj = kube.request("GET", f"/api/v1/nodes/{node}")
    except (KubeError, OSError, ValueError) as e:
        return {"name": node, "error": f"could not read the node: {e}"}
    info = (obj.get("status") or {}).get("nodeInfo") or {}
    cap = (obj.get("status") or {}).get("capacity") or {}
    return {
        "name": node,
        "kernel": info.get("kernelVersion"),
        "os": info.get("osImage"),
        "kubelet": info.get("kubeletVersion"),
        "container_runtime": info.get("containerRuntimeVersion"),
        "cpus": cap.get("cpu"),
        "memory": cap.get("memory"),
    }


def _operator(kube: Kube) -> dict[str, Any]:
    """The operator Deployment(s) the chart installed: image and version label."""
    query = {
        "labelSelector": "app.kubernetes.io/part-of=rekindle,app.kubernetes.io/component=operator"
    }
    try:
        items = kube.request("GET", "/apis/apps/v1/deployments", query=query).get("items", [])
    except (KubeError, OSError, ValueError, AttributeError) as e:
        return {"error": f"could not list the operator's Deployment: {e}"}
    out = []
    for d in items:
        meta = d.get("metadata") or {}
        containers = d["spec"]["template"]["spec"].get("containers") or []
        out.append(
            {
                "deployment": f"{meta.get('namespace')}/{meta.get('name')}",
                "version": (meta.get("labels") or {}).get("app.kubernetes.io/version"),
                "images": [c.get("image") for c in containers],
            }
        )
    return {"deployments": out} if out else {"error": "no operator Deployment found by label"}


def pod_images(pod: dict[str, Any]) -> dict[str, str]:
    """Each container's image and the digest it ran (imageID): the agent's version is the
    runtime image's."""
    return {
        st.get("name", "?"): f"{st.get('image')} ({st.get('imageID') or 'no digest'})"
        for st in (pod.get("status") or {}).get("containerStatuses") or []
    }


def client_load() -> tuple[float, float, float]:
    """The load average of the machine kubectl runs on (zeros where the OS has none)."""
    return os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)


def environment(
    kube: Kube,
    trials: Sequence[Trial],
    load_avg_at_start: tuple[float, float, float],
    started: float,
    timing: str = TIMING,
) -> dict[str, Any]:
    """What these results depend on that the plugin can see (see the module's docstring)."""
    from rekindle_contract import __version__

    nodes = sorted({t.node for t in trials if t.node})
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "timing": timing,
        **(
            {"node": _node_facts(kube, nodes[0])}
            if len(nodes) == 1
            else {"nodes": [_node_facts(kube, n) for n in nodes]}
        ),
        "versions": {
            "kubectl_rekindle": __version__,
            "operator": _operator(kube),
            "images": {t.arm: t.images for t in trials},
        },
        "client": {
            "node": platform.node(),
            "cpus": os.cpu_count(),
            "load_avg_at_start": [round(x, 2) for x in load_avg_at_start],
            "load_avg_at_end": [round(x, 2) for x in client_load()],
        },
    }


def write_json(path: Path, trials: Sequence[Trial], meta: dict[str, Any]) -> None:
    arms = list(dict.fromkeys(t.arm for t in trials))
    doc = {
        **meta,
        "summary": summarize_trials(trials, arms),
        "trials": [asdict(t) for t in trials],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
