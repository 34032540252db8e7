"""`rekindle-dev bench node-agent`: restore through the node agent vs restore in the pod.

Two copies of one InferenceService (the tiny model) run side by side on the local
cluster, from the same runtime image and the same spec but for where CRIU runs:

  in-pod      storage hostPath: a privileged pod whose agent runs CRIU itself
  node-agent  storage node: an unprivileged, non-root pod (its namespace enforces
              Pod Security baseline); the node agent (the chart's DaemonSet, in a
              namespace of its own) runs CRIU and restores from its verified cache

Each is booted and checkpointed once; then every trial scales one of them 0 -> 1
and times it as `kubectl rekindle bench` does (pod Ready, first token through the
Service, agent start to Ready on the agent's clock), the arms alternating and
their order rotating per trial. Page cache (--cache): warm, the arm's checkpoint
files are read whole just before the scale-up (both arms); cold, the whole page cache
is dropped (`echo 3 > /proc/sys/vm/drop_caches`, as `bench local` does) just
before the scale-up, for both arms alike; both (the default) interleaves a warm
and a cold round in every trial. The residency of each arm's checkpoint files is
recorded just before each of its trials.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from rekindle_operator import cluster_bench
from rekindle_operator.kube import Kube, load_configuration
from rekindle_store import page_cache

from rekindle_dev.bench_common import REPO, md_table, provenance

ARMS = ("in-pod", "node-agent")
CACHES = ("warm", "cold")
NAME = "tiny"
CONTAINERD_TASKS = "/run/rekindle-cluster/containerd/state/io.containerd.runtime.v2.task/k8s.io"
KUBELET_ROOT = "/var/lib/rekindle-cluster/kubelet/root"
IMAGE = "rekindle.local/runtime-cpu:dev"


def cluster_env() -> dict[str, str]:
    """`scripts/local-cluster env`: KUBECONFIG and the pinned kubectl and helm on PATH."""
    lines = subprocess.run(
        [str(REPO / "scripts" / "local-cluster"), "env"], check=True, capture_output=True,
        text=True,
    ).stdout.splitlines()  # fmt: skip
    env = dict(os.environ)
    for line in lines:
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.replace("$PATH", env.get("PATH", ""))
    return env


ENV: dict[str, str] = {}


def kubectl(*args: str, input: str | None = None, check: bool = True) -> str:
    out = subprocess.run(
        ["kubectl", *args], input=input, capture_output=True, text=True, env=ENV, timeout=300
    )
    if out.returncode != 0 and not check:
        return out.stdout
    if out.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def namespace(prefix: str, pss: str | None) -> str:
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    if pss:
        kubectl("label", "namespace", ns, f"pod-security.kubernetes.io/enforce={pss}")
    return ns


def node_agent(ns: str, state: str, values: Sequence[str] = ()) -> None:
    """The chart's node-agent DaemonSet in ns (values: more `--set`/`--set-json` args)."""
    rendered = subprocess.run(
        [
            "helm", "template", "rk", str(REPO / "charts" / "rekindle"), "-n", ns,
            "-s", "templates/node-agent.yaml",
            "--set", "nodeAgent.enabled=true",
            "--set", f"nodeAgent.image.repository={IMAGE.split(':')[0]}",
            "--set", f"nodeAgent.image.tag={IMAGE.split(':')[1]}",
            "--set", "nodeAgent.image.pullPolicy=Never",
            "--set", f"nodeAgent.stateDir={state}",
            "--set", f"nodeAgent.containerdTasks={CONTAINERD_TASKS}",
            "--set", f"nodeAgent.kubeletRoot={KUBELET_ROOT}",
            *values,
        ],
        capture_output=True, text=True, check=True, timeout=120, env=ENV,
    ).stdout  # fmt: skip
    kubectl("apply", "-n", ns, "-f", "-", input=rendered)
    kubectl("rollout", "status", "-n", ns, "daemonset/rk-rekindle-node", "--timeout=180s")


def drop_finalizers(ns: str) -> None:
    """Let ns's Checkpoints and InferenceServices go without an operator."""
    for kind in ("checkpoints.rekindle.dev", "inferenceservices.rekindle.dev"):
        for n in kubectl("get", kind, "-n", ns, "-o", "name", check=False).split():
            kubectl("patch", n, "-n", ns, "--type=merge", "-p",
                    '{"metadata":{"finalizers":[]}}', check=False)  # fmt: skip


def service(ns: str, storage: dict[str, Any]) -> None:
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {"name": NAME}
    doc["spec"]["coldStart"]["storage"] = storage
    kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))


def wait(what: str, cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(1)


def checkpoint(kube: Kube, ns: str) -> dict[str, Any]:
    """Boot (wait Ready), checkpoint, wait for the Checkpoint; its status."""

    def ready() -> bool:
        st = (kube.get("InferenceService", ns, NAME) or {}).get("status") or {}
        return st.get("phase") == "Ready"

    wait(f"{ns}/{NAME} Ready", ready, 600)
    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "bench"},
        "spec": {"inferenceService": NAME},
    }
    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(ck))

    def done() -> bool:
        st = (kube.get("Checkpoint", ns, "bench") or {}).get("status") or {}
        return st.get("phase") in ("Ready", "Failed")

    wait(f"{ns}/bench", done, 600)
    status = (kube.get("Checkpoint", ns, "bench") or {}).get("status") or {}
    if status.get("phase") != "Ready":
        raise SystemExit(f"{ns}: checkpoint failed: {status.get('message')}")
    wait(f"{ns}/{NAME} to use it", lambda: pointed(kube, ns), 120)
    return dict(status)


def _any_pods(*namespaces: str) -> bool:
    return any(
        kubectl("get", "pods", "-n", ns, "-o", "name", check=False).strip() for ns in namespaces
    )


def pointed(kube: Kube, ns: str) -> bool:
    st = (kube.get("InferenceService", ns, NAME) or {}).get("status") or {}
    return st.get("checkpoint") == "bench"


def residency(files_root: Path) -> dict[str, Any]:
    total = resident = 0
    for f in sorted(files_root.rglob("*")):
        if f.is_file() and not f.is_symlink():
            r, t = page_cache.mincore_pages(f)
            resident, total = resident + r, total + t
    return {
        "path": str(files_root),
        "pages": total,
        "resident_pct": round(100.0 * resident / total, 1) if total else 0.0,
    }


def drop_caches() -> None:
    """The whole page cache, as `bench local`'s cold arm: what a node that has not read
    the checkpoint (or the image) since it booted has."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_all(files_root: Path) -> None:
    """Warm means warm for both arms: every checkpoint file read into the page cache
    (a cold round before drops them, and a restore reads only what it touches)."""
    for f in sorted(files_root.rglob("*")):
        if f.is_file() and not f.is_symlink():
            with f.open("rb", buffering=0) as fh:
                while fh.read(8 << 20):
                    pass


def summarize(trials: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """cache -> arm -> measure -> median, min, max, n."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for cache in sorted({t["cache"] for t in trials}):
        out[cache] = {}
        for arm in ARMS:
            mine = [t for t in trials if t["arm"] == arm and t["cache"] == cache]
            out[cache][arm] = {}
            for key in ("agent_ready_s", "ready_s", "first_token_s"):
                vals = [t[key] for t in mine if t[key] is not None]
                if vals:
                    out[cache][arm][key] = {
                        "median": statistics.median(vals),
                        "min": min(vals),
                        "max": max(vals),
                        "n": float(len(vals)),
                    }
    return out


def markdown(doc: dict[str, Any]) -> str:
    rows = []
    for cache, by_arm in doc["summary"].items():
        for key, label in (
            ("first_token_s", "scale 0 → 1 → first token"),
            ("ready_s", "scale 0 → 1 → pod Ready"),
            ("agent_ready_s", "agent start → Ready (in the pod)"),
        ):
            a, n = by_arm["in-pod"].get(key), by_arm["node-agent"].get(key)
            if not a or not n:
                continue
            per = {
                arm: ", ".join(
                    f"{t[key]:.2f}"
                    for t in doc["trials"]
                    if t["arm"] == arm and t["cache"] == cache
                )
                for arm in ARMS
            }
            rows.append(
                [
                    f"{cache}: {label}",
                    f"{a['median']:.2f} ({per['in-pod']})",
                    f"{n['median']:.2f} ({per['node-agent']})",
                    f"{n['median'] / a['median']:.2f}",
                ]
            )
    res = "; ".join(
        f"{cache} " + ", ".join(
            f"{arm} {t['residency']['resident_pct']:.0f}%"
            for arm in ARMS
            for t in doc["trials"]
            if t["arm"] == arm and t["cache"] == cache
        )
        for cache in doc["summary"]
    )  # fmt: skip
    return (
        "# Restore through the node agent vs in the pod (local cluster, tiny model)\n\n"
        f"Commit {doc['commit']}{' (dirty)' if doc['dirty'] else ''}, {doc['date']}, "
        f"{doc['host'].get('cpus', '?')} CPUs; command: `{doc['command']}`.\n\n"
        "Seconds, median (per trial, in order). Same image, same spec but the storage "
        "type; arms alternate, order rotating per trial, a warm and a cold round in each "
        "trial; cold: the whole page cache dropped just before the scale-up, for both arms. "
        f"Checkpoint residency just before each trial: {res}.\n\n"
        + md_table(
            ["measure", "in-pod (privileged)", "node agent (unprivileged)", "node / in-pod"],
            rows,
        )
        + "\n"
    )


def run(args: argparse.Namespace) -> int:
    if args.cache != "warm" and os.geteuid() != 0:
        raise SystemExit(
            "rekindle-dev bench node-agent: the cold arm drops the page cache, which needs "
            "root: run as root, or pass --cache warm"
        )
    started, load0 = time.time(), os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ENV.update(cluster_env())
    kube = Kube(load_configuration(ENV["KUBECONFIG"]))
    kubectl("apply", "-f", str(REPO / "charts/rekindle/files/crds"))
    agent_ns = namespace("bench-node", "privileged")
    state = f"/var/lib/rekindle-cluster/bench-node-{uuid.uuid4().hex[:6]}"
    pod_ns, node_ns = namespace("bench-inpod", None), namespace("bench-nodemode", "baseline")
    host = f"/var/lib/rekindle/bench-{pod_ns}"
    op_log = open(out / "operator.log", "w")  # noqa: SIM115
    op = subprocess.Popen(
        [sys.executable, "-m", "rekindle_operator", "--namespace", pod_ns,
         "--namespace", node_ns],
        env={**ENV, "REKINDLE_STATUS_INTERVAL": "2"},
        stdout=op_log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    trials: list[dict[str, Any]] = []
    try:
        node_agent(agent_ns, state)
        service(pod_ns, {"type": "hostPath", "hostPath": {"path": host}})
        service(node_ns, {"type": "node"})
        ck = {"in-pod": checkpoint(kube, pod_ns), "node-agent": checkpoint(kube, node_ns)}
        roots = {
            "in-pod": Path(host) / pod_ns / NAME / Path(ck["in-pod"]["path"]).name,
            "node-agent": Path(state) / "cache" / "entries",
        }
        caches = CACHES if args.cache == "both" else (args.cache,)
        for i in range(args.trials):
            order = ARMS if i % 2 == 0 else ARMS[::-1]
            for cache in caches:
                for arm in order:
                    ns = pod_ns if arm == "in-pod" else node_ns
                    res: dict[str, Any] = {}

                    def prepare(arm: str = arm, cache: str = cache, res: dict = res) -> None:
                        if cache == "cold":
                            drop_caches()
                        else:
                            read_all(roots[arm])
                        res.update(residency(roots[arm]))

                    t = cluster_bench.one_trial(
                        kube, ns, NAME, NAME, "restore", i, before_start=prepare
                    )
                    trials.append({**asdict(t), "arm": arm, "cache": cache, "residency": res})
                    print(
                        f"[{cache} {arm} {i + 1}/{args.trials}] agent ready {t.agent_ready_s}, "
                        f"pod ready {t.ready_s:.2f}s, first token {t.first_token_s:.2f}s "
                        f"({t.origin}) resident {res['resident_pct']}%",
                        flush=True,
                    )
                    if t.origin != "restored":
                        raise SystemExit(f"{arm} trial {i}: {t.origin} ({t.reason}), not restored")
    finally:
        for ns in (pod_ns, node_ns):
            kubectl("scale", f"rkis/{NAME}", "-n", ns, "--replicas=0", check=False)
        wait("the services' pods to go", lambda: not _any_pods(pod_ns, node_ns), 180)
        op.terminate()
        op.wait(timeout=60)
        for ns in (pod_ns, node_ns, agent_ns):
            drop_finalizers(ns)
            kubectl("delete", "namespace", ns, "--wait=false", check=False)
        subprocess.run(["rm", "-rf", state, host], check=False)
    doc = {
        **provenance(
            "rekindle-dev bench node-agent " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
            [
                "images/runtime/rekindle_node",
                "operator/rekindle_operator",
                "charts/rekindle",
                "scripts/rekindle_dev/bench_node_agent.py",
            ],
            load0,
            started,
        ),
        "arms": {
            "in-pod": "storage hostPath: privileged pod, the agent runs CRIU",
            "node-agent": "storage node: uid 65534, no capability, baseline namespace; "
            "the node agent runs CRIU from its verified cache",
        },
        "timing": cluster_bench.TIMING,
        "trials": trials,
        "summary": summarize(trials),
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "results.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=5, help="trials per arm (median of these)")
    p.add_argument(
        "--cache",
        choices=("both", *CACHES),
        default="both",
        help="page cache before each trial: warm, cold (dropped), or both interleaved",
    )
    p.add_argument("--out", default="docs/bench/node-agent")
