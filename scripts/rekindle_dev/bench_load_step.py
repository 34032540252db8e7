"""`rekindle-dev bench load-step`: a load step the autoscaler answers with a second
replica, restored vs booted (the local cluster, the tiny model).

The chart is installed with its operator, the front and KEDA, as for
`bench scale-from-zero` (its install, service and checkpoint steps are reused).
Two InferenceServices of the same spec, each with spec.autoscaling
{minReplicas 1, maxReplicas 2, target TARGET requests per replica}:

  step-restore  checkpointed: the second replica restores
  step-boot     restorePolicy Never: the second replica boots

A trial, on a service idle at one Ready replica: CLIENTS clients start sending
completions through the front, one after another each (the step: CLIENTS
requests in flight, CLIENTS / TARGET = 2 replicas wanted, the maximum). Timed
from the step: decision_s (the scale subresource reads 2),
ready_s (the new pod Ready) and first_token_s (one greedy token from the new pod
itself, through the apiserver's pod proxy, asked once it is Ready); from the
decision: new_replica_s (first_token_s - decision_s, the replica's own start,
without the autoscaler's reaction). The step's own requests' latency, p50 and
max, says what the clients felt meanwhile; pods_started > 1 says the autoscaler
took a starting replica back and started another. Then the clients stop and KEDA takes
the service back to one (scaleDownDelay SCALE_DOWN_DELAY_S).

Arms interleaved, order alternating per trial, each trial starting with both
services back at one replica (the previous trial's second replica gone, whichever
arm it was); the checkpoint files are read
whole before each trial of the restore arm (residency recorded). Both arms keep
their checkpoints where --storage says: node (the default, what a fleet runs: the
node agent's verified cache, unprivileged pods) or hostPath (privileged pods; a
restore hashes the checkpoint in its own pod first). Target
(issue 25): the step served by a restored replica at least 10x sooner than by a
booted one.

    rekindle-dev bench load-step --trials 3 --out docs/bench/load-step
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from rekindle_agent.mapped_files.immutable import remove_tree
from rekindle_operator import cluster_bench
from rekindle_operator.kube import Kube
from rekindle_operator.pods import pod_completion
from rekindle_operator.selection import pod_ready

from rekindle_dev import bench_node_agent as na
from rekindle_dev import bench_scale_from_zero as sfz
from rekindle_dev.bench_common import md_table, provenance, pyplot, save_figure

ARMS = ("step-restore", "step-boot")
CLIENTS = 4
TARGET = 2  # requests per replica: CLIENTS of them want exactly the maximum, 2
# Long enough that a dip in the load read while the CPU is saturated does not take
# back a replica still booting (seen with 10 s: the boot started over).
SCALE_DOWN_DELAY_S = 30
TRIAL_TIMEOUT_S = 900
MAX_TOKENS = 32
MODEL = sfz.MODEL
# Both arms: vLLM's OpenMP threads unpinned. By default (VLLM_CPU_OMP_THREADS_BIND
# auto) every one-rank CPU replica pins them to the same core of this machine (core
# 0, core 1 kept for the rest), so a boot beside the loaded replica got a share of
# that one core: no first token in 900 s, where a restore answered in 19 s. On a
# GPU node a new replica has a device of its own; unpinned, the two at least share
# both cores as the kernel sees fit.
UNPINNED = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]
STORAGE = ("node", "hostPath")
STORAGE_SAID = {
    "node": "storage type node, the node agent's verified cache, unprivileged pods",
    "hostPath": "storage type hostPath, privileged pods, each restore hashing the "
    "checkpoint in its pod",
}


def log(msg: str) -> None:
    print(f"[bench load-step {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=3, help="trials per arm (median of these)")
    p.add_argument("--out", default="docs/bench/load-step")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
    p.add_argument(
        "--storage",
        choices=STORAGE,
        default="node",
        help="where the checkpoint is kept, for both arms: node (the node agent's verified "
        "cache, unprivileged pods: what a fleet runs) or hostPath (privileged pods, each "
        "restore hashing the checkpoint in its pod)",
    )


class Load:
    """CLIENTS closed-loop clients through the front; each request's latency kept."""

    def __init__(self, ns: str, name: str) -> None:
        self.url = f"{sfz.FRONT}/{ns}/{name}/v1/completions"
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def _client(self, i: int) -> None:
        body = json.dumps(
            {"model": MODEL, "prompt": f"Load {i}", "max_tokens": MAX_TOKENS,
             "ignore_eos": True, "temperature": 0}
        ).encode()  # fmt: skip
        while not self.stop.is_set():
            req = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json"}
            )
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=300) as resp:
                    resp.read()
                self.latencies.append(time.monotonic() - t0)
            except (urllib.error.URLError, OSError) as e:
                self.failures.append(repr(e))
                self.stop.wait(0.5)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(330)


def replicas(kube: Kube, ns: str, name: str) -> int:
    return int(((kube.get("InferenceService", ns, name) or {}).get("spec") or {})["replicas"])


def at_one(kube: Kube, ns: str, name: str) -> str:
    """Wait for the service at one replica, one pod, Ready; its name."""

    def one() -> bool:
        pods = cluster_bench._pods(kube, ns, name)
        return replicas(kube, ns, name) == 1 and len(pods) == 1 and pod_ready(pods[0])

    na.wait(f"{name} back at one Ready replica", one, 300)
    return str(cluster_bench._pods(kube, ns, name)[0]["metadata"]["name"])


class NodeAgent:
    """The chart's node agent for --storage node, in a privileged namespace of its own
    with a fresh state directory (its cache: what the restore arm's trials warm)."""

    def __init__(self) -> None:
        self.storage: dict[str, Any] = {"type": "node"}
        self.state = Path(f"/var/lib/rekindle-cluster/bench-step-node-{uuid.uuid4().hex[:6]}")
        self.entries = self.state / "cache" / "entries"
        self.ns = ""

    def start(self) -> None:
        self.ns = na.namespace("bench-step-node", "privileged")
        na.node_agent(self.ns, str(self.state))

    def stop(self) -> None:
        if self.ns:
            na.kubectl("delete", "namespace", self.ns, "--timeout=180s", check=False)
        if self.state.exists():
            remove_tree(self.state)


def restore_phases(kube: Kube, ns: str, name: str, pod: str, wait_s: float = 30) -> dict[str, Any]:
    """The restored replica's phases as its agent reported them (the service's
    status.pods[].restoreSeconds, refreshed every few seconds: waited for, bounded),
    so a slow restore under load says where its seconds went; {} if never reported."""
    deadline = time.monotonic() + wait_s
    while True:
        st = (kube.get("InferenceService", ns, name) or {}).get("status") or {}
        for x in st.get("pods") or []:
            if x.get("name") == pod and x.get("restoreSeconds"):
                return dict(x["restoreSeconds"])
        if time.monotonic() >= deadline:
            return {}
        time.sleep(1)


def trial(kube: Kube, ns: str, arm: str, i: int) -> dict[str, Any]:
    name = arm
    first = at_one(kube, ns, name)
    t0 = time.monotonic()
    decision = ready = token = None
    new_pod = ""
    started: set[str] = set()  # new pods seen: more than one means one was taken back
    with Load(ns, name) as load:
        while token is None:
            now = time.monotonic() - t0
            if now > TRIAL_TIMEOUT_S:
                raise SystemExit(
                    f"{arm} trial {i}: no first token from a new replica in {TRIAL_TIMEOUT_S} s"
                )
            if decision is None and replicas(kube, ns, name) >= 2:
                decision = now
            others = [p for p in cluster_bench._pods(kube, ns, name)
                      if p["metadata"]["name"] != first]  # fmt: skip
            started |= {str(p["metadata"]["name"]) for p in others}
            if others and ready is None and pod_ready(others[0]):
                ready, new_pod = now, str(others[0]["metadata"]["name"])
            if ready is not None and pod_completion(kube, ns, new_pod, MODEL):
                token = time.monotonic() - t0
            time.sleep(0.2)
    if decision is None:
        raise SystemExit(f"{arm} trial {i}: a second replica came without the scale reading 2")
    origin, reason, agent_s = cluster_bench.pod_report(kube, ns, new_pod)
    phases = restore_phases(kube, ns, name, new_pod) if origin == "restored" else {}
    lat = sorted(load.latencies)
    return {
        "arm": arm, "i": i, "decision_s": round(decision, 3), "ready_s": round(ready or 0, 3),
        "first_token_s": round(token, 3), "new_replica_s": round(token - decision, 3),
        "origin": origin, "reason": reason, "agent_ready_s": agent_s, "restore_s": phases,
        "requests": len(lat), "failures": len(load.failures), "pods_started": len(started),
        "request_p50_s": round(statistics.median(lat), 3) if lat else None,
        "request_max_s": round(lat[-1], 3) if lat else None,
    }  # fmt: skip


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    def med(arm: str, key: str) -> float:
        return float(statistics.median(t[key] for t in trials if t["arm"] == arm))

    keys = ("decision_s", "ready_s", "first_token_s", "new_replica_s")
    m = {arm: {k: round(med(arm, k), 3) for k in keys} for arm in ARMS}
    step = m["step-boot"]["first_token_s"] / m["step-restore"]["first_token_s"]
    replica = m["step-boot"]["new_replica_s"] / m["step-restore"]["new_replica_s"]
    return {
        "median": m,
        "boot_over_restore_from_step": round(step, 2),
        "boot_over_restore_new_replica": round(replica, 2),
        "target_x": 10.0,
        "target_met_from_step": step >= 10.0,
        "target_met_new_replica": replica >= 10.0,
    }


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    rows = []
    for arm in ARMS:
        ts = [t for t in doc["trials"] if t["arm"] == arm]
        rows.append(
            [arm]
            + [
                f"{s['median'][arm][k]:.2f} ({' / '.join(f'{t[k]:.2f}' for t in ts)})"
                for k in ("decision_s", "first_token_s", "new_replica_s")
            ]
            + [" / ".join(f"{t['request_p50_s']}" for t in ts)]
        )
    verdict = {True: "met", False: "missed"}
    phases = [t.get("restore_s") or {} for t in doc["trials"] if t["arm"] == "step-restore"]
    keys = sorted({k for ph in phases for k in ph})
    said = ", ".join(
        f"{k} {statistics.median(ph[k] for ph in phases if k in ph):.2f}" for k in keys
    )
    head = [
        "arm",
        "scale decision s (per trial)",
        "new replica's first token s, from the step",
        "from the decision",
        "step requests p50 s",
    ]
    return (
        "# Load step: a second replica under load, restored vs booted\n\n"
        f"Checkpoints (both arms): {STORAGE_SAID[doc.get('storage', 'hostPath')]}.\n\n"
        + md_table(head, rows)
        + f"\nFrom the step: boot / restore {s['boot_over_restore_from_step']}x "
        f"(target 10x: {verdict[s['target_met_from_step']]}); the replica's own start, from "
        f"the autoscaler's decision: {s['boot_over_restore_new_replica']}x "
        f"(10x: {verdict[s['target_met_new_replica']]})\n"
        + (
            f"\nThe restore's phases in the new replica's agent, medians (s): {said}.\n"
            if said
            else ""
        )
    )


def plot(doc: dict[str, Any], path: Path) -> None:
    """Per arm: the step to the decision, then the decision to the new replica's token."""
    fig, ax = pyplot().subplots(figsize=(7, 3.5))
    med = doc["summary"]["median"]
    for y, arm in enumerate(ARMS):
        d, f = med[arm]["decision_s"], med[arm]["first_token_s"]
        ax.barh(y, d, color="#cccccc", label="step -> scale decision" if y == 0 else None)
        ax.barh(y, f - d, left=d, color="#9cc3e6" if arm == "step-restore" else "#e6a99c",
                label="decision -> new replica's first token" if y == 0 else None)  # fmt: skip
        for t in doc["trials"]:
            if t["arm"] == arm:
                ax.plot(t["first_token_s"], y + 0.3, "k.", markersize=7)
        ax.annotate(f"{f:.1f} s", (f, y), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=9)  # fmt: skip
    ax.set_yticks(range(len(ARMS)), ARMS)
    ax.set_xlabel("seconds from the load step (medians; dots: trials)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path, "A load step answered by a second replica: restored vs booted")


def render(out: Path, doc: dict[str, Any]) -> str:
    text = markdown(doc)
    (out / "results.md").write_text(text + "\n![the step per arm](results.png)\n")
    plot(doc, out / "results.png")
    return text


def run(args: argparse.Namespace) -> int:
    if args.replot:
        out = Path(args.out)
        print(render(out, json.loads((out / "results.json").read_text())))
        return 0
    if os.geteuid() != 0:
        raise SystemExit(
            "rekindle-dev bench load-step reads checkpoint files to warm them: run as root"
        )
    started, load0 = time.time(), os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kube, ns, host = sfz.open_namespace("bench-step")
    auto = {"minReplicas": 1, "maxReplicas": 2, "target": TARGET,
            "scaleDownDelay": SCALE_DOWN_DELAY_S}  # fmt: skip
    nodes = NodeAgent() if args.storage == "node" else None
    storage = nodes.storage if nodes else {"type": "hostPath", "hostPath": {"path": host}}
    trials: list[dict[str, Any]] = []
    try:
        if nodes:
            log("starting the node agent (its own privileged namespace)")
            nodes.start()
        log(f"installing the chart (operator, front, KEDA) in {ns}")
        sfz.install(ns)
        sfz.service(ns, "step-restore", host, autoscaling=auto, env=UNPINNED,
                    coldStart={"storage": storage})  # fmt: skip
        sfz.service(ns, "step-boot", host, autoscaling=auto, env=UNPINNED,
                    coldStart={"restorePolicy": "Never", "storage": storage})  # fmt: skip
        log("booting and checkpointing")
        ckpt = sfz.checkpoint(kube, ns, "step-restore")
        root = Path(host) / ns / "step-restore" / Path(ckpt["path"]).name
        if nodes:
            root = nodes.entries
        for i in range(args.trials):
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                res: dict[str, Any] = {}
                # Every service back at one replica, not only this arm's: the other
                # arm's second replica, still there for scaleDownDelay after its own
                # trial, would take CPU from this one's new replica.
                for each in ARMS:
                    at_one(kube, ns, each)
                if arm == "step-restore":
                    na.read_all(root)
                    res = na.residency(root)
                t = trial(kube, ns, arm, i)
                t["residency"] = res
                want = "restored" if arm == "step-restore" else "booted"
                if t["origin"] != want:
                    raise SystemExit(f"{arm} trial {i}: {t['origin']} ({t['reason']}), not {want}")
                trials.append(t)
                log(
                    f"[{arm} {i + 1}/{args.trials}] decision {t['decision_s']:.1f}s, new replica's "
                    f"first token {t['first_token_s']:.1f}s ({t['origin']}), "
                    f"{t['requests']} requests, p50 {t['request_p50_s']}s"
                )
    finally:
        sfz.close_namespace(ns, ARMS, host)
        if nodes:
            nodes.stop()
    doc = {
        **provenance(
            "rekindle-dev bench load-step " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
            [
                "operator/rekindle_operator",
                "charts/rekindle",
                "images/runtime",
                "scripts/local-cluster",
                "scripts/rekindle_dev/bench_load_step.py",
            ],
            load0,
            started,
        ),
        "arms": {
            "step-restore": "spec.autoscaling 1..2; the second replica restores the checkpoint",
            "step-boot": "the same with restorePolicy Never: the second replica boots",
        },
        "storage": args.storage,
        "load": f"{CLIENTS} closed-loop clients through the front, {MAX_TOKENS} tokens each "
        f"(ignore_eos); target {TARGET} requests per replica; both arms with "
        "VLLM_CPU_OMP_THREADS_BIND=nobind (pinned, every replica shares core 0)",
        "timing": "from the step (the clients' start): decision_s (the scale subresource reads "
        "2), ready_s (the new pod Ready), first_token_s (one greedy token from the new pod "
        "through the apiserver's pod proxy, asked once it is Ready); new_replica_s = "
        "first_token_s - decision_s. " + cluster_bench.TIMING,
        "keda_polling_interval_s": 1,
        "trials": trials,
        "summary": summarize(trials),
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(render(out, doc))
    return 0
