"""Operator-specific helpers for the cluster suite: CRDs, the operator process, objects.

The operator runs outside the cluster (kopf against the kubeconfig), started as
a subprocess in its own process group and killed with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from rekindle_agent.mapped_files.immutable import remove_tree

from tests.cluster.cluster_tools import (
    ENV,
    REPO,
    create_namespace,
    fail_if_unschedulable,
    kubectl,
    kubectl_json,
    require_tool,
    wait_until,
)

CRDS = REPO / "charts" / "rekindle" / "files" / "crds"
RUNTIME_IMAGE = "rekindle.local/runtime-cpu:dev"
OPERATOR_IMAGE = "rekindle.local/operator:dev"


def install_crds() -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    for f in sorted(CRDS.glob("*.yaml")):
        name = yaml.safe_load(f.read_text())["metadata"]["name"]
        kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


def apply(
    obj: dict[str, Any] | str, namespace: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return kubectl("apply", "-n", namespace, *extra, "-f", "-", input=text, check=False)


def host_path_claim(
    ns: str, claim: str, directory: Path, access_mode: str = "ReadWriteOnce", size: str = "1Gi"
) -> str:
    """A hostPath PersistentVolume holding directory, bound to claim in ns (no
    provisioner in the local cluster): what a platform's NFS or CSI volume is to
    the tests. Returns the volume's name (cluster-scoped: delete it after)."""
    pv = f"{ns}-{claim}"
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": pv},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": [access_mode],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(directory), "type": "Directory"},
            "claimRef": {"namespace": ns, "name": claim},
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps(volume))
    r = apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "accessModes": [access_mode],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": size}},
            },
        },
        ns,
    )
    assert r.returncode == 0, r.stderr
    return pv


def get(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    r = kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def isvc_manifest(
    name: str, host_path: str, example: str = "tiny-cpu.yaml", **spec: Any
) -> dict[str, Any]:
    """An example InferenceService (default tiny-cpu.yaml) with a per-test storage path."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / example).read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["coldStart"]["storage"]["hostPath"]["path"] = host_path
    doc["spec"].update(spec)
    return doc


class OperatorProcess:
    """`python -m rekindle_operator` for some namespaces, restartable, killed as a group."""

    def __init__(
        self, namespace: str | list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.namespaces = [namespace] if isinstance(namespace, str) else list(namespace)
        self.namespace = self.namespaces[0]
        self.log = log
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**ENV, "REKINDLE_STATUS_INTERVAL": "2", **self.env}
        args = [a for ns in self.namespaces for a in ("--namespace", ns)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rekindle_operator", *args, "-v"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="module")
def op_namespace(cluster: dict[str, str]) -> Iterator[str]:
    """One namespace for a module (vLLM boots are expensive: tests share them)."""
    install_crds()
    name = create_namespace("rk")
    yield name
    release(name)  # finalizers left by a stopped operator must not keep the namespace alive
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def host_dir(op_namespace: str) -> Iterator[Path]:
    """The module's checkpoint root on the node (a hostPath), removed at the end.

    Ask for it before `operator`: fixtures end in reverse order, so the operator then
    deletes its objects (and their checkpoints) before this removes what is left."""
    path = Path(f"/var/lib/rekindle/test-{op_namespace}")
    yield path
    with contextlib.suppress(OSError):
        remove_tree(path)  # immutable pages images: rm -rf cannot


@pytest.fixture(scope="module")
def operator(
    op_namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(op_namespace, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    wind_down(op_namespace)
    op.kill(signal.SIGTERM)
    print(f"operator log tail:\n{op.tail()}")


def wind_down(namespace: str) -> None:
    """Remove what a module left in namespace while its operator still runs.

    Its pods go first (scaled to zero), so no Checkpoint waits for a replica that maps
    it; then the Checkpoints, whose data the operator removes with a Job (waited for);
    then the InferenceServices, without waiting: their deletion has nothing to do but
    kopf's finalizer, which the operator can hold for a minute when a status timer is
    running at that moment (kopf polls a busy timer every 60 s), and which op_namespace
    lifts once the operator is stopped."""
    kubectl("scale", "rkis", "--all", "-n", namespace, "--replicas=0", check=False)
    with contextlib.suppress(AssertionError):
        wait_until(
            "the InferenceServices' pods gone",
            lambda: (
                not kubectl(
                    "get", "pods", "-n", namespace, "-l", LABEL, "-o", "name", check=False
                ).stdout.strip()
            ),
            120,
        )
    kubectl("delete", CKPT_CRD, "--all", "-n", namespace, "--timeout=60s", check=False)
    finish_jobs(namespace)
    kubectl("delete", ISVC_CRD, "--all", "-n", namespace, "--wait=false", check=False)


CKPT_CRD, ISVC_CRD = "checkpoints.rekindle.dev", "inferenceservices.rekindle.dev"
LABEL = "rekindle.dev/inferenceservice"


def release(namespace: str) -> None:
    """Lift the finalizers a stopped operator left, so the namespace can go."""
    for kind in (CKPT_CRD, ISVC_CRD):
        items = kubectl("get", kind, "-n", namespace, "-o", "name", check=False).stdout.split()
        for item in items:
            kubectl(
                "patch", item, "-n", namespace, "--type=merge",
                "-p", '{"metadata":{"finalizers":null}}', check=False,
            )  # fmt: skip


def finish_jobs(namespace: str, timeout: float = 120) -> None:
    """Wait (bounded) for the cleanup Jobs of deleted Checkpoints to end, so that whatever
    removes the module's storage afterwards does not race them (both removing the same
    files, one fails on a file the other just removed)."""

    def done() -> bool:
        jobs = kubectl_json("get", "jobs", "-n", namespace)["items"]
        return all(
            any(
                c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                for c in (j.get("status") or {}).get("conditions") or []
            )
            for j in jobs
        )

    with contextlib.suppress(AssertionError):  # teardown: what is left, host_dir removes
        wait_until("the cleanup Jobs to end", done, timeout)


@pytest.fixture(scope="module")
def kubectl_rekindle() -> dict[str, str]:
    """An environment where `kubectl rekindle` finds the installed console script."""
    plugin = shutil.which("kubectl-rekindle", path=str(Path(sys.executable).parent))
    if plugin is None:
        pytest.fail(f"kubectl-rekindle is not installed beside {sys.executable}: run `make env`")
    return {**ENV, "PATH": f"{Path(plugin).parent}{os.pathsep}{ENV['PATH']}"}


def run_plugin(
    env: dict[str, str], *args: str, timeout: float = 360
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("kubectl"), "rekindle", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def require_image(image: str = RUNTIME_IMAGE, build: str = "runtime-cpu") -> None:
    """`make images` loads the local images into the node; say how if one is missing."""
    out = subprocess.run(
        [
            require_tool("ctr"),
            "--address",
            "/run/rekindle-cluster/containerd/containerd.sock",
            "-n",
            "k8s.io",
            "images",
            "ls",
            "-q",
        ],
        capture_output=True,
        text=True,
        env=ENV,
    )
    if image not in out.stdout.split():
        pytest.fail(
            f"{image} is not loaded into the node ({out.stderr.strip()}): run "
            f"`scripts/local-cluster load-image $(scripts/build-image {build})` (or `make images`)"
        )


def require_runtime_image() -> None:
    require_image(RUNTIME_IMAGE, "runtime-cpu")


def wait_status(
    kind: str, name: str, namespace: str, what: str, cond: Any, timeout: float = 300
) -> dict[str, Any]:
    """Poll an object until cond(obj) holds; returns the object (fails with its status)."""
    last: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = get(kind, name, namespace)
        if obj is not None:
            last = obj
            if cond(obj):
                return obj
        fail_if_unschedulable(namespace)
        time.sleep(1)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {kind}/{name}: {what}; last status: "
        f"{json.dumps(last.get('status'), indent=1)[:3000]}"
    )


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    """POST (or GET) JSON; an HTTP error names the answer's body (who refused, and why)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # still an HTTPError (an OSError) for callers
        answer = e.read().decode(errors="replace")[:2000]
        raise urllib.error.HTTPError(url, e.code, f"{e.reason}: {answer}", e.headers, None) from e


def service_url(name: str, namespace: str) -> str:
    svc = kubectl_json("get", "svc", name, "-n", namespace)
    port = svc["spec"]["ports"][0]["port"]
    return f"http://{svc['spec']['clusterIP']}:{port}"


def flip_middle(image: Path) -> None:
    """XOR 4 KiB in the middle of image with 0xFF (doing it again undoes it)."""
    with image.open("r+b") as f:
        f.seek(image.stat().st_size // 2)
        chunk = f.read(4096)
        f.seek(-len(chunk), 1)
        f.write(bytes(b ^ 0xFF for b in chunk))


def data_dir(host_root: Path | str, checkpoint: dict[str, Any]) -> Path:
    """Where a Checkpoint's data lies on the node: ROOT/NAMESPACE/ISVC/NAME-UID8.

    status.path is the path inside the pod, below the InferenceService's own
    subPath (status.subPath) of the volume.
    """
    st = checkpoint["status"]
    return Path(host_root) / st["subPath"] / st["path"].rsplit("/", 1)[1]


def pods_of(name: str, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kubectl_json(
        "get", "pods", "-n", namespace, "-l", f"rekindle.dev/inferenceservice={name}"
    )["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def accepts(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False
