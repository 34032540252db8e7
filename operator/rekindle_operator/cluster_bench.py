"""Cold-start benchmark of an InferenceService: scale 0 -> 1, naive boot vs restore.

Each trial scales to zero, waits until no pod is left, scales to one and
measures from the scale request to (a) the pod Ready and (b) the first
generated token (a one-token greedy completion sent straight to the pod).
The naive arm sets coldStart.restorePolicy=Never (not part of the checkpoint
fingerprint, so the checkpoint stays usable); the restore arm IfAvailable.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rekindle_operator import agent_command as ac
from rekindle_operator import builders as b
from rekindle_operator.constants import ANN_BOOT_PATH, ANN_BOOT_REASON
from rekindle_operator.kube import Kube
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


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, max, and the interquartile range when n >= 4)."""
    v = sorted(values)
    out = {"n": float(len(v)), "median": statistics.median(v), "min": v[0], "max": v[-1]}
    if len(v) >= 4:
        q = statistics.quantiles(v, n=4)
        out["p25"], out["p75"] = q[0], q[2]
    return out


def summarize_trials(trials: Sequence[Trial]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm in ARMS:
        rows = [t for t in trials if t.arm == arm]
        if rows:
            out[arm] = {
                "ready_s": summarize([t.ready_s for t in rows]),
                "first_token_s": summarize([t.first_token_s for t in rows]),
            }
    return out


def table(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        f"{'arm':<8} {'n':>3} {'ready median':>13} {'[min-max]':>15} "
        f"{'1st token median':>17} {'[min-max]':>15}"
    ]
    for arm, s in summary.items():
        r, f = s["ready_s"], s["first_token_s"]
        lines.append(
            f"{arm:<8} {int(r['n']):>3} {r['median']:>12.2f}s {r['min']:>6.2f}-{r['max']:<7.2f} "
            f"{f['median']:>16.2f}s {f['min']:>6.2f}-{f['max']:<7.2f}"
        )
    if "naive" in summary and "restore" in summary:
        speedup = summary["naive"]["first_token_s"]["median"] / max(
            summary["restore"]["first_token_s"]["median"], 1e-9
        )
        lines.append(f"first-token speedup (median naive / median restore): {speedup:.1f}x")
    return "\n".join(lines)


def plot(trials: Sequence[Trial], out: Path, title: str) -> None:
    """Bars at the median, whiskers to min/max, dots for every trial."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("ready_s", "scale 0→1 to pod Ready"), ("first_token_s", "scale 0→1 to first token"))
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, (key, label) in zip(axes, metrics, strict=True):
        arms = [a for a in ARMS if any(t.arm == a for t in trials)]
        for i, arm in enumerate(arms):
            vals = [getattr(t, key) for t in trials if t.arm == arm]
            med = statistics.median(vals)
            ax.bar(i, med, color=("#999999" if arm == "naive" else "#d9772b"), width=0.6)
            ax.errorbar(i, med, yerr=[[med - min(vals)], [max(vals) - med]], color="k", capsize=6)
            ax.scatter([i] * len(vals), vals, color="k", s=10, zorder=3)
            ax.text(i, med, f" {med:.1f}s", va="bottom", ha="left")
        ax.set_xticks(range(len(arms)), arms)
        ax.set_title(label)
        ax.set_ylabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _first_token(pod_ip: str, model: str, timeout: float = 5.0) -> bool:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    req = urllib.request.Request(
        f"http://{pod_ip}:{ac.SERVE_PORT}/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return bool(json.loads(resp.read())["choices"])
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError, KeyError):
        return False


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


def one_trial(
    kube: Kube, ns: str, name: str, model: str, arm: str, i: int, timeout: float = 600
) -> Trial:
    policy = "Never" if arm == "naive" else "IfAvailable"
    scale(kube, ns, name, 0, policy)
    wait_gone(kube, ns, name)
    # The operator must have pointed the ConfigMap at (or away from) the checkpoint
    # before the new pod starts; it does so on the spec change above.
    time.sleep(2)
    t0 = time.monotonic()
    scale(kube, ns, name, 1)
    ready_s = first_s = None
    pod: dict[str, Any] | None = None
    while first_s is None or ready_s is None:
        now = time.monotonic() - t0
        if now > timeout:
            raise TimeoutError(f"{arm} trial {i}: no first token within {timeout:.0f}s")
        pods = _pods(kube, ns, name)
        pod = pods[0] if pods else None
        if pod and ready_s is None and pod_ready(pod):
            ready_s = time.monotonic() - t0
        ip = (pod or {}).get("status", {}).get("podIP")
        if ip and first_s is None and _first_token(ip, model):
            first_s = time.monotonic() - t0
        time.sleep(0.2)
    assert pod is not None
    origin, reason = _origin(kube, ns, pod["metadata"]["name"])
    return Trial(arm, i, ready_s, first_s, origin, reason)


def _origin(kube: Kube, ns: str, pod: str, wait_s: float = 15) -> tuple[str, str]:
    """The operator mirrors the agent's boot path onto the pod within a status interval."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        p = kube.get("Pod", ns, pod) or {}
        ann = p.get("metadata", {}).get("annotations") or {}
        if ann.get(ANN_BOOT_PATH):
            return ann[ANN_BOOT_PATH], ann.get(ANN_BOOT_REASON, "")
        time.sleep(1)
    return "unknown", "the operator did not report the boot path in time"


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
    model = isvc["spec"]["model"].get("servedName") or name
    replicas = int(isvc["spec"].get("replicas", 1))
    policy = isvc["spec"].get("coldStart", {}).get("restorePolicy", "IfAvailable")
    out: list[Trial] = []
    try:
        for i in range(trials):
            for arm in ARMS:
                t = one_trial(kube, ns, name, model, arm, i)
                progress(
                    f"[{arm} {i + 1}/{trials}] ready {t.ready_s:.2f}s, first token "
                    f"{t.first_token_s:.2f}s ({t.origin}{': ' + t.reason if t.reason else ''})"
                )
                out.append(t)
    finally:
        scale(kube, ns, name, replicas, policy)
    return out


def write_json(path: Path, trials: Sequence[Trial], meta: dict[str, Any]) -> None:
    doc = {**meta, "summary": summarize_trials(trials), "trials": [asdict(t) for t in trials]}
    path.write_text(json.dumps(doc, indent=2) + "\n")
