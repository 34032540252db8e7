"""Helpers that drive the real local cluster (scripts/local-cluster): kubectl, helm, waits."""

from __future__ import annotations

import calendar
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rekindle_operator.quantity import parse_quantity

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _cluster_env() -> dict[str, str]:
    lines = subprocess.run(
        [str(SCRIPTS / "local-cluster"), "env"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.splitlines()
    env = dict(os.environ)
    for line in lines:
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.replace("$PATH", env.get("PATH", ""))
    return env


ENV = _cluster_env()

# What each command the suite runs is, and how a machine without it gets it.
TOOLS = {
    "kubectl": "scripts/build-kubernetes builds the pinned kubectl (`make cluster-up` runs it)",
    "helm": "scripts/build-kubernetes builds the pinned helm (`make cluster-up` runs it)",
    "ctr": "it comes with Debian's containerd (`make cluster-up` installs it)",
    "openssl": "install Debian's openssl (`apt-get install openssl`)",
}


def require_tool(name: str) -> str:
    """The command's path on the cluster's PATH; fails (never skips) naming what is missing:
    a machine that cannot run a test must not pass it."""
    path = shutil.which(name, path=ENV.get("PATH"))
    if path is None:
        pytest.fail(
            f"{name} is not on PATH ({ENV.get('PATH')}), and the cluster suite needs it: "
            f"{TOOLS[name]}",
            pytrace=False,
        )
    return path


def kubectl(
    *args: str, input: str | None = None, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the pinned kubectl against the local cluster."""
    return subprocess.run(
        [require_tool("kubectl"), *args],
        input=input,
        env=ENV,
        check=check,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json").stdout)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("helm"), *args],
        env=ENV,
        check=check,
        capture_output=True,
        text=True,
        timeout=300,
    )


def wait_until(
    what: str, cond: Callable[[], bool], timeout: float = 120, namespace: str | None = None
) -> None:
    """Poll cond; with a namespace, a pod there that cannot be scheduled fails at once."""
    deadline = time.monotonic() + timeout
    next_check = 0.0
    while time.monotonic() < deadline:
        if cond():
            return
        if namespace and time.monotonic() >= next_check:
            fail_if_unschedulable(namespace)
            next_check = time.monotonic() + 5
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def create_namespace(prefix: str) -> str:
    """A new, uniquely named namespace, ready for pods (its default ServiceAccount exists)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    wait_until(
        "the default ServiceAccount",
        lambda: kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        60,
    )
    return name


UNSCHEDULABLE_GRACE_S = 20.0


def quantity(q: str) -> float:
    """A Kubernetes quantity ("100m", "1k", "6Gi") as a number."""
    return float(parse_quantity(q))


def pod_requests(pod: dict[str, Any]) -> tuple[float, int]:
    """(CPU cores, memory bytes) a pod asks the scheduler for."""
    cpu, mem = 0.0, 0
    for c in pod["spec"].get("containers", []):
        req = (c.get("resources") or {}).get("requests") or {}
        cpu += quantity(str(req.get("cpu", "0")))
        mem += int(quantity(str(req.get("memory", "0"))))
    return cpu, mem


# scripts/local-cluster's nodes: the first takes every pod; the second (up --nodes 2,
# what `make test-cluster` starts) is tainted, so only pods that tolerate it go there.
NODE1 = "rekindle-node"
NODE2 = "rekindle-node-2"
NODE2_TAINT = "rekindle.dev/node"
NODE2_TOLERATION = {"key": NODE2_TAINT, "operator": "Exists", "effect": "NoSchedule"}
# Host paths each node has its own of (NODE2's directory is bound over NODE_LOCAL in its
# mount namespace): a node agent's state directory goes below here.
NODE_LOCAL = "/var/lib/rekindle-cluster/node-local"
NODE2_LOCAL = "/var/lib/rekindle-cluster/nodes/2/node-local"


def node_local_path(path: str, node: str) -> str:
    """Where a node's NODE_LOCAL path is on this machine."""
    if node == NODE2 and path.startswith(NODE_LOCAL + "/"):
        return NODE2_LOCAL + path[len(NODE_LOCAL) :]
    return path


def require_second_node() -> None:
    names = {n["metadata"]["name"] for n in kubectl_json("get", "nodes")["items"]}
    if NODE2 not in names:
        raise AssertionError(
            f"the cluster has no node {NODE2}: `scripts/local-cluster up --nodes 2` "
            "(make test-cluster starts it so)"
        )


def node_room() -> tuple[float, int, list[str]]:
    """Free CPU and memory on the first node (allocatable minus what its running pods
    request), and which pods hold what (to say what occupies it)."""
    node = kubectl_json("get", "node", NODE1)
    alloc = node["status"]["allocatable"]
    cpu, mem = quantity(alloc["cpu"]), int(quantity(alloc["memory"]))
    holders = []
    for pod in kubectl_json("get", "pods", "-A")["items"]:
        if pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        if pod["spec"].get("nodeName") not in (None, NODE1):
            continue
        c, m = pod_requests(pod)
        if c or m:
            meta = pod["metadata"]
            holders.append(f"{meta['namespace']}/{meta['name']} ({c:g} CPU, {m / 2**30:.1f} GiB)")
        cpu -= c
        mem -= m
    return cpu, mem, holders


def unschedulable(namespace: str, grace: float = UNSCHEDULABLE_GRACE_S) -> list[str]:
    """Pods of namespace the scheduler has refused for longer than grace, with its reason."""
    out = []
    now = time.time()
    for pod in kubectl_json("get", "pods", "-n", namespace)["items"]:
        for cond in pod["status"].get("conditions") or []:
            if cond.get("type") != "PodScheduled" or cond.get("reason") != "Unschedulable":
                continue
            since = calendar.timegm(time.strptime(cond["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ"))
            if now - since >= grace:
                out.append(f"pod {pod['metadata']['name']}: {cond.get('message', 'unschedulable')}")
    return out


def fail_if_unschedulable(namespace: str) -> None:
    """A pod the node cannot hold never starts: fail now with the scheduler's reason."""
    refused = unschedulable(namespace)
    if refused:
        _, _, holders = node_room()
        raise AssertionError(
            "the scheduler refused: "
            + "; ".join(refused)
            + ". Requests on the node: "
            + (", ".join(holders) or "none")
        )
