"""`kubectl rekindle`: checkpoint, restore, status and bench an InferenceService;
gpu-check a cluster's GPU nodes.

Installed as the console script `kubectl-rekindle`, so kubectl finds it as a
plugin. Uses the same credentials as kubectl (--kubeconfig, KUBECONFIG,
~/.kube/config, --context; in a pod, its service account). Exit status: 0 done;
1 the operation failed or the API refused it; 2 bad usage or no usable
kubeconfig; 3 the cluster could not be reached. Errors are one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rekindle_operator.constants import (
    ANN_RESTART,
    API_VERSION,
    CKPT_FAILED,
    CKPT_KIND,
    CKPT_READY,
    ISVC_KIND,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubectl rekindle", description=__doc__)
    p.add_argument("-n", "--namespace", default=None, help="default: the kubeconfig's namespace")
    p.add_argument("--kubeconfig", default=None, help="default: KUBECONFIG, ~/.kube/config")
    p.add_argument("--context", default=None, help="default: the kubeconfig's current context")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("checkpoint", help="checkpoint a ready replica of NAME")
    c.add_argument("name", help="InferenceService")
    c.add_argument("--checkpoint-name", help="name of the Checkpoint (default NAME-<time>)")
    c.add_argument("--pod", help="checkpoint this pod (default: the oldest ready one)")
    c.add_argument("--retain", action="store_true", help="keep the data when the Checkpoint goes")
    c.add_argument("--wait", action="store_true", help="wait until Ready or Failed")
    c.add_argument("--timeout", type=_positive, default=1800.0, help="seconds (with --wait)")

    r = sub.add_parser("restore", help="recreate NAME's replicas from its newest checkpoint")
    r.add_argument("name")
    r.add_argument("--wait", action="store_true", help="wait until the new replicas are ready")
    r.add_argument("--timeout", type=_positive, default=900.0)

    s = sub.add_parser("status", help="how NAME's replicas came up, its checkpoints, /dev/shm")
    s.add_argument("name")
    s.add_argument("-o", "--output", choices=["text", "json"], default="text")

    b = sub.add_parser(
        "bench",
        help="cold start, scale 0->1: naive boot vs restore; --scale-out: N -> N+1 on a "
        "node that holds the checkpoint, on one that pulls it, and naive",
    )
    b.add_argument("name")
    b.add_argument("--trials", type=_trials, default=3, help="trials per arm (>= 1)")
    b.add_argument(
        "--scale-out",
        action="store_true",
        help="N -> N+1 replicas, the new one steered by cordoning the other nodes until it "
        "is bound (needs patch on nodes); needs storage type node with publish",
    )
    b.add_argument("--warm-node", help="--scale-out: a node whose cache holds the checkpoint")
    b.add_argument("--cold-node", help="--scale-out: a node that must pull it (and boots naive)")
    b.add_argument("--json", type=Path, help="write results as JSON here")
    b.add_argument("--plot", type=Path, help="write a PNG plot here")
    b.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="go on without asking although NAME serves (it is scaled to 0 between trials; "
        "--scale-out cordons nodes for seconds): for scripts",
    )

    g = sub.add_parser(
        "gpu-check",
        help="the GPU acceptance: boot, checkpoint, restore on the same and another GPU",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU needed: print the steps and run the checks that need none",
    )
    g.add_argument("--image", help="the runtime-gpu image (required without --dry-run)")
    g.add_argument("--model-source", default="/models/smollm2", help="spec.model.source")
    g.add_argument("--served-name", default="smollm2", help="spec.model.servedName")
    g.add_argument("--gpu-resource", default="nvidia.com/gpu", help="the GPU's resource name")
    g.add_argument("--node", help="run on this node (default: the one with most GPUs free)")
    g.add_argument(
        "--storage",
        choices=["node", "hostPath"],
        default="node",
        help="node: the node agent runs CRIU (unprivileged pods); hostPath: CRIU in the pod",
    )
    g.add_argument("--timeout", type=_positive, default=900.0, help="seconds per step")
    g.add_argument("--keep", action="store_true", help="keep the service and its checkpoints")
    g.add_argument("--out", type=Path, help="write the results as JSON here")
    g.add_argument(
        "--cpu",
        action="store_true",
        help="run the flow on a CPU cluster (developing this command): GPU checks are SKIP, "
        "the verdict is CPU-ONLY, never PASS",
    )
    return p


def _positive(v: str) -> float:
    f = float(v)
    if f <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0 seconds")
    return f


def _trials(v: str) -> int:
    try:
        n = int(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--trials {v!r} is not an integer") from e
    if n < 1:
        raise argparse.ArgumentTypeError(f"--trials {n}: use 1 or more (3+ for a median)")
    return n


def checkpoint_object(
    isvc: str, namespace: str, name: str | None, pod: str | None, retain: bool, timeout: float
) -> dict[str, Any]:
    """The Checkpoint the `checkpoint` subcommand creates."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    spec: dict[str, Any] = {
        "inferenceService": isvc,
        "deletionPolicy": "Retain" if retain else "Delete",
        "timeoutSeconds": max(60, int(timeout)),
    }
    if pod:
        spec["pod"] = pod
    return {
        "apiVersion": API_VERSION,
        "kind": CKPT_KIND,
        "metadata": {"name": name or f"{isvc}-{stamp}"[:253], "namespace": namespace},
        "spec": spec,
    }


def restart_patch(now: str | None = None) -> dict[str, Any]:
    """Bumping this annotation makes the operator roll the pods (like `kubectl rollout restart`)."""
    stamp = now or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"annotations": {ANN_RESTART: stamp}}}


def _kube(args: argparse.Namespace) -> Any:
    from rekindle_operator.kube import Kube, kubectl_configuration

    return Kube(kubectl_configuration(args.kubeconfig, args.context))


def _namespace(args: argparse.Namespace) -> str:
    """-n, else the namespace of the context in use, else "default" (as kubectl)."""
    if args.namespace:
        return str(args.namespace)
    try:
        from kubernetes import config

        contexts, active = config.list_kube_config_contexts(config_file=args.kubeconfig)
    except Exception:  # no kubeconfig (in a pod): _kube says what is missing
        return "default"
    if args.context:
        active = next((c for c in contexts if c.get("name") == args.context), {})
    return str((active.get("context") or {}).get("namespace") or "default")


def _require_isvc(kube: Any, ns: str, name: str) -> dict[str, Any]:
    isvc = kube.get(ISVC_KIND, ns, name)
    if isvc is None:
        raise SystemExit(f"error: InferenceService {name!r} not found in namespace {ns}")
    return dict(isvc)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    kube, ns = _kube(args), _namespace(args)
    _require_isvc(kube, ns, args.name)
    obj = checkpoint_object(
        args.name, ns, args.checkpoint_name, args.pod, args.retain, args.timeout
    )
    created = kube.create(obj)
    name = created["metadata"]["name"]
    print(f"checkpoint.rekindle.dev/{name} created")
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    last = ""
    while time.monotonic() < deadline:
        st = (kube.get(CKPT_KIND, ns, name) or {}).get("status") or {}
        phase = st.get("phase", "Pending")
        if phase != last:
            print(f"  {phase}" + (f": {st.get('message')}" if st.get("message") else ""))
            last = phase
        if phase == CKPT_READY:
            secs = st.get("phaseSeconds") or {}
            print(
                f"Ready: {st.get('size')} in {st.get('totalSeconds', 0):.1f}s at {st.get('path')}"
            )
            if secs:
                print("  phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in secs.items()))
            return _wait_in_use(kube, ns, args.name, name, deadline)
        if phase == CKPT_FAILED:
            print(f"Failed ({st.get('reason')}): {st.get('message')}", file=sys.stderr)
            return 1
        time.sleep(1)
    print(f"timed out after {args.timeout:.0f}s waiting for {name}", file=sys.stderr)
    return 1


def _wait_in_use(kube: Any, ns: str, isvc: str, ckpt: str, deadline: float) -> int:
    """Return once the InferenceService's status names ckpt, so the next scale-up restores.

    The operator refreshes that status every few seconds; without this wait a
    script that scales right after `checkpoint --wait` could still boot naively.
    """
    while time.monotonic() < deadline:
        current = ((kube.get(ISVC_KIND, ns, isvc) or {}).get("status") or {}).get("checkpoint")
        if current == ckpt:
            print(f"new replicas of {isvc} restore from {ckpt}")
            return 0
        time.sleep(1)
    print(f"{ckpt} is Ready but {isvc} does not use it yet (spec changed?)", file=sys.stderr)
    return 1


def cmd_restore(args: argparse.Namespace) -> int:
    kube, ns = _kube(args), _namespace(args)
    isvc = _require_isvc(kube, ns, args.name)
    ckpt = (isvc.get("status") or {}).get("checkpoint")
    if not ckpt:
        raise SystemExit(
            f"error: {args.name} has no Ready checkpoint that matches its spec: "
            f"run `kubectl rekindle checkpoint {args.name} --wait` first"
        )
    kube.merge_patch(ISVC_KIND, ns, args.name, restart_patch())
    print(f"{args.name}: replicas are being recreated from Checkpoint {ckpt}")
    if not args.wait:
        return 0
    from rekindle_operator import builders as b
    from rekindle_operator.selection import pod_ready

    time.sleep(3)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        dep = kube.get("Deployment", ns, b.deployment_name(args.name)) or {}
        st, want = dep.get("status") or {}, (dep.get("spec") or {}).get("replicas", 0)
        pods = kube.list("Pod", ns, b.selector_string(args.name))
        if (
            st.get("updatedReplicas", 0) == want
            and st.get("readyReplicas", 0) == want
            and len(pods) == want
            and all(pod_ready(p) for p in pods)
        ):
            print(f"{want} replica(s) ready")
            return 0
        time.sleep(1)
    print(f"timed out after {args.timeout:.0f}s", file=sys.stderr)
    return 1


def page_cache_note(doc: dict[str, Any] | None) -> str:
    """The pod line's page-cache note from its status.pageCache ("" without one)."""
    if not doc:
        return ""
    gib = 2**30
    return (
        f", checkpoint {doc.get('residentPercent', 0):g}% in page cache "
        f"({int(doc.get('residentBytes', 0)) / gib:.1f}/{int(doc.get('bytes', 0)) / gib:.1f} GiB)"
    )


def format_status(isvc: dict[str, Any], checkpoints: list[dict[str, Any]]) -> str:
    st = isvc.get("status") or {}
    name = isvc["metadata"]["name"]
    shm = st.get("sharedMemory") or {}
    lines = [
        f"InferenceService {name}: {st.get('phase', 'Unknown')}, "
        f"{st.get('readyReplicas', 0)}/{st.get('replicas', 0)} ready",
        f"  endpoint:   {st.get('endpoint', '-')}",
        f"  /dev/shm:   {shm.get('size', '-')} (need {int(shm.get('totalBytes', 0)) // 2**20}Mi)",
        f"  checkpoint: {st.get('checkpoint') or '- (new replicas boot normally)'}",
    ]
    cold = st.get("lastColdStartSeconds") or {}
    if cold:
        lines.append(
            "  last cold start: " + ", ".join(f"{k} {v}s" for k, v in sorted(cold.items()))
        )
    for p in st.get("pods") or []:
        why = f" ({p['reason']})" if p.get("reason") else ""
        agent = f", agent ready in {p['agentReadySeconds']}s" if "agentReadySeconds" in p else ""
        memory = f", memory {p['memory']} ({p.get('memoryReason', '')})" if p.get("memory") else ""
        where = f" on {p['node']}" if p.get("node") else ""
        # How it came up: boot, restore or restoreAfterPull (origin where not known).
        how = p.get("coldStartPath") or p.get("origin")
        lines.append(
            f"  pod {p['name']}{where}: {how}{why}, ready={p.get('ready')}"
            f"{agent}{memory}" + page_cache_note(p.get("pageCache"))
        )
    lines += format_nodes(st.get("nodes") or [])
    for c in st.get("conditions") or []:
        lines.append(f"  {c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}")
    mine = [c for c in checkpoints if (c.get("spec") or {}).get("inferenceService") == name]
    if mine:
        lines.append("  checkpoints:")
        for c in sorted(mine, key=lambda c: c["metadata"].get("creationTimestamp", "")):
            cs = c.get("status") or {}
            stale = " STALE" if cs.get("stale") else ""
            # The nodes whose cache holds it: made there, or a replica restored it there.
            held = sorted({cs["node"], *(cs.get("cachedNodes") or [])} if cs.get("node") else [])
            words = [
                f"{cs.get('phase', 'Pending')}{stale}",
                str(cs.get("size") or ""),
                str(cs.get("reason") or ""),
                f"on {', '.join(held)}" if held else "",
            ]
            lines.append(f"    {c['metadata']['name']}: " + " ".join(w for w in words if w))
            if cs.get("publication"):
                lines.append(f"      {cs['publication']}")
    return "\n".join(lines)


def format_nodes(nodes: list[dict[str, Any]]) -> list[str]:
    """One line per node that runs a replica: holds the checkpoint?, resident, cold starts."""
    if not nodes:
        return []
    out = ["  nodes:"]
    for n in nodes:
        cached = "checkpoint cached" if n.get("checkpointCached") else "checkpoint not proven here"
        resident = f" ({n['residentPercent']:g}% resident)" if "residentPercent" in n else ""
        cold = ", ".join(f"{k} {v}s" for k, v in sorted((n.get("coldStartSeconds") or {}).items()))
        out.append(
            f"    {n['name']}: {n.get('ready', 0)}/{n.get('replicas', 0)} ready, "
            f"{cached}{resident}" + (f", slowest cold start: {cold}" if cold else "")
        )
    return out


def cmd_status(args: argparse.Namespace) -> int:
    kube, ns = _kube(args), _namespace(args)
    isvc = _require_isvc(kube, ns, args.name)
    ckpts = kube.list(CKPT_KIND, ns)
    if args.output == "json":
        print(
            json.dumps(
                {
                    "inferenceService": isvc.get("status") or {},
                    "checkpoints": [
                        {"name": c["metadata"]["name"], **(c.get("status") or {})}
                        for c in ckpts
                        if (c.get("spec") or {}).get("inferenceService") == args.name
                    ],
                },
                indent=2,
            )
        )
    else:
        print(format_status(isvc, ckpts))
    return 0


def _progress(message: str) -> None:
    print(message, flush=True)


def cmd_bench(args: argparse.Namespace) -> int:
    from rekindle_operator import cluster_bench as bench
    from rekindle_operator import scale_out_bench

    kube, ns = _kube(args), _namespace(args)
    disturbs = bench_disturbs(kube, ns, args.name, args.scale_out)
    if disturbs and not args.yes and not _confirmed(disturbs):
        return EXIT_USAGE
    started, load_start = time.time(), bench.client_load()
    trials: Sequence[bench.Trial]
    if args.scale_out:
        plan = scale_out_bench.plan(kube, ns, args.name, args.warm_node, args.cold_node)
        print(
            f"{args.name}: {plan.replicas} -> {plan.replicas + 1} replicas; cached on "
            f"{plan.warm_node}, pull and naive on {plan.cold_node}",
            flush=True,
        )
        trials = scale_out_bench.run(kube, plan, args.trials, _progress)
        arms: Sequence[str] = scale_out_bench.ARMS
        title = f"{args.name}: {plan.replicas} → {plan.replicas + 1} replicas"
    else:
        trials = bench.run(kube, ns, args.name, args.trials, progress=_progress)
        arms, title = bench.ARMS, f"{args.name}: cold start, scale 0→1"
    timing = scale_out_bench.TIMING if args.scale_out else bench.TIMING
    print(bench.table(bench.summarize_trials(trials, arms)))
    meta = {
        "command": "kubectl rekindle " + " ".join(sys.argv[1:]),
        "inferenceService": args.name,
        "namespace": ns,
        **bench.environment(kube, trials, load_start, started, timing),
    }
    if args.json:
        bench.write_json(args.json, trials, meta)
        print(f"wrote {args.json}")
    if args.plot:
        bench.plot(trials, args.plot, f"{title} ({args.trials} trials)", arms)
        print(f"wrote {args.plot}")
    return 0


def bench_disturbs(kube: Any, ns: str, name: str, scale_out: bool) -> str:
    """What the benchmark would do to a service that serves ("" when it serves nobody)."""
    obj = kube.get("InferenceService", ns, name) or {}
    ready = int((obj.get("status") or {}).get("readyReplicas") or 0)
    if scale_out:
        return (
            f"{name} gains a replica per trial, and the cluster's other nodes are cordoned "
            "for the seconds until it is bound (other workloads cannot schedule there then)"
        )
    if ready == 0:
        return ""
    return (
        f"{ns}/{name} serves {ready} ready replica(s): the benchmark scales it to 0 before "
        "every trial, so its clients get errors until it is back"
    )


def _confirmed(disturbs: str) -> bool:
    """Ask on a terminal; refuse (and say how to go on) anywhere else."""
    if not sys.stdin.isatty():
        print(f"error: {disturbs}; run it on a copy, or pass --yes to go on", file=sys.stderr)
        return False
    answer = input(f"{disturbs}. Go on? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from rekindle_operator import gpu_check

    if not args.dry_run and not args.image:
        print("error: --image: the runtime-gpu image to run (or --dry-run)", file=sys.stderr)
        return EXIT_USAGE
    opts = gpu_check.Options(
        namespace=_namespace(args),
        image=args.image or gpu_check.DRY_RUN_IMAGE,
        model_source=args.model_source,
        served_name=args.served_name,
        gpu_resource=args.gpu_resource,
        node=args.node,
        storage=args.storage,
        timeout=args.timeout,
        keep=args.keep,
        cpu=args.cpu,
    )
    started = time.time()
    kube = _kube_or_none(args) if args.dry_run else _kube(args)
    outcome, checks = gpu_check.run(kube, opts, args.dry_run)
    print(outcome)
    if args.out:
        command = "kubectl rekindle " + " ".join(args.argv)
        gpu_check.write(args.out, gpu_check.results_doc(opts, outcome, checks, started, command))
        print(f"wrote {args.out}")
    return 0 if outcome in ("PASS", "DRY-RUN", "CPU-ONLY") else EXIT_FAILED


def _kube_or_none(args: argparse.Namespace) -> Any:
    """A client when a cluster answers, else None (a dry run says what it skipped)."""
    from urllib3.exceptions import HTTPError

    from rekindle_operator.kube import ConfigError, KubeError

    try:
        kube = _kube(args)
        kube.request("GET", "/version")
    except (ConfigError, KubeError, HTTPError, OSError) as e:
        print(f"SKIP    cluster: not reachable ({_reason(e)}): the cluster checks are skipped")
        return None
    return kube


COMMANDS = {
    "gpu-check": cmd_gpu_check,
    "checkpoint": cmd_checkpoint,
    "restore": cmd_restore,
    "status": cmd_status,
    "bench": cmd_bench,
}


EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # bad usage: argparse exits 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in results files
    from urllib3.exceptions import HTTPError

    from rekindle_operator.kube import ConfigError, KubeError

    try:
        return COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        return 130
    except ConfigError as e:  # one line that says what to do, never a traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KubeError as e:
        print(f"error: the API server refused: HTTP {e.status}: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    except (HTTPError, OSError) as e:
        print(f"error: cannot reach the cluster: {_reason(e)}", file=sys.stderr)
        return EXIT_UNREACHABLE


def _reason(e: BaseException) -> str:
    """urllib3's deepest reason (a refused connection, a TLS failure), on one line."""
    while getattr(e, "reason", None) is not None and isinstance(e.reason, BaseException):  # type: ignore[attr-defined]
        e = e.reason  # type: ignore[attr-defined]
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
