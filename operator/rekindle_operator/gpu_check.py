"""`kubectl rekindle gpu-check`: the GPU acceptance of a cluster, in one command.

On a cluster with the chart installed and one or two GPUs free, it runs what a
GPU node must do before anyone trusts it with restores, through the Kubernetes
API only (as `bench` does): it applies a one-replica InferenceService on a GPU,
times its cold boot and asks it a question, checkpoints it (vLLM sleeps at
level 2, what is left on the GPU is measured, CRIU and cuda-checkpoint dump
it, the agent restores it once and compares a canary), restores it into a new
pod on the same GPU, then, with a second GPU, restores a second replica while
the first holds its GPU (so the device plugin must give it another one, and
the restore maps the checkpoint's GPU onto it), and checks the negative cases
a GPU node must refuse cleanly. Every number is compared with an expected
range (EXPECT, each with why) and printed PASS or FAIL; a results file
(--out) records the numbers, the ranges, the node and the versions, for
docs/benchmarks.md.

--dry-run needs no GPU: it prints the steps it would take and does the checks
it can (the InferenceService and Checkpoint it would create pass the
operator's own validation; with a reachable cluster, the CRDs, the operator,
the node agent and which nodes offer GPUs). Its verdict is DRY-RUN, never PASS.
The service and its checkpoints are deleted at the end unless --keep.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rekindle_operator import builders as b
from rekindle_operator import cluster_bench
from rekindle_operator.constants import API_VERSION, CKPT_FAILED, CKPT_KIND, CKPT_READY, ISVC_KIND
from rekindle_operator.kube import Kube, KubeError
from rekindle_operator.pods import service_completion
from rekindle_operator.selection import pod_ready
from rekindle_operator.spec import SpecError, parse_spec

NAME = "rekindle-gpu-check"
# What a dry run validates when no --image is given (the chart's runtimeImages.gpu).
DRY_RUN_IMAGE = "rekindle.local/runtime-gpu:dev"
GIB = 2**30

Verdict = Literal["PASS", "FAIL", "SKIP", "DRY-RUN", "CPU-ONLY"]


@dataclass(frozen=True)
class Expect:
    """An expected range for one number, and why it is that range."""

    low: float | None
    high: float | None
    unit: str
    why: str

    def holds(self, value: float) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def words(self) -> str:
        if self.low is not None and self.high is not None:
            return f"{self.low:g}-{self.high:g} {self.unit}"
        if self.low is not None:
            return f">= {self.low:g} {self.unit}"
        return f"<= {self.high:g} {self.unit}"


EXPECT: dict[str, Expect] = {
    "boot_first_token_s": Expect(
        None, 900, "s", "a one-GPU vLLM boot (engine, weights, CUDA graphs) well inside 15 min"
    ),
    "gpu_memory_after_sleep_gib": Expect(
        None,
        1.0,
        "GiB",
        "what level-2 sleep leaves on the GPU is what cuda-checkpoint copies to host memory; "
        "the operator budgets 1 GiB per GPU for it",
    ),
    "checkpoint_s": Expect(None, 600, "s", "the Checkpoint's default timeout"),
    "restore_first_token_s": Expect(
        None, 120, "s", "pod creation to first token from a checkpoint on the same node"
    ),
    "restore_speedup": Expect(
        2.0, None, "x", "a restore that is not twice as fast as a boot is not worth its disk"
    ),
    "reload_gb_per_s": Expect(
        2.0,
        None,
        "GB/s",
        "the weight reload from the page cache to the GPU; pageable H2D measured 8 GB/s on an "
        "H100 (pinned 55 GB/s), so below 2 GB/s something else is the limit",
    ),
}


@dataclass(frozen=True)
class Step:
    """One step of the acceptance: what it does, and how many GPUs it needs."""

    key: str
    does: str
    gpus: int


STEPS: tuple[Step, ...] = (
    Step(
        "preflight",
        "the CRDs and the operator are installed, the node agent runs, and a node offers "
        "the GPU resource (allocatable minus what pods already requested)",
        0,
    ),
    Step(
        "validate",
        "the InferenceService and Checkpoint it creates pass the operator's own validation",
        0,
    ),
    Step(
        "boot",
        "apply a one-replica InferenceService on one GPU (restorePolicy Never); time pod "
        "creation to Ready and to the first token through the Service",
        1,
    ),
    Step(
        "checkpoint",
        "create a Checkpoint and wait for Ready: weights dumped, vLLM asleep at level 2 (GPU "
        "memory left measured), CRIU + cuda-checkpoint dump, one proving restore whose "
        "canary (greedy tokens and logprobs) must match",
        1,
    ),
    Step(
        "restore_same_gpu",
        "scale 0 -> 1: the new pod must restore (path restore, not boot); time to first "
        "token against the boot's, and the weight reload's bandwidth",
        1,
    ),
    Step(
        "restore_other_gpu",
        "scale 1 -> 2 while the first replica holds its GPU: the device plugin gives the "
        "second another GPU, and it must restore onto it (the checkpoint's GPU mapped to it)",
        2,
    ),
    Step(
        "negative",
        "change the spec (an env var): the checkpoint no longer matches, and the new pod "
        "boots instead of restoring, saying why",
        1,
    ),
)


@dataclass
class Check:
    step: str
    name: str
    verdict: Verdict
    value: float | str | None = None
    expect: str = ""
    note: str = ""


@dataclass
class Options:
    namespace: str
    image: str
    model_source: str
    served_name: str
    gpu_resource: str = "nvidia.com/gpu"
    node: str | None = None
    storage: str = "node"  # the node agent keeps checkpoints; hostPath: CRIU in the pod
    timeout: float = 900.0
    keep: bool = False
    # Exercise the flow on a CPU cluster (vLLM's CPU build): the GPU-only checks are
    # SKIP and the verdict is never PASS. For developing this command, not for nodes.
    cpu: bool = False
    extra_spec: dict[str, Any] = field(default_factory=dict)


def isvc_object(opts: Options, replicas: int = 1) -> dict[str, Any]:
    """The InferenceService the check applies: one GPU, tensor parallel 1 (GPU
    checkpoints are TP 1), checkpoints kept by the node agent (storage node) or, with
    storage hostPath, by the privileged pod's own CRIU."""
    resources: dict[str, Any] = {"cpu": "1", "memory": "6Gi"}
    if not opts.cpu:
        resources = {
            "cpu": "4",
            "memory": "24Gi",
            "gpu": {"count": 1, "resourceName": opts.gpu_resource},
        }
    spec: dict[str, Any] = {
        "model": {"source": opts.model_source, "servedName": opts.served_name},
        "runtime": {"image": opts.image, "device": "cpu" if opts.cpu else "gpu"},
        "resources": resources,
        "replicas": replicas,
        "maxModelLen": 2048,
        "coldStart": {"restorePolicy": "Never", "storage": _storage(opts.storage)},
    }
    if opts.node:
        spec["podTemplate"] = {"spec": {"nodeSelector": {"kubernetes.io/hostname": opts.node}}}
    spec.update(opts.extra_spec)
    return {
        "apiVersion": API_VERSION,
        "kind": ISVC_KIND,
        "metadata": {"name": NAME, "namespace": opts.namespace},
        "spec": spec,
    }


def _storage(kind: str) -> dict[str, Any]:
    if kind == "hostPath":
        return {"type": "hostPath", "hostPath": {"path": "/var/lib/rekindle/checkpoints"}}
    return {"type": kind}


def checkpoint_object(namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": CKPT_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"inferenceService": NAME, "deletionPolicy": "Delete", "timeoutSeconds": 900},
    }


def judge(step: str, name: str, value: float, key: str, note: str = "") -> Check:
    """A number against EXPECT[key]."""
    e = EXPECT[key]
    verdict: Verdict = "PASS" if e.holds(value) else "FAIL"
    return Check(step, name, verdict, round(value, 3), e.words(), note)


def validate(opts: Options) -> list[Check]:
    """What needs no cluster: the objects it would create pass the operator's validation."""
    obj = isvc_object(opts)
    try:
        spec = parse_spec(NAME, opts.namespace, obj["spec"])
    except SpecError as e:
        return [Check("validate", "InferenceService", "FAIL", note=str(e))]
    out = [
        Check(
            "validate",
            "InferenceService",
            "PASS",
            f"{spec.gpus} x {spec.gpu_resource}, TP {spec.tensor_parallel_size}",
        )
    ]
    ck = checkpoint_object(opts.namespace, f"{NAME}-1")
    ok = ck["spec"]["inferenceService"] == NAME and ck["spec"]["timeoutSeconds"] >= 60
    out.append(Check("validate", "Checkpoint", "PASS" if ok else "FAIL", ck["metadata"]["name"]))
    return out


@dataclass
class GpuNode:
    name: str
    allocatable: int
    requested: int

    @property
    def free(self) -> int:
        return self.allocatable - self.requested


def gpu_nodes(kube: Kube, resource: str) -> list[GpuNode]:
    """Nodes with the GPU resource, and how many of it pods already requested there."""
    nodes = kube.request("GET", "/api/v1/nodes").get("items", [])
    out = []
    for n in nodes:
        alloc = int(str(((n.get("status") or {}).get("allocatable") or {}).get(resource, "0")))
        if alloc <= 0:
            continue
        name = n["metadata"]["name"]
        query = {"fieldSelector": f"spec.nodeName={name}"}
        pods = kube.request("GET", "/api/v1/pods", query=query).get("items", [])
        used = 0
        for p in pods:
            if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            for c in (p.get("spec") or {}).get("containers") or []:
                limits = (c.get("resources") or {}).get("limits") or {}
                used += int(str(limits.get(resource, "0")))
        out.append(GpuNode(name, alloc, used))
    return out


def preflight(kube: Kube, opts: Options, dry_run: bool) -> tuple[list[Check], int]:
    """The cluster part that needs no GPU; (checks, GPUs free on the chosen node)."""
    out = []
    for plural in ("inferenceservices", "checkpoints"):
        try:
            kube.request(
                "GET",
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.rekindle.dev",
            )
            out.append(Check("preflight", f"CRD {plural}", "PASS"))
        except KubeError as e:
            out.append(Check("preflight", f"CRD {plural}", "FAIL", note=f"HTTP {e.status}"))
    operator = cluster_bench._operator(kube)
    out.append(
        Check(
            "preflight",
            "operator",
            "FAIL" if "error" in operator else "PASS",
            note=str(operator.get("error") or operator["deployments"][0]["deployment"]),
        )
    )
    if opts.storage == "node":
        out.append(_node_agents(kube))
    else:
        out.append(
            Check(
                "preflight", "node agent", "SKIP", note=f"storage {opts.storage}: CRIU in the pod"
            )
        )
    if opts.cpu:
        out.append(Check("preflight", "GPU node", "SKIP", note="--cpu: vLLM's CPU build"))
        return out, 0
    nodes = [n for n in gpu_nodes(kube, opts.gpu_resource) if not opts.node or n.name == opts.node]
    best = max(nodes, key=lambda n: n.free, default=None)
    free = best.free if best else 0
    if best is None or free < 1:
        what = f"no node offers a free {opts.gpu_resource}" + (
            f" ({', '.join(f'{n.name}: {n.free} free' for n in nodes)})" if nodes else ""
        )
        verdict: Verdict = "SKIP" if dry_run else "FAIL"
        out.append(Check("preflight", "GPU node", verdict, 0, ">= 1 free", what))
    else:
        opts.node = opts.node or best.name
        out.append(Check("preflight", "GPU node", "PASS", free, ">= 1 free", best.name))
    return out, free


def _node_agents(kube: Kube) -> Check:
    query = {
        "labelSelector": "app.kubernetes.io/part-of=rekindle,app.kubernetes.io/component=node-agent"
    }
    try:
        items = kube.request("GET", "/apis/apps/v1/daemonsets", query=query).get("items", [])
    except (KubeError, OSError, ValueError) as e:
        return Check("preflight", "node agent", "FAIL", note=f"cannot list DaemonSets: {e}")
    if not items:
        return Check(
            "preflight", "node agent", "FAIL", note="no node-agent DaemonSet (the chart's)"
        )
    st = items[0].get("status") or {}
    ready, want = int(st.get("numberReady", 0)), int(st.get("desiredNumberScheduled", 0))
    verdict: Verdict = "PASS" if want and ready == want else "FAIL"
    return Check("preflight", "node agent", verdict, f"{ready}/{want} ready")


class Run:
    """The real acceptance against a cluster with a GPU (each step appends its checks)."""

    def __init__(self, kube: Kube, opts: Options, progress: Callable[[str], None] = print) -> None:
        self.kube = kube
        self.opts = opts
        self.progress = progress
        self.checks: list[Check] = []
        self.boot_first_token: float | None = None
        self.checkpoint_name = f"{NAME}-{int(time.time())}"

    @property
    def ns(self) -> str:
        return self.opts.namespace

    def add(self, check: Check) -> None:
        self.checks.append(check)
        self.progress(format_check(check))

    def boot(self) -> None:
        self.kube.apply(isvc_object(self.opts))
        t = cluster_bench.one_trial(
            self.kube, self.ns, NAME, self.opts.served_name, "naive", 0, self.opts.timeout
        )
        self.boot_first_token = t.first_token_s
        self.add(judge("boot", "first token", t.first_token_s, "boot_first_token_s", t.pod))
        self.add(Check("boot", "path", "PASS" if t.origin == "booted" else "FAIL", t.origin))

    def checkpoint(self) -> None:
        self.kube.create(checkpoint_object(self.ns, self.checkpoint_name))
        st = self._wait_checkpoint()
        if st.get("phase") != CKPT_READY:
            self.add(
                Check("checkpoint", "Ready", "FAIL", st.get("reason"), note=st.get("message", ""))
            )
            raise _Stop
        self.add(Check("checkpoint", "Ready", "PASS", st.get("size"), note=st.get("reason", "")))
        self.add(judge("checkpoint", "seconds", float(st.get("totalSeconds", 0)), "checkpoint_s"))
        left = st.get("gpuMemoryAfterSleepBytes")
        if self.opts.cpu:
            self.add(Check("checkpoint", "GPU memory after sleep", "SKIP", note="--cpu"))
        elif left is None:
            self.add(Check("checkpoint", "GPU memory after sleep", "FAIL", note="not reported"))
        else:
            self.add(
                judge(
                    "checkpoint",
                    "GPU memory after sleep",
                    int(left) / GIB,
                    "gpu_memory_after_sleep_gib",
                )
            )
        phases = st.get("phaseSeconds") or {}
        self.add(Check("checkpoint", "phases", "PASS", json.dumps(phases)))

    def _wait_checkpoint(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.opts.timeout
        while time.monotonic() < deadline:
            ck = self.kube.get(CKPT_KIND, self.ns, self.checkpoint_name) or {}
            st: dict[str, Any] = ck.get("status") or {}
            if st.get("phase") in (CKPT_READY, CKPT_FAILED):
                return st
            time.sleep(2)
        return {"phase": "Timeout", "reason": "timeout", "message": f"{self.opts.timeout:.0f}s"}

    def restore_same_gpu(self) -> None:
        t = cluster_bench.one_trial(
            self.kube, self.ns, NAME, self.opts.served_name, "restore", 0, self.opts.timeout
        )
        ok = t.origin == "restored"
        self.add(
            Check("restore_same_gpu", "path", "PASS" if ok else "FAIL", t.origin, note=t.reason)
        )
        if not ok:
            raise _Stop
        self.add(
            judge(
                "restore_same_gpu", "first token", t.first_token_s, "restore_first_token_s", t.pod
            )
        )
        if self.boot_first_token:
            speedup = self.boot_first_token / max(t.first_token_s, 1e-9)
            self.add(judge("restore_same_gpu", "speedup vs boot", speedup, "restore_speedup"))
        self._reload_bandwidth(t.pod)

    def _restore_phases(self, pod: str, wait_s: float = 30.0) -> dict[str, Any]:
        """The pod's restore phases from the service's status (refreshed every few
        seconds: waited for, bounded)."""
        deadline = time.monotonic() + wait_s
        while True:
            isvc = self.kube.get(ISVC_KIND, self.ns, NAME) or {}
            for p in (isvc.get("status") or {}).get("pods") or []:
                if p.get("name") == pod and p.get("restoreSeconds"):
                    return dict(p["restoreSeconds"])
            if time.monotonic() >= deadline:
                return {}
            time.sleep(1)

    def _reload_bandwidth(self, pod: str) -> None:
        reload_s = self._restore_phases(pod).get("reload_weights")
        ck = self.kube.get(CKPT_KIND, self.ns, self.checkpoint_name) or {}
        weights = (ck.get("status") or {}).get("weightsBytes")
        if not reload_s or not weights:
            self.add(Check("restore_same_gpu", "reload bandwidth", "FAIL", note="not reported"))
            return
        gbps = int(weights) / float(reload_s) / 1e9
        check = judge("restore_same_gpu", "reload bandwidth", gbps, "reload_gb_per_s")
        if self.opts.cpu:  # page cache to anonymous memory: the floor is host-to-GPU's
            check.verdict, check.note = "SKIP", "--cpu: a host copy, not host to GPU"
        self.add(check)

    def restore_other_gpu(self, free: int) -> None:
        if free < 2:
            self.add(Check("restore_other_gpu", "second GPU", "SKIP", free, ">= 2 free"))
            return
        cluster_bench.scale(self.kube, self.ns, NAME, 2, "IfAvailable")
        deadline = time.monotonic() + self.opts.timeout
        pods: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            pods = [p for p in self.kube.list("Pod", self.ns, b.selector_string(NAME))]
            if len(pods) == 2 and all(pod_ready(p) for p in pods):
                break
            time.sleep(1)
        names = sorted(p["metadata"]["name"] for p in pods)
        if len(pods) != 2 or not all(pod_ready(p) for p in pods):
            self.add(Check("restore_other_gpu", "second replica Ready", "FAIL", ",".join(names)))
            return
        paths = {
            p["metadata"]["name"]: cluster_bench.pod_report(
                self.kube, self.ns, p["metadata"]["name"]
            )
            for p in pods
        }
        for name, (origin, reason, _s) in sorted(paths.items()):
            verdict: Verdict = "PASS" if origin == "restored" else "FAIL"
            self.add(Check("restore_other_gpu", f"path of {name}", verdict, origin, note=reason))
        answered = service_completion(
            self.kube, self.ns, b.service_name(NAME), self.opts.served_name
        )
        self.add(Check("restore_other_gpu", "answers", "PASS" if answered else "FAIL"))

    def negative(self) -> None:
        """A pod whose fingerprint differs (an env var changed: a new spec) boots, with why."""
        env = [{"name": "REKINDLE_GPU_CHECK_CHANGED", "value": str(int(time.time()))}]
        self.kube.merge_patch(ISVC_KIND, self.ns, NAME, {"spec": {"env": env, "replicas": 0}})
        cluster_bench.wait_gone(self.kube, self.ns, NAME)
        cluster_bench.scale(self.kube, self.ns, NAME, 1, "IfAvailable")
        deadline = time.monotonic() + self.opts.timeout
        origin, reason = "unknown", ""
        while time.monotonic() < deadline:
            pods = cluster_bench._pods(self.kube, self.ns, NAME)
            if pods and pod_ready(pods[0]):
                origin, reason, _ = cluster_bench.pod_report(
                    self.kube, self.ns, pods[0]["metadata"]["name"]
                )
                break
            time.sleep(1)
        verdict: Verdict = "PASS" if origin == "booted" and reason else "FAIL"
        self.add(Check("negative", "changed spec boots", verdict, origin, note=reason))

    def cleanup(self) -> None:
        if self.opts.keep:
            return
        for ck in self.kube.list(CKPT_KIND, self.ns):
            if (ck.get("spec") or {}).get("inferenceService") == NAME:
                self.kube.delete(CKPT_KIND, self.ns, ck["metadata"]["name"])
        self.kube.delete(ISVC_KIND, self.ns, NAME)


class _Stop(Exception):
    """A step failed that the next ones need: stop, report, clean up."""


def format_check(c: Check) -> str:
    value = "" if c.value is None else f" {c.value}"
    expect = f" (expect {c.expect})" if c.expect else ""
    note = f": {c.note}" if c.note else ""
    return f"{c.verdict:<7} {c.step}/{c.name}{value}{expect}{note}"


def verdict(checks: Sequence[Check], dry_run: bool, cpu: bool = False) -> Verdict:
    """FAIL on any FAIL; never PASS without running on a GPU."""
    if any(c.verdict == "FAIL" for c in checks):
        return "FAIL"
    if cpu:
        return "CPU-ONLY"
    return "DRY-RUN" if dry_run else "PASS"


def plan_lines(free: int | None) -> list[str]:
    """The steps, numbered, each with whether this cluster has the GPUs it needs."""
    out = []
    for i, s in enumerate(STEPS, 1):
        gpus = f" [needs {s.gpus} GPU{'s' if s.gpus > 1 else ''}]" if s.gpus else ""
        short = (
            " (not on this cluster: too few GPUs free)"
            if free is not None and free < s.gpus
            else ""
        )
        out.append(f"{i}. {s.key}{gpus}{short}: {s.does}")
    return out


def run(
    kube: Kube | None,
    opts: Options,
    dry_run: bool,
    progress: Callable[[str], None] = print,
) -> tuple[Verdict, list[Check]]:
    """The whole acceptance (or, dry_run, its plan and the checks that need no GPU).
    kube None: no cluster could be reached (dry_run only)."""
    checks = validate(opts)
    for c in checks:
        progress(format_check(c))
    free: int | None = None
    if kube is not None:
        pre, free = preflight(kube, opts, dry_run)
        for c in pre:
            progress(format_check(c))
        checks += pre
    if dry_run:
        progress("steps a real run takes:")
        for line in plan_lines(free):
            progress("  " + line)
        return verdict(checks, True, opts.cpu), checks
    if kube is None or any(c.verdict == "FAIL" for c in checks):
        return "FAIL", checks
    r = Run(kube, opts, progress)
    try:
        r.boot()
        r.checkpoint()
        r.restore_same_gpu()
        r.restore_other_gpu(free or 0)
        r.negative()
    except _Stop:
        pass
    except (KubeError, TimeoutError) as e:
        r.add(Check("run", "error", "FAIL", note=str(e)))
    finally:
        r.cleanup()
    checks += r.checks
    return verdict(checks, False, opts.cpu), checks


def results_doc(
    opts: Options, outcome: Verdict, checks: Sequence[Check], started: float, command: str
) -> dict[str, Any]:
    """The results file: verdict, every check with its range, what it ran on."""
    from rekindle_contract import __version__

    return {
        "kind": "gpu-check",
        "verdict": outcome,
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kubectl_rekindle": __version__,
        "client": {"node": platform.node(), "load_avg": list(cluster_bench.client_load())},
        "node": opts.node,
        "image": opts.image,
        "model": opts.model_source,
        "expect": {k: asdict(v) for k, v in EXPECT.items()},
        "steps": [asdict(s) for s in STEPS],
        "checks": [asdict(c) for c in checks],
    }


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
