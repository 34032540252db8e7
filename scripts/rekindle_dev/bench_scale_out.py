"""`rekindle-dev bench scale-out`: a service at N replicas gets one more, on a warm node,
on a node that must pull the checkpoint, and by a naive boot (the two-node local
cluster, the tiny model): the setup around `kubectl rekindle bench --scale-out`.

One InferenceService (storage `node`, published to the object store: SeaweedFS in
the cluster) is booted and checkpointed on the first node and scaled to N there.
Then every trial runs the plugin's scale-out trial for each arm (their order
rotating per trial; rekindle_operator.scale_out_bench says what it times):

  cached  the new replica on the first node, whose cache holds the checkpoint (its
          files read whole just before: warm)
  pull    the new replica on the second node, whose node agent dropped its copy just
          before (a Job asks it): it pulls the checkpoint from the object store (the
          store's files read whole just before: warm) and verifies it
  naive   the second node, restorePolicy Never: vLLM boots (the image's files warm
          from the previous arms, as for every arm)

The residency of the checkpoint files each arm reads is recorded before its trial.
One disk holds the store and both nodes here (a fleet's nodes each have their own),
so before every arm the machine's dirty pages are written back (sync) and what was
left is recorded: no arm pays for an earlier one's writes. Beside each pull, a plain
parallel reader (rekindle_dev.store_read: one GET per object, as the pull makes
one per frame, same requests in flight, bytes dropped) reads the same checkpoint's
objects (its frames: the compressed bytes a pull receives) from the second node's
network namespace: the limit a pull meets on this machine (issue 24: within 1.5x of
it). A pull also decodes and hashes what it receives; the reader does neither.
Needs `scripts/local-cluster up --nodes 2` and `make images` (root: it reads the
nodes' caches and the store's files on this machine to warm them).

    rekindle-dev bench scale-out --replicas 1 --trials 3 --out docs/bench/scale-out
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from rekindle_operator import scale_out_bench
from rekindle_operator.kube import Kube, load_configuration
from rekindle_store.s3 import Credentials

from rekindle_dev import bench_node_agent as na
from rekindle_dev import local_s3, store_read
from rekindle_dev.bench_common import REPO, md_table, provenance, pyplot, save_figure

ARMS = ("cached", "pull", "naive")
NAME = na.NAME
NODE1, NODE2 = "rekindle-node", "rekindle-node-2"
NODE_LOCAL = "/var/lib/rekindle-cluster/node-local"
NODE2_LOCAL = "/var/lib/rekindle-cluster/nodes/2/node-local"
NODE2_NETNS = "rekindle-node-2"  # scripts/local-cluster's network namespace of the second node
STORE_PREFIX = "rekindle"  # the chart's nodeAgent.objectStore.prefix
TOLERATION = {"key": "rekindle.dev/node", "operator": "Exists", "effect": "NoSchedule"}


def log(msg: str) -> None:
    print(f"[bench scale-out {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=3, help="trials per arm (median of these)")
    p.add_argument("--replicas", type=int, default=1, help="N: replicas serving before each")
    p.add_argument("--out", default="docs/bench/scale-out")


def object_store(ns: str, creds: Credentials, data_dir: Path) -> str:
    """Deploy SeaweedFS on the first node; its endpoint (the Service's cluster IP)."""
    data_dir.mkdir(parents=True)
    os.chown(data_dir, 65534, 65534)
    for m in local_s3.manifests(ns, creds, str(data_dir), NODE1):
        na.kubectl("apply", "-f", "-", input=json.dumps(m))
    na.kubectl("rollout", "status", "-n", ns, "deployment/s3", "--timeout=120s")
    ip = json.loads(na.kubectl("get", "service", "-n", ns, "s3", "-o", "json"))["spec"]
    return f"http://{ip['clusterIP']}:{local_s3.PORT}"


def node_agent(ns: str, state: str, endpoint: str, creds: Credentials) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3-credentials", "namespace": ns},
        "stringData": {"accessKeyID": creds.access_key, "secretAccessKey": creds.secret_key},
    }
    na.kubectl("apply", "-f", "-", input=json.dumps(secret))
    na.node_agent(
        ns,
        state,
        [
            "--set", f"nodeAgent.objectStore.endpoint={endpoint}",
            "--set", f"nodeAgent.objectStore.bucket={local_s3.BUCKET}",
            "--set", "nodeAgent.objectStore.credentialsSecret=s3-credentials",
            "--set-json", f"nodeAgent.tolerations=[{json.dumps(TOLERATION)}]",
        ],
    )  # fmt: skip


def service(ns: str) -> None:
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {"name": NAME}
    doc["spec"]["coldStart"]["storage"] = {"type": "node", "node": {"publish": "objectStore"}}
    doc["spec"]["podTemplate"] = {"spec": {"tolerations": [TOLERATION]}}
    na.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))


def only(node: str) -> None:
    """Schedule on node alone: the other one cordoned."""
    other = NODE2 if node == NODE1 else NODE1
    na.kubectl("uncordon", node)
    na.kubectl("cordon", other)


def entries(state: str, node: str) -> Path:
    local = NODE2_LOCAL if node == NODE2 else NODE_LOCAL
    return Path(state.replace(NODE_LOCAL, local, 1)) / "cache" / "entries"


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise SystemExit("rekindle-dev bench scale-out: run as root (it empties a node's cache)")
    started, load0 = time.time(), os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    na.ENV.update(na.cluster_env())
    nodes = json.loads(na.kubectl("get", "nodes", "-o", "json"))["items"]
    if {n["metadata"]["name"] for n in nodes} != {NODE1, NODE2}:
        raise SystemExit("needs the two-node local cluster: scripts/local-cluster up --nodes 2")
    kube = Kube(load_configuration(na.ENV["KUBECONFIG"]))
    na.kubectl("apply", "-f", str(REPO / "charts/rekindle/files/crds"))
    tag = uuid.uuid4().hex[:6]
    s3_ns, agent_ns = na.namespace("bench-s3", None), na.namespace("bench-node", "privileged")
    ns = na.namespace("bench-scale", "baseline")
    s3_data = Path(f"/var/lib/rekindle-cluster/bench-s3-{tag}")
    state = f"{NODE_LOCAL}/bench-node-{tag}"
    creds = Credentials(f"rk-{secrets.token_hex(4)}", secrets.token_hex(20))
    op_log = open(out / "operator.log", "w")  # noqa: SIM115
    op = subprocess.Popen(
        [sys.executable, "-m", "rekindle_operator", "--namespace", ns],
        env={**na.ENV, "REKINDLE_STATUS_INTERVAL": "2"},
        stdout=op_log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    trials: list[dict[str, Any]] = []
    try:
        endpoint = object_store(s3_ns, creds, s3_data)
        node_agent(agent_ns, state, endpoint, creds)
        only(NODE1)
        service(ns)
        ck = na.checkpoint(kube, ns)
        log(f"checkpoint {ck['path']} on {ck.get('node')}, published to {endpoint}")
        data = f"{STORE_PREFIX}/{ns}/{Path(ck['path']).name}/"  # frames, layout, manifest
        na.kubectl("scale", f"rkis/{NAME}", "-n", ns, f"--replicas={args.replicas}")
        na.wait(f"{args.replicas} replicas Ready", lambda: _ready(kube, ns, args.replicas), 600)
        na.kubectl("uncordon", NODE2)
        plan = scale_out_bench.plan(kube, ns, NAME, NODE1, NODE2)
        for i in range(args.trials):
            for arm in ARMS[i % 3 :] + ARMS[: i % 3]:
                warm = s3_data if arm == "pull" else entries(state, NODE1)
                na.read_all(warm)
                res = na.residency(warm)
                if arm == "pull":  # on a settled machine, as the pull after it
                    written_back()
                plain = plain_read(endpoint, data, creds) if arm == "pull" else None
                dirty = written_back()
                t = scale_out_bench.one_trial(kube, plan, arm, i, log)
                path = t.cold_start_path
                trials.append(
                    {**asdict(t), "path": path, "residency": res, "dirty_kib": dirty}
                    | ({"plain_read": plain} if plain else {})
                )
                log(
                    f"[{arm} {i + 1}/{args.trials}] on {t.node}: first token "
                    f"{t.first_token_s:.2f}s, pod ready {t.ready_s:.2f}s ({path}), "
                    f"files resident {res.get('resident_pct')}%"
                )
                want = {"cached": "restore", "pull": "restoreAfterPull", "naive": "boot"}[arm]
                if path != want:
                    raise SystemExit(
                        f"{arm} trial {i}: came up by {path!r}, not {want}: {t.reason}"
                    )
    finally:
        na.kubectl("uncordon", NODE1, check=False)
        na.kubectl("uncordon", NODE2, check=False)
        na.kubectl("scale", f"rkis/{NAME}", "-n", ns, "--replicas=0", check=False)
        na.wait("the service's pods to go", lambda: not na._any_pods(ns), 180)
        op.terminate()
        op.wait(timeout=60)
        na.drop_finalizers(ns)
        for n in (ns, agent_ns, s3_ns):
            na.kubectl("delete", "namespace", n, "--wait=false", check=False)
        for p in (Path(state), Path(state.replace(NODE_LOCAL, NODE2_LOCAL, 1)), s3_data):
            subprocess.run(["chattr", "-R", "-i", str(p)], check=False, capture_output=True)
            shutil.rmtree(p, ignore_errors=True)
    doc = {
        **provenance(
            "rekindle-dev bench scale-out " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
            [
                "images/runtime/rekindle_node",
                "operator/rekindle_operator",
                "charts/rekindle",
                "scripts/local-cluster",
                "scripts/rekindle_dev/bench_scale_out.py",
                "scripts/rekindle_dev/local_s3.py",
            ],
            load0,
            started,
        ),
        "arms": {
            "cached": "a node whose cache holds the checkpoint (warm page cache)",
            "pull": "a node whose cache was emptied: pulled from the object store, verified",
            "naive": "restorePolicy Never: vLLM boots",
        },
        "replicas": args.replicas,
        "timing": scale_out_bench.TIMING,
        "trials": trials,
        "summary": summarize(trials),
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "results.md").write_text(markdown(doc))
    plot(doc, out / "results.png")
    print(markdown(doc))
    return 0


def written_back() -> int:
    """sync, then the machine's dirty memory left (KiB: what an arm may still wait on)."""
    os.sync()
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1])
    return 0


def plain_read(endpoint: str, prefix: str, creds: Credentials) -> dict[str, Any]:
    """The plain parallel reader over the checkpoint's objects, from the second node's
    network namespace (as its node agent reaches the store): bytes, seconds."""
    env = {
        **os.environ,
        store_read.ACCESS_ENV: creds.access_key,
        store_read.SECRET_ENV: creds.secret_key,
    }
    argv = ["ip", "netns", "exec", NODE2_NETNS, sys.executable, "-m", "rekindle_dev.store_read"]
    res = subprocess.run(
        [*argv, endpoint, local_s3.BUCKET, prefix],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if res.returncode != 0:
        raise SystemExit(f"the plain reader failed: {res.stderr.strip()[-2000:]}")
    got: dict[str, Any] = json.loads(res.stdout)
    if not got["bytes"]:
        raise SystemExit(f"the plain reader found nothing under {prefix} at {endpoint}")
    log(f"plain parallel read from {NODE2}: {got['bytes']} bytes in {got['seconds']:.2f}s")
    return got


def _ready(kube: Kube, ns: str, n: int) -> bool:
    st = (kube.get("InferenceService", ns, NAME) or {}).get("status") or {}
    pods = st.get("pods") or []
    return len(pods) == n and all(p.get("ready") for p in pods)


def summarize(trials: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for arm in ARMS:
        rows = [t for t in trials if t["arm"] == arm]
        if rows:
            out[arm] = {
                "first_token_s": statistics.median(t["first_token_s"] for t in rows),
                "ready_s": statistics.median(t["ready_s"] for t in rows),
            }
    return out


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    n = doc.get("replicas", 0)
    naive = s.get("naive", {}).get("first_token_s")
    rows = []
    for arm in ARMS:
        if arm not in s:
            continue
        per = [t["first_token_s"] for t in doc["trials"] if t["arm"] == arm]
        ratio = f"{naive / s[arm]['first_token_s']:.1f}x" if naive else "-"
        rows.append(
            [
                arm,
                f"{s[arm]['first_token_s']:.2f}",
                f"{s[arm]['ready_s']:.2f}",
                ratio if arm != "naive" else "1.0x",
                ", ".join(f"{x:.2f}" for x in per),
            ]
        )
    head = (
        f"Commit {doc['commit']}, {doc['date']}, {doc['host'].get('cpus')} CPUs; command: "
        f"`{doc['command']}`.\n\nScale {n} → {n + 1}, seconds, median (per trial, in order); the "
        "arms' order rotates per trial. Targets (issue 24): cached at least 10x faster than "
        "naive, pull at least 5x.\n\n"
    )
    table = md_table(
        ["arm", "first token", "pod Ready", "naive / arm", "first token per trial"], rows
    )
    resident = ", ".join(f"{t['arm']} {t['residency'].get('resident_pct')}%" for t in doc["trials"])
    lines = phases_line(doc["trials"]) + pull_line(doc["trials"])
    return head + table + lines + footer(doc, resident)


def phases_line(trials: list[dict[str, Any]]) -> str:
    """The restore's phases per restoring arm, medians (results made before the trials
    recorded them have none)."""
    parts = []
    for arm in ("cached", "pull"):
        rows = [t.get("restore_seconds") or {} for t in trials if t["arm"] == arm]
        names = [k for k in (rows[0] if rows else {}) if all(k in r for r in rows)]
        if names:
            med = ", ".join(f"{k} {statistics.median(r[k] for r in rows):.2f}" for k in names)
            parts.append(f"{arm}: {med}")
    if not parts:
        return ""
    return "\nThe restore's phases in the agent, medians (s): " + "; ".join(parts) + ".\n"


def pull_line(trials: list[dict[str, Any]]) -> str:
    """The pull against the plain parallel reader beside it (results made before the
    trials recorded one have none)."""
    rows = [
        (t["restore_seconds"]["pull"], t["plain_read"]["seconds"], t["plain_read"]["bytes"])
        for t in trials
        if t["arm"] == "pull" and t.get("plain_read") and "pull" in (t.get("restore_seconds") or {})
    ]
    if not rows:
        return ""
    ratios = [p / r for p, r, _b in rows]
    per = ", ".join(f"{p:.2f} / {r:.2f}" for p, r, _b in rows)
    return (
        f"\nThe pull against a plain parallel reader of the same {rows[0][2] / 2**30:.2f} GiB "
        "stored (the checkpoint's frames, layout and manifest: what a pull receives) "
        f"from the second node (issue 24: within 1.5x): pull phase / plain read, median "
        f"{statistics.median(ratios):.2f}x (per trial, s: {per}).\n"
    )


def footer(doc: dict[str, Any], resident: str) -> str:
    host = doc["host"]
    foot = (
        f"\nFiles each arm reads, resident in the page cache just before its trial: {resident}. "
        f"Dirty memory after the sync before each arm (KiB): "
        f"{', '.join(str(t['dirty_kib']) for t in doc['trials'] if 'dirty_kib' in t) or '-'}. "
        f"Load average {host['load_avg_at_start'][0]} at the start, "
        f"{host['load_avg_at_end'][0]} at the end; "
        f"{host.get('cpu', '')}, {host.get('cpus')} CPUs.\n"
    )
    return foot


def plot(doc: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, arm in enumerate(ARMS):
        per = [t["first_token_s"] for t in doc["trials"] if t["arm"] == arm]
        if per:
            ax.scatter([i] * len(per), per, alpha=0.6)
            ax.hlines(statistics.median(per), i - 0.25, i + 0.25, color="black")
    ax.set_xticks(range(len(ARMS)), ARMS)
    n = doc.get("replicas", 0)
    ax.set_ylabel(f"scale {n}→{n + 1} → first token, s (lower is better)")
    ax.set_ylim(bottom=0)
    save_figure(fig, out, "A new replica: warm node, pulling node, naive boot")
