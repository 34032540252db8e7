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
import os
import shutil
import signal
import stat
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rekindle_operator import placement
from rekindle_store.s3 import Bucket

from tests.cluster import object_store
from tests.cluster.cluster_tools import (
    NODE1,
    NODE2,
    NODE2_TOLERATION,
    NODE_LOCAL,
    REPO,
    create_namespace,
    helm,
    kubectl,
    kubectl_json,
    node_local_path,
    require_second_node,
    wait_until,
)
from tests.cluster.object_store import ObjectStore
from tests.cluster.operator_fixtures import (
    RUNTIME_IMAGE,
    OperatorProcess,
    accepts,
    apply,
    data_dir,
    flip_middle,
    get,
    host_path_claim,
    http_json,
    install_crds,
    isvc_manifest,
    pods_of,
    release,
    require_runtime_image,
    service_url,
    wait_status,
    wind_down,
)

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
def s3(cluster: dict[str, str]) -> Iterator[ObjectStore]:
    """The cluster's S3-compatible object store (SeaweedFS), for the node agents."""
    yield from object_store.deploy()


@pytest.fixture(scope="module")
def node_agent(
    cluster: dict[str, str], s3: ObjectStore, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The chart's node-agent DaemonSet, alone (no operator), in a privileged namespace,
    with the object store's credentials in a Secret there."""
    require_runtime_image()
    ns = _namespace("privileged")
    kubectl("apply", "-f", "-", input=json.dumps(s3.secret_manifest("s3-credentials", ns)))
    # Node-private on each node (the second node binds its own directory over NODE_LOCAL).
    state = f"{NODE_LOCAL}/node-agent-{uuid.uuid4().hex[:8]}"
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
        "--set",
        f"nodeAgent.objectStore.endpoint={s3.endpoint}",
        "--set",
        f"nodeAgent.objectStore.bucket={object_store.BUCKET}",
        "--set",
        "nodeAgent.objectStore.credentialsSecret=s3-credentials",
        "--set-json",
        f"nodeAgent.tolerations=[{json.dumps(NODE2_TOLERATION)}]",
        "--set",
        f"nodeAgent.residentBudgetGiB={RESIDENT_GIB}",
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
        # Each node's state (its root-only cache) was a hostPath: remove it.
        for node in (NODE1, NODE2):
            shutil.rmtree(node_local_path(state, node), ignore_errors=True)


RESIDENT_GIB = 1  # the node agents' resident budget (a checkpoint here is about 2 GiB)


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
    """The verified cache: root-only on the node. The key it signs with is the fleet's
    (a Secret only the node agents mount, read-only, 0400), not one of its own."""
    state = _state_dir(node_agent)
    wait_until("the node agent's state", lambda: (state / "cache").is_dir(), 60)
    assert state.stat().st_mode & 0o777 == 0o700
    assert not (state / "node-signing-key").exists()
    mode = kubectl(
        "exec",
        "-n",
        node_agent,
        "daemonset/rk-rekindle-node",
        "--",
        "stat",
        "-L",
        "-c",
        "%a %U",
        "/etc/rekindle-node/signing-key/key",
    ).stdout.split()
    assert mode == ["400", "root"]


# -- An InferenceService with spec.coldStart.storage.type node ------------------------

NAME = "tiny"
PROMPTS = ("Hello, my name is", "1, 2, 3, 4,")
# Run in the serving container: SIGBUS to vLLM's root (the API server, a child of PID 1).
SIGBUS_VLLM = r"""
import os, signal
for p in os.listdir("/proc"):
    if p.isdigit() and p != "1":
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
            ppid = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if ppid == "1" and b"vllm.entrypoints" in cmd:
            os.kill(int(p), signal.SIGBUS)
            print(p)
"""
# Run in the serving container: every process's uid, effective capabilities and command.
PROCESSES = r"""
import json, os
out = []
for p in os.listdir("/proc"):
    if not p.isdigit():
        continue
    try:
        status = dict(ln.split(":", 1) for ln in open(f"/proc/{p}/status").read().splitlines())
        cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        continue
    out.append({"uid": status["Uid"].split()[0], "cap": status["CapEff"].strip(), "cmd": cmd[:80]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tenant_operator(
    node_agent: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, OperatorProcess]]:
    """A namespace that enforces Pod Security baseline, and the operator watching it."""
    install_crds()
    ns = _namespace("baseline")
    op = OperatorProcess(ns, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    try:
        yield ns, op
    finally:
        wind_down(ns)
        op.kill(signal.SIGTERM)
        print(f"operator log tail:\n{op.tail()}")
        release(ns)
        kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def tenant(tenant_operator: tuple[str, OperatorProcess]) -> str:
    return tenant_operator[0]


def _ready(ns: str, origin: str, name: str = NAME) -> dict[str, Any]:
    """The service Ready with one replica, which came up by origin (restored, booted)."""

    def ok(o: dict[str, Any]) -> bool:
        st = o.get("status") or {}
        pods = st.get("pods") or []
        if not (st.get("phase") == "Ready" and len(pods) == 1 and pods[0].get("ready") is True):
            return False
        # A status written before the last scale-down may still name a pod now gone.
        return pods[0].get("name") in {p["metadata"]["name"] for p in pods_of(name, ns)}

    obj = wait_status("rkis", name, ns, "1 replica Ready", ok, 600)
    pod = obj["status"]["pods"][0]
    assert pod.get("origin") == origin, pod
    return obj


def _completions(url: str) -> list[str]:
    out = []
    for p in PROMPTS:
        r = http_json(
            f"{url}/v1/completions",
            {"model": NAME, "prompt": p, "max_tokens": 8, "temperature": 0.0},
        )
        out.append(r["choices"][0]["text"])
    return out


def _processes(ns: str, pod: str) -> list[dict[str, str]]:
    """Uid, CapEff and the command of every process in the pod's container."""
    r = kubectl("exec", "-n", ns, pod, "--", PYTHON, "-c", PROCESSES)
    return list(json.loads(r.stdout))


SHARED_CLAIM = "shared-checkpoints"


@pytest.fixture(scope="module")
def shared_storage(tenant: str) -> Iterator[Path]:
    """Shared checkpoint storage for the tenant: a hostPath PersistentVolume bound to a
    claim, its directory for the service writable by the pods' group (65534), as a
    platform team sets up an NFS export (a hostPath volume has no fsGroup support)."""
    root = Path(f"/var/lib/rekindle-cluster/shared-{tenant}")
    (root / tenant / NAME).mkdir(parents=True)
    for d in (root / tenant, root / tenant / NAME):
        os.chown(d, 65534, 65534)
        os.chmod(d, 0o770)
    pv = host_path_claim(tenant, SHARED_CLAIM, root, access_mode="ReadWriteMany", size="20Gi")
    try:
        yield root
    finally:
        # Checkpoints first: a cleanup Job of theirs mounts the claim.
        kubectl("delete", "rkcp", "--all", "-n", tenant, "--timeout=180s", check=False)
        wait_until("cleanup Jobs to finish", lambda: not _cleanup_running(tenant), 180)
        kubectl("delete", "pv", pv, "--wait=false", check=False)
        shutil.rmtree(root, ignore_errors=True)


def _cleanup_running(ns: str) -> bool:
    pods = kubectl_json("get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=cleanup")
    return any(p["status"].get("phase") in ("Pending", "Running") for p in pods["items"])


def _restart(ns: str, origin: str, name: str = NAME) -> dict[str, Any]:
    """Scale to zero and back to one; the new replica Ready with origin."""
    kubectl("scale", f"rkis/{name}", "-n", ns, "--replicas=0")
    wait_until("no pods left", lambda: not pods_of(name, ns), 180)
    kubectl("scale", f"rkis/{name}", "-n", ns, "--replicas=1")
    return _ready(ns, origin, name)


def _evict(node_agent: str, node: str = NODE1) -> None:
    """What the node cache's budget does to an entry no replica pins (or a reboot)."""
    for entry in _entries(node_agent, node):
        shutil.rmtree(entry)


def _entries(node_agent: str, node: str = NODE1, name: str | None = None) -> list[Path]:
    """The checkpoints in that node's verified cache (name: only that checkpoint's)."""
    entries = list((_state_dir(node_agent, node) / "cache" / "entries").iterdir())
    if name is None:
        return entries
    return [
        e
        for e in entries
        if json.loads((e / "manifest.json").read_bytes())["identity"]["name"] == name
    ]


@pytest.fixture
def first_node_only() -> Iterator[None]:
    """New pods go to the first node (the second cordoned) unless a test swaps them;
    both nodes schedulable again afterwards."""
    require_second_node()
    kubectl("cordon", NODE2)
    try:
        yield
    finally:
        kubectl("uncordon", NODE1, NODE2)


def test_a_node_mode_service_boots_checkpoints_and_restores_unprivileged(
    tenant: str, node_agent: str, shared_storage: Path, first_node_only: None
) -> None:
    """Serving unprivileged, checkpointed by the node agent, published to a
    ReadWriteMany claim (here a hostPath volume both nodes share: they share this
    machine's disk, as NFS shares one in a real cluster) and pulled from it onto the
    second node, every byte checked."""
    ns = tenant
    require_runtime_image()
    doc = isvc_manifest(NAME, "/unused", example="tiny-cpu.yaml")
    doc["spec"]["coldStart"]["storage"] = {
        "type": "node",
        "node": {"publish": "pvc"},
        "pvc": {"existingClaim": SHARED_CLAIM},
    }
    doc["spec"]["podTemplate"] = {"spec": {"tolerations": [NODE2_TOLERATION]}}
    r = apply(doc, ns)
    assert r.returncode == 0, r.stderr
    _ready(ns, "booted")
    url = service_url(NAME, ns)
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    before = _completions(url)

    (pod,) = pods_of(NAME, ns)
    security = pod["spec"]["containers"][0]["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]} and "privileged" not in security
    assert not any("hostPath" in v for v in pod["spec"]["volumes"])
    procs = _processes(ns, pod["metadata"]["name"])
    assert any("vllm" in p["cmd"] for p in procs), procs
    assert {(p["uid"], p["cap"]) for p in procs} == {("65534", "0000000000000000")}, procs

    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "first"},
        "spec": {"inferenceService": NAME},
    }
    assert apply(ck, ns).returncode == 0
    done = wait_status(
        "rkcp",
        "first",
        ns,
        "Ready or Failed",
        lambda o: (o.get("status") or {}).get("phase") in ("Ready", "Failed"),
        600,
    )
    assert done["status"]["phase"] == "Ready", done["status"]
    assert done["status"]["verified"] is True
    assert done["status"]["publication"].startswith("published to "), done["status"]
    # Published once proven: the pod's read-only files on the shared claim, the manifest
    # the node signed.
    copy = data_dir(shared_storage, done)
    manifest = json.loads((copy / "manifest.json").read_bytes())
    assert manifest["identity"]["namespace"] == ns and "signature" in manifest
    assert manifest.get("verified"), "published before it was proven"
    pages = max(copy.rglob("pages-*.img"), key=lambda p: p.stat().st_size)
    assert (pages.stat().st_uid, stat.S_IMODE(pages.stat().st_mode)) == (65534, 0o444)
    # The node's resident budget: its agent keeps the new checkpoint's files locked in
    # memory (a vmtouch -l child; hostPID, so its /proc is this machine's), the small
    # files first, within the budget.
    (entry,) = _entries(node_agent, NODE1, done["status"]["path"])
    wait_until("the checkpoint locked in memory", lambda: _locked(entry)[0] > 0, 60)
    locked, files = _locked(entry)
    assert locked <= RESIDENT_GIB << 30, locked
    assert files and all(f.startswith(str(entry)) for f in files), files

    obj = _restart(ns, "restored")
    assert obj["status"]["pods"][0]["memory"] == "mmap", obj["status"]["pods"]
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    assert _completions(url) == before
    (pod,) = pods_of(NAME, ns)
    procs = _processes(ns, pod["metadata"]["name"])
    assert any("vllm" in p["cmd"] for p in procs), procs
    assert {(p["uid"], p["cap"]) for p in procs} == {("65534", "0000000000000000")}, procs

    # The hazard of mapped memory: the tree dies of SIGBUS. The container comes back by
    # itself (liveness), restored by copying from then on, with an Event saying why.
    kubectl("exec", "-n", ns, pod["metadata"]["name"], "--", PYTHON, "-c", SIGBUS_VLLM)

    def copied() -> bool:
        st = (get("rkis", NAME, ns) or {}).get("status") or {}
        pods = st.get("pods") or []
        return bool(pods) and pods[0].get("ready") is True and pods[0].get("memory") == "copy"

    wait_until("the replica back, restored by copying", copied, 300)
    st = (get("rkis", NAME, ns) or {})["status"]["pods"][0]
    assert st["origin"] == "restored", st
    assert "died after a mapped restore: vLLM exited (killed by SIGBUS" in st["memoryReason"], st
    events = kubectl("get", "events", "-n", ns, "--field-selector", "reason=MappedRestoreOff")
    assert "died after a mapped restore" in events.stdout, events.stdout
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    assert _completions(url) == before

    # Whoever mounts the shared claim changes the published copy after the node agent
    # verified it: a file rewritten, and images/ swapped for a link to a copy of itself.
    flip_middle(pages)
    images = copy / "images"
    images.rename(copy / "images.real")
    images.symlink_to("images.real")
    # The node's verified copy is what runs: the same answers.
    _restart(ns, "restored")
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    assert _completions(url) == before
    # Not in the cache any more: the pull checks every byte and refuses; a normal boot.
    # Evicted, its pages are locked no more (the lock follows the cache).
    _evict(node_agent)
    wait_until("the evicted checkpoint unlocked", lambda: _locked(entry) == (0, []), 30)
    obj = _restart(ns, "booted")
    reason = obj["status"]["pods"][0]["reason"]
    assert reason.startswith("checksum_mismatch: "), reason
    assert "links are not followed" in reason or "digest does not match" in reason, reason
    assert not list((_state_dir(node_agent) / "cache" / "entries").iterdir())
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    assert _completions(url) == before
    # Put back as published: the next replica on the second node (which never held it)
    # pulls it from the shared claim into its cache, verified, and restores from there.
    images.unlink()
    (copy / "images.real").rename(images)
    flip_middle(pages)
    kubectl("uncordon", NODE2)
    kubectl("cordon", NODE1)
    obj = _restart(ns, "restored")
    assert (obj["status"]["pods"][0]["node"], obj["status"]["pods"][0]["coldStartPath"]) == (
        NODE2,
        "restoreAfterPull",
    ), obj["status"]["pods"]
    (entry,) = _entries(node_agent, NODE2, done["status"]["path"])
    record = json.loads((entry / ".entry.json").read_bytes())
    assert record["source"] == f"pod:{done['status']['path']}", record
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    assert _completions(url) == before
    kubectl("uncordon", NODE1)
    kubectl("cordon", NODE2)

    # Neither in the cache nor published: a new pod boots normally and says why.
    _evict(node_agent)
    copy.rename(copy.with_name(copy.name + ".away"))
    obj = _restart(ns, "booted")
    reason = obj["status"]["pods"][0]["reason"]
    assert reason.startswith("no_checkpoint: "), reason
    assert "is not in this node's cache" in reason, reason
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    assert _completions(url) == before
    # Deleting the Checkpoint removes its published copy (a Job with no capability, which
    # the baseline namespace admits).
    copy.with_name(copy.name + ".away").rename(copy)
    kubectl("delete", "rkcp", "first", "-n", ns, "--timeout=120s")
    wait_until("the cleanup Job to remove the published copy", lambda: not copy.exists(), 180)
    kubectl("delete", "rkis", NAME, "-n", ns, "--timeout=120s")
    wait_until("its pods gone (their CPU is the next test's)", lambda: not pods_of(NAME, ns), 180)


def test_a_checkpoint_made_on_one_node_restores_on_another_through_the_object_store(
    tenant_operator: tuple[str, OperatorProcess], node_agent: str, s3: ObjectStore
) -> None:
    """The fleet case: a checkpoint made on the first node, a replica on the second
    (a node that never saw it) pulls it from the object store, every byte checked
    against the fleet's signature, and restores with the same answers. The operator
    is killed while the checkpoint is being published: the agents finish it, the new
    operator process records it. A changed or cut object is refused at the store level
    (tests/store); here, the whole store gone: the replica boots and says why."""
    require_second_node()
    (ns, operator), name = tenant_operator, "tiny-s3"
    doc = isvc_manifest(name, "/unused", example="tiny-cpu.yaml")
    doc["spec"]["coldStart"]["storage"] = {"type": "node", "node": {"publish": "objectStore"}}
    # May run on either node (the second is tainted); pinned by cordoning below.
    doc["spec"]["podTemplate"] = {"spec": {"tolerations": [NODE2_TOLERATION]}}
    kubectl("cordon", NODE2)
    try:
        assert apply(doc, ns).returncode == 0
        _ready(ns, "booted", name)
    finally:
        kubectl("uncordon", NODE2)
    url = service_url(name, ns)
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    before = _completions(url)
    (pod,) = pods_of(name, ns)
    assert pod["spec"]["nodeName"] == NODE1
    assert not any("s3" in v.get("name", "") or "secret" in v for v in pod["spec"]["volumes"]), (
        "a serving pod must never mount the store's credentials"
    )

    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "to-s3"},
        "spec": {"inferenceService": name},
    }
    assert apply(ck, ns).returncode == 0
    bucket = s3.bucket()
    _kill_and_restart_during_publish(operator, bucket, ns, "to-s3")
    done = wait_status(
        "rkcp",
        "to-s3",
        ns,
        "Ready or Failed",
        lambda o: (o.get("status") or {}).get("phase") in ("Ready", "Failed"),
        600,
    )
    assert done["status"]["phase"] == "Ready", done["status"]
    assert done["status"]["message"].endswith(
        "(recorded after an operator restart, from the agent's status)"
    ), done["status"]
    assert done["status"]["node"] == NODE1
    assert done["status"]["publication"].startswith("published to "), done["status"]
    prefix = _store_prefix(ns, done)
    keys = {o.key: o.size for o in bucket.list_objects(prefix)}
    manifest = json.loads(bucket.get(prefix + "manifest.json"))
    assert manifest["identity"]["namespace"] == ns and "signature" in manifest
    assert manifest["identity"]["node"] == NODE1
    assert manifest.get("verified"), "published before it was proven"
    # Stored as frames: each part of a file that is not all zeroes, its length as the
    # layout says; a vLLM tree's pages compress and its /dev/shm files are mostly holes.
    layout = json.loads(bucket.get(prefix + "layout.json"))["frames"]
    assert set(layout) == {f["path"] for f in manifest["files"]}
    frames = {
        f"{prefix}frames/{rel}/{n:06d}": length
        for rel, lengths in layout.items()
        for n, length in enumerate(lengths)
        if length
    }
    assert set(keys) == {prefix + "manifest.json", prefix + "layout.json"} | set(frames)
    assert all(keys[k] == length for k, length in frames.items())
    assert sum(frames.values()) < sum(f["size"] for f in manifest["files"]) / 2
    path = done["status"]["path"]
    assert _entries(node_agent, NODE2, path) == []

    # The next replica on the second node: pulled, checked, restored, the same answers.
    kubectl("cordon", NODE1)
    try:
        obj = _restart(ns, "restored", name)
        pod_status = obj["status"]["pods"][0]
        assert (pod_status["node"], pod_status["coldStartPath"]) == (NODE2, "restoreAfterPull")
        assert obj["status"]["nodes"] == [
            {
                "name": NODE2,
                "replicas": 1,
                "ready": 1,
                "checkpointCached": True,
                **(
                    {"residentPercent": pod_status["pageCache"]["residentPercent"]}
                    if "pageCache" in pod_status
                    else {}
                ),
                "coldStartSeconds": {"restoreAfterPull": pod_status["coldStartSeconds"]},
            }
        ]
        (entry,) = _entries(node_agent, NODE2, path)
        record = json.loads((entry / ".entry.json").read_bytes())
        assert record["source"] == f"{s3.endpoint}/{object_store.BUCKET}/{prefix}", record
        wait_until("the Service to accept connections", lambda: accepts(url), 60)
        assert _completions(url) == before
        # Placement: the pod was created gated and released toward the warm nodes of that
        # moment (only where it was made); now the second node holds it too.
        (pod,) = pods_of(name, ns)
        assert not pod["spec"].get("schedulingGates"), pod["spec"].get("schedulingGates")
        assert _preferred(pod) == [NODE1]
        wait_until(
            "the second node recorded as holding the checkpoint",
            lambda: (
                ((get("rkcp", "to-s3", ns) or {}).get("status") or {}).get("cachedNodes") == [NODE2]
            ),
            60,
        )

        # The store unreachable, the second node's cache emptied: a normal boot that says so.
        s3.scale(0)
        try:
            _evict(node_agent, NODE2)
            obj = _restart(ns, "booted", name)
            reason = obj["status"]["pods"][0]["reason"]
            assert reason.startswith("store_unreachable: "), reason
            assert obj["status"]["pods"][0]["node"] == NODE2
            (pod,) = pods_of(name, ns)
            assert _preferred(pod) == [NODE1, NODE2]  # both warm when it was created
        finally:
            s3.scale(1)
        # Pre-warming: the operator asked that booted replica (its node does not hold the
        # checkpoint in use) to have its node agent pull it; the pull waited for the store
        # to come back. The next replica there restores from the node's cache, no pull.
        wait_until(
            "the second node pre-warmed", lambda: bool(_entries(node_agent, NODE2, path)), 180
        )
        obj = _restart(ns, "restored", name)
        pod_status = obj["status"]["pods"][0]
        assert (pod_status["node"], pod_status["coldStartPath"]) == (NODE2, "restore")
    finally:
        kubectl("uncordon", NODE1)

    # Deleted: a Job asks its node's agent (the first node's: the Job does not tolerate
    # the second) to remove it from the store, the Job holding no store credential, like
    # the serving pods; that node's cached copy goes too, as no replica there maps it.
    kubectl("delete", "rkcp", "to-s3", "-n", ns, "--timeout=120s")
    wait_until("the store's copy deleted", lambda: not list(bucket.list_objects(prefix)), 180)
    wait_until("the first node's copy dropped", lambda: not _entries(node_agent, NODE1, path), 60)
    kubectl("delete", "rkis", name, "-n", ns, "--timeout=120s")
    wait_until("its pods gone", lambda: not pods_of(name, ns), 180)


def _store_prefix(ns: str, ck: dict[str, Any]) -> str:
    """Where the node agents publish that Checkpoint in the object store."""
    return f"rekindle/{ns}/{ck['status']['path'].rstrip('/').rsplit('/', 1)[-1]}/"


def _kill_and_restart_during_publish(
    operator: OperatorProcess, bucket: Bucket, ns: str, name: str, timeout: float = 600
) -> None:
    """SIGKILL the operator once the checkpoint's first objects are in the store and its
    manifest is not (the node agent is publishing), then start it again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ck = get("rkcp", name, ns) or {}
        phase = (ck.get("status") or {}).get("phase")
        if phase in ("Ready", "Failed"):
            raise AssertionError(f"{name} finished before its publish was seen: {ck['status']}")
        if (ck.get("status") or {}).get("path"):
            keys = {o.key for o in bucket.list_objects(_store_prefix(ns, ck))}
            if keys and _store_prefix(ns, ck) + "manifest.json" not in keys:
                operator.kill(signal.SIGKILL)
                assert not operator.alive()
                operator.start()
                return
        time.sleep(0.1)
    raise AssertionError(f"{name}: no publish seen in {timeout:.0f}s")


def _preferred(pod: dict[str, Any]) -> list[str]:
    """The nodes a pod was released toward (the operator's warm-placement terms; a node
    whose copy is resident too has a second term of the same weight: named once)."""
    terms = ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
        "preferredDuringSchedulingIgnoredDuringExecution"
    ) or []
    return sorted(
        {
            v
            for t in terms
            if t["weight"] == placement.WARM_WEIGHT
            for f in t["preference"]["matchFields"]
            for v in f["values"]
        }
    )


def _locked(entry: Path) -> tuple[int, list[str]]:
    """(bytes, files) that node agents' vmtouch -l children lock under entry: their
    VmLck, their arguments (node agents run with hostPID, so this machine sees them)."""
    total, files = 0, []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
            status = (proc / "status").read_text()
        except OSError:
            continue
        mine = [a for a in argv[1:] if a.startswith(f"{entry}/")]
        if argv and argv[0].endswith("vmtouch") and mine:
            files += mine
            total += next(
                int(line.split()[1]) << 10
                for line in status.splitlines()
                if line.startswith("VmLck:")
            )
    return total, files


def _state_dir(agent_ns: str, node: str = NODE1) -> Path:
    """Where that node's agent keeps its state, on this machine."""
    ds = kubectl_json("get", "-n", agent_ns, "daemonset/rk-rekindle-node")
    volumes = ds["spec"]["template"]["spec"]["volumes"]
    path = next(v["hostPath"]["path"] for v in volumes if v["name"] == "state")
    return Path(node_local_path(path, node))
