"""`rekindle-dev bench scale-from-zero`: how long the first request to a service
scaled to zero waits, through the front and KEDA, restored vs booted, against the
restore itself (the local cluster, the tiny model).

The chart is installed with its operator, the front and KEDA (as
tests/cluster/test_autoscaling.py installs them). Three InferenceServices of the
same spec (hostPath storage, one CPU each):

  front-restore  spec.autoscaling (minReplicas 0), checkpointed: at zero, one
                 request through the front; from sending it to its answer (the
                 front holds it while KEDA wakes a replica, which restores)
  front-boot     the same, restorePolicy Never: the replica boots
  scale-restore  no autoscaling, checkpointed: `kubectl rekindle bench`'s trial,
                 from the scale to 1 to the first token through the Service (the
                 restore to first token without the autoscaler or the front)

Arms interleaved, order rotating per trial; between trials every service is back
at zero with no pod left (the autoscaled ones by KEDA, after scaleDownDelay).
The checkpoint files of the restored arms are read whole before each trial (warm
page cache, recorded as residency). Targets (issue 25): front-restore within
scale-restore + 1 s; front-boot / front-restore is the restore's gain as a user
at zero sees it.

    rekindle-dev bench scale-from-zero --trials 3 --out docs/bench/scale-from-zero
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
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from rekindle_agent.mapped_files.immutable import remove_tree
from rekindle_operator import cluster_bench
from rekindle_operator.kube import Kube, load_configuration

from rekindle_dev import bench_node_agent as na
from rekindle_dev.bench_common import REPO, md_table, provenance, pyplot, save_figure

ARMS = ("front-restore", "front-boot", "scale-restore")
SERVICE = {"front-restore": "auto", "front-boot": "autoboot", "scale-restore": "plain"}
FRONT_IP, KEDA_OPERATOR_IP = "10.96.0.200", "10.96.0.201"  # as tests/cluster/test_autoscaling
FRONT = f"http://{FRONT_IP}:8080"
SCALE_DOWN_DELAY_S = 10
MODEL = "tiny"


def log(msg: str) -> None:
    print(f"[bench scale-from-zero {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=3, help="trials per arm (median of these)")
    p.add_argument("--out", default="docs/bench/scale-from-zero")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")


def install(ns: str) -> None:
    """The chart: operator, front and KEDA (fixed addresses: the cluster has no DNS)."""
    keda = subprocess.run(
        [str(REPO / "scripts" / "build-keda")], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    na.kubectl("apply", "--server-side", "--force-conflicts", "-f", f"{keda}/crds")
    subprocess.run(
        [
            "helm", "install", "rk", str(REPO / "charts" / "rekindle"), "-n", ns,
            "--set", "crds.install=false",
            "--set", "image.repository=rekindle.local/operator", "--set", "image.tag=dev",
            "--set", "image.pullPolicy=Never",
            "--set", f"watchNamespaces={{{ns}}}", "--set", "statusIntervalSeconds=2",
            "--set", "front.enabled=true", "--set", "front.image.pullPolicy=Never",
            "--set", f"front.service.clusterIP={FRONT_IP}", "--set", f"front.url={FRONT}",
            "--set", "front.holdTimeoutSeconds=300",
            "--set", "keda.enabled=true", "--set", "keda.image.pullPolicy=Never",
            "--set", f"keda.operatorClusterIP={KEDA_OPERATOR_IP}",
            "--wait", "--timeout", "300s",
        ],
        check=True, env=na.ENV, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    na.wait(
        "KEDA's external metrics API",
        lambda: na.kubectl(
            "get", "apiservice", "v1beta1.external.metrics.k8s.io", "-o",
            'jsonpath={.status.conditions[?(@.type=="Available")].status}', check=False,
        ).strip() == "True",
        240,
    )  # fmt: skip


def service(ns: str, name: str, host: str, **spec: Any) -> None:
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["coldStart"]["storage"]["hostPath"]["path"] = host
    # Two replicas beside the operator, the front and KEDA on a 2-CPU node: the request
    # only places the pod (no limit: each uses what is free, as in every other arm).
    doc["spec"]["resources"]["cpu"] = "500m"
    doc["spec"].update(spec)
    na.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))


def checkpoint(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    """Wait Ready, checkpoint (a Checkpoint named after the service), wait for it."""

    def status(kind: str, obj: str) -> dict[str, Any]:
        return dict((kube.get(kind, ns, obj) or {}).get("status") or {})

    na.wait(f"{name} Ready", lambda: status("InferenceService", name).get("phase") == "Ready", 600)
    ck = {"apiVersion": "rekindle.dev/v1alpha1", "kind": "Checkpoint",
          "metadata": {"name": name}, "spec": {"inferenceService": name}}  # fmt: skip
    na.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(ck))
    na.wait(
        f"checkpoint {name}",
        lambda: status("Checkpoint", name).get("phase") in ("Ready", "Failed"), 600,
    )  # fmt: skip
    got = status("Checkpoint", name)
    if got.get("phase") != "Ready":
        raise SystemExit(f"checkpoint {name} failed: {got.get('message')}")
    na.wait(
        f"{name} to use it",
        lambda: status("InferenceService", name).get("checkpoint") == name, 120,
    )  # fmt: skip
    return got


def at_zero(kube: Kube, ns: str, name: str) -> None:
    def gone() -> bool:
        obj = kube.get("InferenceService", ns, name) or {}
        return obj.get("spec", {}).get("replicas") == 0 and not cluster_bench._pods(kube, ns, name)

    na.wait(f"{name} at zero with no pod", gone, 300)


def through_front(ns: str, name: str) -> tuple[float, int]:
    """A one-token completion through the front; (seconds to the answer, status)."""
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    req = urllib.request.Request(
        f"{FRONT}/{ns}/{name}/v1/completions", data=body.encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=400) as resp:
            resp.read()
            return time.monotonic() - t0, resp.status
    except urllib.error.HTTPError as e:
        return time.monotonic() - t0, e.code


def front_trial(kube: Kube, ns: str, arm: str, i: int) -> dict[str, Any]:
    name = SERVICE[arm]
    at_zero(kube, ns, name)
    seconds, code = through_front(ns, name)
    if code != 200:
        raise SystemExit(f"{arm} trial {i}: the front answered {code}")
    pods = cluster_bench._pods(kube, ns, name)
    origin, reason, agent_s = (
        cluster_bench.pod_report(kube, ns, pods[0]["metadata"]["name"]) if pods else ("?", "", None)
    )
    return {"arm": arm, "i": i, "first_answer_s": round(seconds, 3), "origin": origin,
            "reason": reason, "agent_ready_s": agent_s}  # fmt: skip


def scale_trial(kube: Kube, ns: str, i: int) -> dict[str, Any]:
    t = cluster_bench.one_trial(kube, ns, SERVICE["scale-restore"], MODEL, "restore", i)
    cluster_bench.scale(kube, ns, SERVICE["scale-restore"], 0)
    return {"arm": "scale-restore", "i": i, "first_answer_s": round(t.first_token_s, 3),
            "ready_s": round(t.ready_s, 3), "origin": t.origin, "reason": t.reason,
            "agent_ready_s": t.agent_ready_s}  # fmt: skip


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    med = {
        arm: statistics.median(t["first_answer_s"] for t in trials if t["arm"] == arm)
        for arm in ARMS
    }
    return {
        "median_first_answer_s": {a: round(v, 3) for a, v in med.items()},
        "front_restore_minus_scale_restore_s": round(
            med["front-restore"] - med["scale-restore"], 3
        ),
        "target_within_s": 1.0,
        "target_met": med["front-restore"] <= med["scale-restore"] + 1.0,
        "boot_over_restore_through_front": round(med["front-boot"] / med["front-restore"], 2),
    }


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    rows = [
        [arm, f"{s['median_first_answer_s'][arm]:.2f}",
         " / ".join(f"{t['first_answer_s']:.2f}" for t in doc["trials"] if t["arm"] == arm)]
        for arm in ARMS
    ]  # fmt: skip
    return (
        "# Scale from zero: the first request's wait\n\n"
        + md_table(["arm", "median s", "per trial s"], rows)
        + f"\nfront-restore - scale-restore: {s['front_restore_minus_scale_restore_s']:+.2f} s "
        f"(target: within +1 s: {'met' if s['target_met'] else 'MISSED'}); "
        f"boot / restore through the front: {s['boot_over_restore_through_front']}x\n"
    )


def plot(doc: dict[str, Any], path: Path) -> None:
    """Each arm's trials as points over its median bar: the wait at zero, seconds."""
    fig, ax = pyplot().subplots(figsize=(7, 4))
    med = doc["summary"]["median_first_answer_s"]
    for x, arm in enumerate(ARMS):
        ax.bar(x, med[arm], color="#9cc3e6" if arm != "front-boot" else "#e6a99c", width=0.6)
        ys = [t["first_answer_s"] for t in doc["trials"] if t["arm"] == arm]
        ax.plot([x + 0.2] * len(ys), ys, "k.", markersize=8)
        ax.annotate(
            f"{med[arm]:.2f} s", (x - 0.1, med[arm]), xytext=(0, 4), textcoords="offset points",
            ha="center", va="bottom", fontsize=9,
        )  # fmt: skip
    ax.set_xticks(range(len(ARMS)), ARMS)
    ax.set_ylabel("seconds to the first answer (median; dots: trials)")
    ax.grid(axis="y", alpha=0.3)
    save_figure(
        fig,
        path,
        "A request at zero: through the front and KEDA (restored, booted) "
        "vs the restore scaled by hand",
    )


def render(out: Path, doc: dict[str, Any]) -> str:
    text = markdown(doc)
    (out / "results.md").write_text(text + "\n![the first answer per arm](results.png)\n")
    plot(doc, out / "results.png")
    return text


def open_namespace(prefix: str) -> tuple[Kube, str, str]:
    """The cluster's client, a fresh namespace (prefix-XXXXXX) with the CRDs applied, and
    the node directory its hostPath checkpoints go to; what every autoscaling bench needs."""
    na.ENV.update(na.cluster_env())
    kube = Kube(load_configuration(na.ENV["KUBECONFIG"]))
    na.kubectl("apply", "-f", str(REPO / "charts/rekindle/files/crds"))
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    na.kubectl("create", "namespace", ns)
    return kube, ns, f"/var/lib/rekindle/bench-{ns}"


def close_namespace(ns: str, services: Iterable[str], host: str) -> None:
    """Undo open_namespace and install: the services, KEDA's objects, the chart, the
    namespace, and the checkpoints on the node (immutable once proven: rm -rf cannot)."""
    for name in services:
        na.kubectl("delete", "rkis", name, "-n", ns, "--timeout=120s", check=False)
    na.kubectl("delete", "scaledobjects.keda.sh", "--all", "-n", ns, "--timeout=90s", check=False)
    subprocess.run(["helm", "uninstall", "rk", "-n", ns, "--wait"], env=na.ENV, check=False,
                   capture_output=True, timeout=300)  # fmt: skip
    na.drop_finalizers(ns)
    na.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    if Path(host).exists():
        remove_tree(Path(host))


def run(args: argparse.Namespace) -> int:
    if args.replot:
        out = Path(args.out)
        print(render(out, json.loads((out / "results.json").read_text())))
        return 0
    if os.geteuid() != 0:
        raise SystemExit(
            "rekindle-dev bench scale-from-zero reads checkpoint files to warm them: run as root"
        )
    started, load0 = time.time(), os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kube, ns, host = open_namespace("bench-sfz")
    auto = {"minReplicas": 1, "maxReplicas": 1, "scaleDownDelay": SCALE_DOWN_DELAY_S}
    trials: list[dict[str, Any]] = []
    try:
        log(f"installing the chart (operator, front, KEDA) in {ns}")
        install(ns)
        service(ns, SERVICE["front-restore"], host, autoscaling=auto)
        service(ns, SERVICE["scale-restore"], host)
        storage = {"type": "hostPath", "hostPath": {"path": host}}
        to_zero = {**auto, "minReplicas": 0}
        service(ns, SERVICE["front-boot"], host, replicas=0, autoscaling=to_zero,
                coldStart={"restorePolicy": "Never", "storage": storage})  # fmt: skip
        log("booting and checkpointing")
        ckpts = {n: checkpoint(kube, ns, SERVICE[n]) for n in ("front-restore", "scale-restore")}
        # Now to zero: KEDA for the autoscaled one, by hand for the other.
        patch = json.dumps({"spec": {"autoscaling": to_zero}})
        na.kubectl("patch", "rkis", SERVICE["front-restore"], "-n", ns, "--type=merge",
                   "-p", patch)  # fmt: skip
        cluster_bench.scale(kube, ns, SERVICE["scale-restore"], 0)
        roots = {a: Path(host) / ns / SERVICE[a] / Path(ckpts[a]["path"]).name for a in ckpts}
        for i in range(args.trials):
            order = ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]
            for arm in order:
                res: dict[str, Any] = {}
                if arm in roots:
                    at_zero(kube, ns, SERVICE[arm])
                    na.read_all(roots[arm])
                    res = na.residency(roots[arm])
                t = (
                    scale_trial(kube, ns, i)
                    if arm == "scale-restore"
                    else front_trial(kube, ns, arm, i)
                )
                t["residency"] = res
                want = "booted" if arm == "front-boot" else "restored"
                if t["origin"] != want:
                    raise SystemExit(f"{arm} trial {i}: {t['origin']} ({t['reason']}), not {want}")
                trials.append(t)
                log(
                    f"[{arm} {i + 1}/{args.trials}] first answer "
                    f"{t['first_answer_s']:.2f}s ({t['origin']})"
                )
    finally:
        close_namespace(ns, SERVICE.values(), host)
    doc = {
        **provenance(
            "rekindle-dev bench scale-from-zero " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
            [
                "operator/rekindle_operator",
                "charts/rekindle",
                "images/runtime",
                "scripts/local-cluster",
                "scripts/rekindle_dev/bench_scale_from_zero.py",
            ],
            load0,
            started,
        ),
        "arms": {
            "front-restore": "at zero, one request through the front; KEDA wakes a replica, "
            "which restores",
            "front-boot": "the same with restorePolicy Never: the replica boots",
            "scale-restore": "no autoscaler, no front: scale 0 -> 1 by hand, first token through "
            "the Service (kubectl rekindle bench's trial)",
        },
        "timing": "first_answer_s: from sending the request (front arms) or the scale to 1 "
        "(scale-restore) to the one-token answer. " + cluster_bench.TIMING,
        "keda_polling_interval_s": 1,
        "trials": trials,
        "summary": summarize(trials),
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(render(out, doc))
    return 0
