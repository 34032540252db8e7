"""The node agent on the real local cluster: the chart's DaemonSet (privileged, in a
namespace that admits it) dumps and restores a process tree of an unprivileged,
non-root pod in a namespace that enforces Pod Security `baseline`.

The serving pod here is a small Python program (the runtime image's Python), not
vLLM: PID 1 starts a worker holding a random token in memory only, asks the node
agent through the socket in its own emptyDir to dump the worker, then to restore
it, and checks that the worker came back with its memory, its uid, no
capabilities, and in the pod's own cgroup. It also asks about another pod's UID
and must be refused.
"""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.cluster_tools import (
    REPO,
    create_namespace,
    helm,
    kubectl,
    kubectl_json,
    wait_until,
)
from tests.cluster.operator_fixtures import RUNTIME_IMAGE, require_runtime_image

pytestmark = pytest.mark.cluster

# scripts/local-cluster's containerd state and kubelet root (not the kubeadm defaults).
CONTAINERD_TASKS = "/run/rekindle-cluster/containerd/state/io.containerd.runtime.v2.task/k8s.io"
KUBELET_ROOT = "/var/lib/rekindle-cluster/kubelet/root"
PYTHON = "/opt/rekindle/venv/bin/python"

# The pod's PID 1. Prints one line "RESULT <json>" and waits.
PROGRAM = r"""
import json, os, signal, subprocess, sys, time
from rekindle_node import requests

SOCK = "/run/rekindle-node/node.sock"
UID = os.environ["POD_UID"]
WORKER = '''
import os, signal
token = os.urandom(8).hex()
n = 0
def answer(*_):
    global n
    n += 1
    os.write(1, f"{n} {token}\\n".encode())
signal.signal(signal.SIGUSR1, answer)
os.write(1, f"0 {token}\\n".encode())
while True:
    signal.pause()
'''
out = {}

def lines():
    with open("/tmp/worker.log") as f:
        return f.read().splitlines()

def wait(what, cond, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)

def status(pid):
    with open(f"/proc/{pid}/status") as f:
        return dict(l.split(":", 1) for l in f.read().splitlines())

try:
    log = open("/tmp/worker.log", "w")
    w = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=log, start_new_session=True, cwd="/")
    log.close()
    wait("the worker", lambda: len(lines()) == 1)
    token = lines()[0].split()[1]
    wait("the node agent's socket", lambda: os.path.exists(SOCK), 120)
    out["other_pod"] = requests.call(SOCK, "dump", "0000-not-this-pod", {"pid": w.pid})
    out["dump"] = requests.call(SOCK, "dump", UID, {"pid": w.pid})
    w.wait(timeout=60)  # the dump ended the worker
    out["commit"] = requests.call(SOCK, "commit", UID, {"name": "first", "manifest": {}})
    out["restore"] = requests.call(SOCK, "restore", UID, {"name": "first"})
    pid = out["restore"].get("pid")
    out["pid_same"] = pid == w.pid
    os.kill(pid, signal.SIGUSR1)
    wait("the restored worker's answer", lambda: len(lines()) == 2)
    out["answer"] = lines()[1]
    out["token"] = token
    st = status(pid)
    out["uid"] = st["Uid"].split()
    out["cap_eff"] = st["CapEff"].strip()
    out["ppid"] = int(st["PPid"])
    with open(f"/proc/{pid}/cgroup") as a, open("/proc/1/cgroup") as b:
        out["cgroup"], out["pod_cgroup"] = a.read(), b.read()
    out["status"] = requests.call(SOCK, "status", UID)
    out["devices"] = requests.call(SOCK, "devices", UID)
except BaseException as e:
    out["error"] = repr(e)
print("RESULT " + json.dumps(out), flush=True)
signal.pause()
"""


def _namespace(pss: str) -> str:
    name = create_namespace("na")
    kubectl("label", "namespace", name, f"pod-security.kubernetes.io/enforce={pss}")
    return name


@pytest.fixture(scope="module")
def node_agent(cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The chart's node-agent DaemonSet, alone (no operator), in a privileged namespace."""
    require_runtime_image()
    ns = _namespace("privileged")
    state = f"/var/lib/rekindle-cluster/node-agent-{uuid.uuid4().hex[:8]}"
    rendered = helm(
        "template",
        "rk",
        str(REPO / "charts" / "rekindle"),
        "-n",
        ns,
        "-s",
        "templates/node-agent.yaml",
        "--set",
        "nodeAgent.enabled=true",
        "--set",
        f"nodeAgent.image.repository={RUNTIME_IMAGE.split(':')[0]}",
        "--set",
        f"nodeAgent.image.tag={RUNTIME_IMAGE.split(':')[1]}",
        "--set",
        "nodeAgent.image.pullPolicy=Never",
        "--set",
        f"nodeAgent.stateDir={state}",
        "--set",
        f"nodeAgent.containerdTasks={CONTAINERD_TASKS}",
        "--set",
        f"nodeAgent.kubeletRoot={KUBELET_ROOT}",
    ).stdout
    kubectl("apply", "-n", ns, "-f", "-", input=rendered)
    try:
        kubectl("rollout", "status", "-n", ns, "daemonset/rk-rekindle-node", "--timeout=120s")
        yield ns
    finally:
        print(
            kubectl("logs", "-n", ns, "daemonset/rk-rekindle-node", "--tail=40", check=False).stdout
        )
        kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)
        # The node's state (root-only cache and key) was a hostPath: remove it.
        import shutil

        shutil.rmtree(state, ignore_errors=True)


def _serving_pod(name: str) -> str:
    return textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata: {{name: {name}}}
        spec:
          terminationGracePeriodSeconds: 0
          enableServiceLinks: false
          automountServiceAccountToken: false
          securityContext:
            runAsUser: 65534
            runAsGroup: 65534
            runAsNonRoot: true
            seccompProfile: {{type: RuntimeDefault}}
          containers:
          - name: main
            image: {RUNTIME_IMAGE}
            imagePullPolicy: Never
            command: [{PYTHON}, -c, {json.dumps(PROGRAM)}]
            env:
            - name: POD_UID
              valueFrom: {{fieldRef: {{fieldPath: metadata.uid}}}}
            securityContext:
              allowPrivilegeEscalation: false
              capabilities: {{drop: [ALL]}}
            volumeMounts:
            - {{name: rekindle-node, mountPath: /run/rekindle-node}}
          volumes:
          - {{name: rekindle-node, emptyDir: {{}}}}
        """)


def _result(ns: str, pod: str) -> dict:
    found: dict = {}

    def done() -> bool:
        logs = kubectl("logs", "-n", ns, pod, check=False).stdout
        for line in logs.splitlines():
            if line.startswith("RESULT "):
                found.update(json.loads(line[len("RESULT ") :]))
                return True
        return False

    wait_until(f"pod {pod}'s result", done, 240, namespace=ns)
    return found


def test_an_unprivileged_pod_is_dumped_and_restored_by_the_node_agent(node_agent: str) -> None:
    ns = _namespace("baseline")
    try:
        kubectl("apply", "-n", ns, "-f", "-", input=_serving_pod("serving"))
        got = _result(ns, "serving")
        assert "error" not in got, got
        assert got["commit"]["ok"] is True, got["commit"]
        other = got["other_pod"]
        assert (other["ok"], other["error"]) == (False, "refused"), other
        assert "a pod may only ask the node agent about itself" in other["message"]
        assert got["dump"]["ok"] is True, got["dump"]
        assert got["commit"]["ok"] is True, got["commit"]
        assert got["restore"]["ok"] is True, got["restore"]
        assert got["pid_same"] is True
        assert got["answer"] == f"1 {got['token']}"  # its memory came back
        assert got["uid"] == ["65534"] * 4
        assert got["cap_eff"] == "0000000000000000"
        assert got["ppid"] == 1  # re-parented to the pod's PID 1
        assert got["cgroup"] == got["pod_cgroup"]  # charged to the pod, not to the node agent
        entries = got["status"]["entries"]
        assert [e["entry"] for e in entries] == [got["commit"]["checkpoint"]]
        assert got["restore"]["checkpoint"] == got["commit"]["checkpoint"]
        pod = kubectl_json("get", "-n", ns, "pod/serving")
        assert entries[0]["pinned_by"] == [pod["metadata"]["uid"]]
        assert pod["spec"]["securityContext"]["runAsUser"] == 65534
        # The kubelet's record of the pod's devices (a CPU node: none), through the node agent.
        assert got["devices"] == {"ok": True, "container": "main", "gpus": [], "devices": []}
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_privileged_pod_is_refused_in_a_baseline_namespace(node_agent: str) -> None:
    """The namespace label is what keeps tenants unprivileged: the apiserver enforces it."""
    ns = _namespace("baseline")
    try:
        pod = _serving_pod("root").replace("allowPrivilegeEscalation: false", "privileged: true")
        r = kubectl("apply", "-n", ns, "-f", "-", input=pod, check=False)
        assert r.returncode != 0
        assert 'violates PodSecurity "baseline:latest"' in r.stderr, r.stderr
        assert "privileged" in r.stderr
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_state_dir_is_root_only(node_agent: str) -> None:
    """The verified cache and the node key: root-only on the node."""
    ds = kubectl_json("get", "-n", node_agent, "daemonset/rk-rekindle-node")
    state = next(
        v["hostPath"]["path"]
        for v in ds["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "state"
    )
    wait_until("the node agent's state", lambda: (Path(state) / "cache").is_dir(), 60)
    assert Path(state).stat().st_mode & 0o777 == 0o700
    assert (Path(state) / "node-signing-key").stat().st_mode & 0o777 == 0o400
