"""Placement and secrets of an InferenceService's pods, on the real local cluster.

1. The single node is tainted (a unique key, for seconds only: other suites
   share the node, so the taint is always removed in a `finally`). An
   InferenceService with the matching toleration and a nodeSelector lands on
   it, with its extra pod labels and annotations (the operator's own win);
   one without the toleration stays Pending, and the scheduler's reason is in
   its status.pods[] and in `kubectl rekindle status`.
2. A value planted in a Secret reaches vLLM's own process (spec.env
   valueFrom secretKeyRef, and spec.envFrom), read from /proc/PID/environ in
   the pod, and appears nowhere else: not in the InferenceService's or the
   Checkpoint's status, the Events, the Deployment, the pods' metadata, the
   operator's log, the pod's log, `kubectl rekindle status`, the agent's /v1/status, or the
   checkpoint's manifest (only CRIU's memory images hold it, as they hold
   every byte of the process).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.cluster_tools import NODE1, kubectl, kubectl_json, wait_until
from tests.cluster.operator_fixtures import (
    OperatorProcess,
    apply,
    data_dir,
    get,
    host_dir,
    isvc_manifest,
    kubectl_rekindle,
    op_namespace,
    operator,
    pods_of,
    require_runtime_image,
    run_plugin,
    wait_status,
)

__all__ = ["host_dir", "kubectl_rekindle", "op_namespace", "operator"]  # fixtures used by name

pytestmark = pytest.mark.cluster

PLACED = "placed"
BLOCKED = "blocked"
TAINT_KEY = f"test.rekindle.dev/placement-{uuid.uuid4().hex[:8]}"
PLANTED = f"planted-{uuid.uuid4().hex}"  # the secret value that must not leak
BULK = f"{PLANTED}-bulk"
PLANTED_REF = {"name": "planted", "key": "token"}
GPU = {"device": "gpu"}


def node_name() -> str:
    """The node these tests place pods on: the first (the second is tainted for pods
    that ask for it; a pod that tolerates every taint could still land there)."""
    kubectl_json("get", "node", NODE1)  # fails at once if the cluster lacks it
    return NODE1


@contextlib.contextmanager
def tainted(node: str) -> Iterator[str]:
    """The node tainted NoSchedule with a unique key, untainted whatever happens."""
    kubectl("taint", "nodes", node, f"{TAINT_KEY}=x:NoSchedule")
    try:
        yield TAINT_KEY
    finally:
        kubectl("taint", "nodes", node, f"{TAINT_KEY}=x:NoSchedule-", check=False)
        taints = kubectl_json("get", "node", node)["spec"].get("taints") or []
        assert all(t["key"] != TAINT_KEY for t in taints), f"taint {TAINT_KEY} left on {node}"


@pytest.fixture(scope="module")
def secrets(op_namespace: str) -> None:
    """Secret `planted` (one key, for env valueFrom) and `bulk` (for envFrom)."""
    for name, key, value in (("planted", "token", PLANTED), ("bulk", "RK_BULK_SECRET", BULK)):
        kubectl(
            "create", "secret", "generic", name, "-n", op_namespace,
            f"--from-literal={key}={value}",
        )  # fmt: skip


@pytest.fixture(scope="module")
def applied(
    host_dir: Path, operator: OperatorProcess, op_namespace: str, secrets: None
) -> Iterator[dict[str, str]]:
    """Both InferenceServices at zero replicas: their objects exist before the taint.

    Scaled back to zero at the end, so the checkpoint taken from the placed pod
    (which maps it since its verification restore) can go without waiting."""
    require_runtime_image()
    node = node_name()
    placed = isvc_manifest(
        PLACED,
        str(host_dir),
        replicas=0,
        resources={"cpu": "250m", "memory": "6Gi"},
        # multimodal.enabled unset: the agent decides from the tiny (text) model's config.
        multimodal={"cacheSize": "512Mi", "maxObjectMiB": 64},
        env=[
            {"name": "RK_PLANTED_SECRET", "valueFrom": {"secretKeyRef": PLANTED_REF}},
            {"name": "RK_PLAIN", "value": "visible"},
        ],
        envFrom=[{"secretRef": {"name": "bulk"}}],
        podTemplate={
            "metadata": {
                "labels": {"team": "search", "rekindle.dev/inferenceservice": "hijack"},
                "annotations": {"example.com/owner": "ml-platform"},
            },
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "tolerations": [
                    {"key": TAINT_KEY, "operator": "Equal", "value": "x", "effect": "NoSchedule"}
                ],
            },
        },
    )
    blocked = isvc_manifest(
        BLOCKED,
        str(host_dir),
        replicas=0,
        resources={"cpu": "100m", "memory": "1Gi"},
        multimodal={"enabled": False},
    )
    for doc in (placed, blocked):
        r = apply(doc, op_namespace)
        assert r.returncode == 0, r.stderr
    for name in (PLACED, BLOCKED):
        wait_status(
            "rkis", name, op_namespace, "its Deployment", lambda o: bool(o.get("status")), 120
        )
    yield {"node": node}
    for name in (PLACED, BLOCKED):
        scale(op_namespace, name, 0)
    with contextlib.suppress(AssertionError):
        wait_until("no pods left", lambda: not pods_of(PLACED, op_namespace), 120)


def scale(ns: str, name: str, n: int) -> None:
    kubectl("scale", f"rkis/{name}", "-n", ns, f"--replicas={n}")


def scheduled_on(ns: str, name: str) -> str | None:
    pods = pods_of(name, ns)
    return pods[0]["spec"].get("nodeName") if pods else None


def blocked_reason(ns: str) -> str:
    """The reason the operator reports for the blocked replica ("" until it has one)."""
    pods = ((get("rkis", BLOCKED, ns) or {}).get("status") or {}).get("pods") or []
    return str(pods[0].get("reason") or "") if pods else ""


def test_toleration_and_node_selector_land_and_without_them_pending(
    applied: dict[str, str], op_namespace: str, kubectl_rekindle: dict[str, str]
) -> None:
    ns, node = op_namespace, applied["node"]
    started = time.monotonic()
    with tainted(node):
        scale(ns, PLACED, 1)
        scale(ns, BLOCKED, 1)
        # No namespace-wide unschedulable check here: the blocked pod is meant to be.
        wait_until("the tolerating pod scheduled", lambda: scheduled_on(ns, PLACED) == node, 90)
        wait_until(
            "the blocked replica's reason in the status",
            lambda: "untolerated taint" in blocked_reason(ns),
            90,
        )
        text = run_plugin(kubectl_rekindle, "-n", ns, "status", BLOCKED, timeout=60)
        # Free the node before asserting anything else: the blocked pod goes first.
        scale(ns, BLOCKED, 0)
        wait_until("the blocked pod gone", lambda: not pods_of(BLOCKED, ns), 90)
    print(f"node tainted for {time.monotonic() - started:.1f}s")

    assert scheduled_on(ns, BLOCKED) is None
    assert text.returncode == 0, text.stderr
    assert "Unschedulable" in text.stdout and "untolerated taint" in text.stdout, text.stdout
    assert "0 of 1 ready: pod" in text.stdout, text.stdout  # the Ready condition says it too

    pod = pods_of(PLACED, ns)[0]
    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels["team"] == "search"
    assert labels["rekindle.dev/inferenceservice"] == PLACED  # the operator's label wins
    assert annotations["example.com/owner"] == "ml-platform"
    tolerations = {t.get("key") for t in pod["spec"].get("tolerations") or []}
    assert TAINT_KEY in tolerations
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": node}


def test_fields_the_operator_owns_are_refused_at_apply(op_namespace: str, host_dir: Path) -> None:
    """The apiserver refuses them (strict field validation and CEL), saying what to change."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"podTemplate": {"spec": {"containers": [{"name": "x"}]}}}, "unknown field"),
        (
            {"podTemplate": {"spec": {"mainContainer": {"securityContext": {}}}}},
            "unknown field",
        ),
        (
            {"podTemplate": {"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}},
            "uses a name the operator's volumes have",
        ),
        (
            {
                "podTemplate": {
                    "spec": {
                        "volumes": [{"name": "v", "emptyDir": {}}],
                        "mainContainer": {"volumeMounts": [{"name": "v", "mountPath": "/dev/shm"}]},
                    }
                }
            },
            "a path the operator mounts",
        ),
        (
            {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]},
            "keep one of them",
        ),
        ({"resources": {"gpu": {"count": 1}}}, "spec.runtime.device is cpu"),
        (
            {"runtime": GPU, "tensorParallelSize": 2, "resources": {"gpu": {"count": 1}}},
            "at least spec.tensorParallelSize",
        ),
        (
            {"runtime": GPU, "resources": {"gpu": {"count": 1, "resourceName": "gpu"}}},
            "should match",
        ),
    ]
    for spec, words in cases:
        doc = isvc_manifest("refused", str(host_dir), **spec)
        r = apply(doc, op_namespace, "--dry-run=server")
        assert r.returncode != 0 and words in r.stderr, (spec, r.stderr)
    ok = isvc_manifest(
        "accepted",
        str(host_dir),
        runtime={"device": "gpu", "image": "rekindle.local/runtime-cpu:dev"},
        resources={"gpu": {"count": 1, "resourceName": "nvidia.com/mig-1g.10gb"}},
    )
    r = apply(ok, op_namespace, "--dry-run=server")
    assert r.returncode == 0, r.stderr


def vllm_proc(ns: str, pod: str, what: str) -> list[str]:
    """/proc/PID/<what> (environ, cmdline) of vLLM's API server process in the pod."""
    script = (
        "pid=$(pgrep -f -o vllm.entrypoints.openai.api_server) && "
        f"tr '\\0' '\\n' < /proc/$pid/{what}"
    )
    r = kubectl("exec", "-n", ns, pod, "-c", "vllm", "--", "sh", "-c", script, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def vllm_environ(ns: str, pod: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in vllm_proc(ns, pod, "environ") if "=" in line)


def agent_status(ns: str, pod: str) -> str:
    """The agent's /v1/status as the operator reads it (bearer token, admin port)."""
    code = (
        "import urllib.request as u;"
        "t=open('/var/run/rekindle/token').read().strip();"
        "r=u.Request('http://127.0.0.1:8081/v1/status',headers={'Authorization':'Bearer '+t});"
        "print(u.urlopen(r,timeout=10).read().decode())"
    )
    r = kubectl("exec", "-n", ns, pod, "-c", "vllm", "--", "python3", "-c", code, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_secret_env_reaches_vllm_and_appears_nowhere_else(
    applied: dict[str, str],
    operator: OperatorProcess,
    op_namespace: str,
    host_dir: Path,
    kubectl_rekindle: dict[str, str],
) -> None:
    ns = op_namespace
    scale(ns, PLACED, 1)  # already 1 after the placement test; 0 -> 1 when run alone

    def ready(o: dict[str, Any]) -> bool:
        st = o.get("status") or {}
        return st.get("phase") == "Ready" and (st.get("pods") or [{}])[0].get("ready") is True

    wait_status("rkis", PLACED, ns, "1 replica Ready", ready, 900)
    pod = pods_of(PLACED, ns)[0]["metadata"]["name"]

    env = vllm_environ(ns, pod)
    assert env.get("RK_PLANTED_SECRET") == PLANTED
    assert env.get("RK_BULK_SECRET") == BULK
    assert env.get("RK_PLAIN") == "visible"

    r = run_plugin(
        kubectl_rekindle, "-n", ns, "checkpoint", PLACED, "--checkpoint-name", "planted",
        "--wait", "--timeout", "300",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    ckpt = get("rkcp", "planted", ns)
    assert ckpt is not None

    places: dict[str, str] = {
        "checkpoint command output": r.stdout + r.stderr,
        "InferenceService and Checkpoint objects": kubectl(
            "get", "rkis,rkcp", "-n", ns, "-o", "json"
        ).stdout,
        "Events": kubectl("get", "events", "-n", ns, "-o", "json").stdout,
        "Deployments, ReplicaSets, pods, ConfigMaps": kubectl(
            "get", "deploy,rs,pods,configmaps", "-n", ns, "-o", "json"
        ).stdout,
        "kubectl rekindle status": run_plugin(
            kubectl_rekindle, "-n", ns, "status", PLACED, "-o", "json"
        ).stdout,
        "the agent's /v1/status": agent_status(ns, pod),
        "the pod's log (agent and vLLM)": kubectl("logs", "-n", ns, pod, "-c", "vllm").stdout,
        "the operator's log": operator.log.read_text(errors="replace"),
    }
    ckpt_dir = data_dir(host_dir, ckpt)
    files = [p for p in ckpt_dir.rglob("*") if p.is_file() and not p.name.endswith(".img")]
    assert any(p.name == "manifest.json" for p in files), files
    for p in files:
        if p.stat().st_size < 64 * 2**20:  # the agent's own files, not the weights dump
            places[f"checkpoint file {p.relative_to(ckpt_dir)}"] = p.read_text(errors="replace")
    # The planted values are really what a leak would look like in these texts.
    assert PLANTED in json.dumps(env)
    for where, text in places.items():
        assert PLANTED not in text, f"the planted secret value appears in {where}"
    # Names and references do appear: the fingerprint and the pod spec record them.
    assert "RK_PLANTED_SECRET" in places["Deployments, ReplicaSets, pods, ConfigMaps"]


def test_text_model_runs_without_the_multimodal_cache(
    applied: dict[str, str], op_namespace: str
) -> None:
    """multimodal.enabled unset: /dev/shm and the limit make room for the cache, the request
    does not, and the agent, reading the tiny model's config.json (a text model), starts
    vLLM without it."""
    ns = op_namespace
    scale(ns, PLACED, 1)
    wait_until("vLLM started", lambda: bool(running_vllm(ns)), 600)
    pod = pods_of(PLACED, ns)[0]
    argv = vllm_proc(ns, pod["metadata"]["name"], "cmdline")
    assert "--mm-processor-cache-type" not in argv, argv
    assert vllm_environ(ns, pod["metadata"]["name"]).get("REKINDLE_MM_CACHE_AUTO") == "1"
    res = pod["spec"]["containers"][0]["resources"]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm["sizeLimit"] == "1216Mi"  # sized as if the cache were on
    assert (res["requests"]["memory"], res["limits"]["memory"]) == ("6848Mi", "7360Mi")


def running_vllm(ns: str) -> str:
    """The placed pod's name once vLLM's process runs in it, else ""."""
    pods = pods_of(PLACED, ns)
    if not pods or not pods[0]["status"].get("podIP"):
        return ""
    name = str(pods[0]["metadata"]["name"])
    r = kubectl(
        "exec", "-n", ns, name, "-c", "vllm", "--",
        "pgrep", "-f", "vllm.entrypoints.openai.api_server", check=False,
    )  # fmt: skip
    return name if r.returncode == 0 else ""
