"""The operator end to end on the real local cluster, with the real CPU runtime image.

One InferenceService is shared by the module (a SmolLM2 boot costs about a
minute on 2 cores), serving the trained SmolLM2 (examples/smollm2-cpu.yaml),
so "the same output" after a restore is also a right one ("Paris"). Its
agent's admin API is served over TLS (spec.adminTLS: a CA and a server
certificate for the default name NAME.NAMESPACE.svc, made with openssl, in a
kubernetes.io/tls Secret with ca.crt, as cert-manager writes it): the pod's
probes go over HTTPS (or it never becomes Ready), the operator reads the
agent's status over HTTPS verifying the certificate against the Secret's CA
(or status.pods[] stays "unknown"), and every checkpoint, restore and
recovery below goes over that channel. Its two checkpoints are module
fixtures, taken on first use, so that every test also runs alone
(`pytest path::test`):
- `first`: `kubectl rekindle checkpoint --wait` of the booted replica;
- `second`: a Checkpoint object during which the operator is killed (once the
  agent is at work, so that there is one right outcome) and started again.

serve -> `first` Ready, scale 0->1 restores with identical greedy output ->
a corrupted checkpoint boots normally and says it was the checksum (the file
is repaired afterwards) -> the operator killed mid-checkpoint recovers: the
checkpoint is recorded Ready from the agent's status, the same pod is back in
the Service, nothing is left over -> a Checkpoint deleted while a restored
replica maps it (its own, `third`) waits for that replica (which keeps
serving the same answers) -> deleting cleans up. Refusals that need the
operator (a Checkpoint naming a missing InferenceService, /dev/shm below the
full computed need, a TLS Secret that does not exist) run beside it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from rekindle_agent.mapped_files import immutable
from rekindle_contract.manifest import RUN_CACHE_SUBDIR
from rekindle_contract.pod import RUN_DIR
from rekindle_operator import placement
from rekindle_operator.pods import BUSY_STATES
from rekindle_operator.quantity import to_bytes
from rekindle_operator.shm_sizing import shm_need
from rekindle_operator.spec import parse_spec

from tests.cluster.cluster_tools import ENV, kubectl, kubectl_json, require_tool, wait_until
from tests.cluster.operator_fixtures import (
    OperatorProcess,
    accepts,
    apply,
    data_dir,
    flip_middle,
    get,
    host_dir,
    http_json,
    isvc_manifest,
    kubectl_rekindle,
    op_namespace,
    operator,
    pods_of,
    require_runtime_image,
    run_plugin,
    service_url,
    wait_status,
)
from tests.unit.tls_certs import make_ca, make_server_cert

__all__ = ["host_dir", "kubectl_rekindle", "op_namespace", "operator"]  # fixtures used by name

pytestmark = pytest.mark.cluster
NAME = "smollm2"
PROMPTS = ("Hello, my name is", "The capital of France is", "1, 2, 3, 4,")


def isvc(ns: str) -> dict[str, Any]:
    obj = get("rkis", NAME, ns)
    assert obj is not None
    return obj


def ready_with(ns: str, origin: str, timeout: float = 600) -> dict[str, Any]:
    """Wait until the one replica is Ready and the operator reports how it came up."""

    def ok(o: dict[str, Any]) -> bool:
        st = o.get("status") or {}
        pods = st.get("pods") or []
        return (
            st.get("phase") == "Ready"
            and len(pods) == 1
            and pods[0].get("ready") is True
            and pods[0].get("origin") == origin
        )

    return wait_status("rkis", NAME, ns, f"1 replica Ready, {origin}", ok, timeout)


def completions(url: str) -> list[str]:
    # A pod that just came (back) into the Service is reachable only once
    # kube-proxy has synced its endpoints; until then the ClusterIP refuses.
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    out = []
    for p in PROMPTS:
        r = http_json(
            f"{url}/v1/completions",
            {"model": NAME, "prompt": p, "max_tokens": 12, "temperature": 0.0},
        )
        out.append(r["choices"][0]["text"])
    return out


def scale(ns: str, n: int) -> None:
    kubectl("scale", f"rkis/{NAME}", "-n", ns, f"--replicas={n}")


def one_replica(ns: str) -> dict[str, Any]:
    """The service at one Ready replica, however it came up (a test before may have
    left it at zero): what a checkpoint needs."""
    scale(ns, 1)

    def ok(o: dict[str, Any]) -> bool:
        st = o.get("status") or {}
        pods = st.get("pods") or []
        return st.get("phase") == "Ready" and len(pods) == 1 and pods[0].get("ready") is True

    return wait_status("rkis", NAME, ns, "1 replica Ready", ok, 600)


class Stream(threading.Thread):
    """One streamed completion of exactly max_tokens tokens (ignore_eos), read as it comes."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()  # the first chunk arrived: the request is in flight
        self.t_first = self.t_end = 0.0
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.saw_done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": NAME, "prompt": PROMPTS[0], "max_tokens": self.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        req = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    if not self.first.is_set():
                        self.t_first = time.monotonic()
                        self.first.set()
                    if line == "data: [DONE]":
                        self.saw_done = True
                        continue
                    doc = json.loads(line[6:])
                    for c in doc.get("choices") or []:
                        self.finish_reason = c.get("finish_reason") or self.finish_reason
                    if doc.get("usage"):
                        self.completion_tokens = doc["usage"]["completion_tokens"]
        except BaseException as e:  # reported by the test, not lost in the thread
            self.error = e
        finally:
            self.t_end = time.monotonic()
            self.first.set()


def stream_through_scale_to_zero(url: str, ns: str) -> None:
    """A stream long enough to be in flight when the pod gets SIGTERM (sized from a
    short one: about 8 s of decoding) completes whole while the service scales to 0."""
    wait_until("the Service to accept connections", lambda: accepts(url), 60)
    probe = Stream(url, 32)
    probe.run()
    assert probe.error is None and probe.completion_tokens == 32, probe.error
    rate = 32 / max(probe.t_end - probe.t_first, 1e-3)
    n = int(min(4096, max(64, rate * 8)))
    stream = Stream(url, n)
    stream.start()
    assert stream.first.wait(60) and stream.error is None, stream.error
    (pod,) = pods_of(NAME, ns)
    name = pod["metadata"]["name"]
    scale(ns, 0)

    def the_pod() -> dict[str, Any] | None:  # pods_of leaves terminating pods out
        return get("pod", name, ns)

    wait_until(
        "the pod terminating",
        lambda: bool(((the_pod() or {}).get("metadata") or {}).get("deletionTimestamp")),
        60,
    )
    assert stream.is_alive(), (
        f"the {n}-token stream ended before the pod was deleted: the test proved nothing"
    )
    wait_until("the pod gone", lambda: the_pod() is None, 180)
    stream.join(60)
    assert stream.error is None, stream.error
    assert (stream.finish_reason, stream.completion_tokens, stream.saw_done) == ("length", n, True)


def scale_zero_then_one(ns: str) -> None:
    scale(ns, 0)
    wait_until("no pods left", lambda: not pods_of(NAME, ns), 180)
    scale(ns, 1)


def checkpoint_with_plugin(
    plugin: dict[str, str], ns: str, name: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """`kubectl rekindle checkpoint --wait` of one replica: the plugin's run and the
    Checkpoint it made."""
    one_replica(ns)
    r = run_plugin(
        plugin, "-n", ns, "checkpoint", NAME,
        "--checkpoint-name", name, "--wait", "--timeout", "300",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    ck = get("rkcp", name, ns)
    assert ck is not None
    return r, ck


@pytest.fixture(scope="module")
def tls_secret(op_namespace: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A CA and a server certificate for NAME.NAMESPACE.svc, as cert-manager stores them."""
    require_tool("openssl")  # makes the CA and the certificate: a machine without it fails
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    cert = make_server_cert(ca, d, f"{NAME}.{op_namespace}.svc")
    kubectl(
        "create", "secret", "generic", "admin-tls", "-n", op_namespace,
        "--type=kubernetes.io/tls", f"--from-file=tls.crt={cert.cert}",
        f"--from-file=tls.key={cert.key}", f"--from-file=ca.crt={ca.cert}",
    )  # fmt: skip
    return "admin-tls"


@pytest.fixture(scope="module")
def served(
    host_dir: Path, operator: OperatorProcess, op_namespace: str, tls_secret: str
) -> dict[str, Any]:
    """SmolLM2 booted and Ready; the operator saw its agent say so over TLS."""
    require_runtime_image()
    doc = isvc_manifest(
        NAME, str(host_dir), example="smollm2-cpu.yaml", adminTLS={"secretName": tls_secret}
    )
    r = apply(doc, op_namespace)
    assert r.returncode == 0, r.stderr
    obj = ready_with(op_namespace, "booted")
    return {"url": service_url(NAME, op_namespace), "isvc": obj}


@pytest.fixture(scope="module")
def before(served: dict[str, Any]) -> list[str]:
    """Greedy completions of the first, normally booted replica: the oracle."""
    out = completions(served["url"])
    assert "Paris" in out[PROMPTS.index("The capital of France is")], out
    return out


def test_pod_has_computed_dev_shm_and_vllm_shm_flags(
    served: dict[str, Any], op_namespace: str
) -> None:
    spec = parse_spec(NAME, op_namespace, served["isvc"]["spec"])
    need = shm_need(spec).total
    (pod,) = pods_of(NAME, op_namespace)
    name = pod["metadata"]["name"]
    df = kubectl("exec", "-n", op_namespace, name, "--", "df", "-k", "/dev/shm").stdout
    assert int(df.splitlines()[-1].split()[1]) * 1024 == need
    assert served["isvc"]["status"]["sharedMemory"]["totalBytes"] == need
    limit = pod["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert to_bytes(limit) == to_bytes(spec.memory) + need
    ps = kubectl("exec", "-n", op_namespace, name, "--", "ps", "-eo", "args").stdout
    lines = [line for line in ps.splitlines() if "vllm.entrypoints.openai.api_server" in line]
    assert lines, f"no vLLM API server process in the pod:\n{ps}"
    cmdline = lines[0]
    assert "--mm-processor-cache-type shm" in cmdline
    assert "--mm-processor-cache-gb 0.5" in cmdline
    assert "--mm-shm-cache-max-object-size-mb 64" in cmdline


def test_chat_completion_through_the_service(served: dict[str, Any]) -> None:
    r = http_json(
        f"{served['url']}/v1/chat/completions",
        {
            "model": NAME,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8,
            "temperature": 0.0,
        },
    )
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert r["usage"]["completion_tokens"] > 0
    # `kubectl logs` shows vLLM's own log lines (here: its line for that request),
    # tagged, beside the agent's.
    (pod,) = pods_of(NAME, served["isvc"]["metadata"]["namespace"])
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]

    def vllm_lines() -> list[str]:
        out = kubectl("logs", "-n", ns, name, "--tail=-1").stdout.splitlines()
        return [ln for ln in out if ln.startswith("[vllm] ")]

    wait_until(
        "vLLM's request line in kubectl logs",
        lambda: any("/v1/chat/completions" in ln for ln in vllm_lines()),
        90,
    )


def test_vllm_boots_from_the_images_compiled_files_and_model_info(
    served: dict[str, Any],
) -> None:
    """What the image does for every boot: Python reads the venv's byte-compiled files
    (an unprivileged pod cannot write its own), and vLLM finds its model-class info
    seeded from the image, so it starts no extra Python process to work it out. vLLM
    rewrites a seeded file whose module hash it does not accept: the pod's copy must
    still be the image's, byte for byte."""
    (pod,) = pods_of(NAME, served["isvc"]["metadata"]["namespace"])
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    seed = "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    logs = kubectl("logs", "-n", ns, name, "--tail=-1").stdout
    assert f"model info cache seeded from the image: {seed}" in logs, logs[-3000:]
    cache = f"{RUN_DIR}/{RUN_CACHE_SUBDIR}/vllm/modelinfos/{seed}"
    same = kubectl("exec", "-n", ns, name, "--", "cmp", f"/opt/rekindle/vllm-modelinfos/{seed}",
                   cache, check=False)  # fmt: skip
    assert same.returncode == 0, same.stdout + same.stderr
    probe = (
        "import importlib.util as u, os, sys\n"
        "for m in ('torch', 'transformers', 'vllm', 'vllm.config.model'):\n"
        "    c = u.find_spec(m).cached\n"
        "    assert os.path.exists(c), c\n"
        "    flags = int.from_bytes(open(c, 'rb').read()[4:8], 'little')\n"
        "    assert flags == 1, (c, flags)  # hash-based, not checked against the source\n"
    )
    r = kubectl("exec", "-n", ns, name, "--", "/opt/rekindle/venv/bin/python", "-c", probe,
                check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_admin_api_over_tls(
    served: dict[str, Any], first: dict[str, Any], op_namespace: str
) -> None:
    """Probes over HTTPS, the agent's status read over HTTPS (the replica's origin is
    known only from it), and a checkpoint taken over the same verified channel."""
    assert served["isvc"]["spec"]["adminTLS"]["secretName"] == "admin-tls"
    pod = served["isvc"]["status"]["pods"][0]
    assert pod["ready"] is True and pod["origin"] == "booted", pod
    (running,) = pods_of(NAME, op_namespace)
    c = running["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert "--admin-tls-cert" in c["command"]
    assert first["checkpoint"]["status"]["phase"] == "Ready", first["checkpoint"]["status"]


def test_missing_tls_secret_is_reported(operator: OperatorProcess, op_namespace: str) -> None:
    r = apply(
        isvc_manifest("no-secret", "/var/lib/rekindle/unused", adminTLS={"secretName": "nope"}),
        op_namespace,
    )
    assert r.returncode == 0, r.stderr
    obj = wait_status(
        "rkis", "no-secret", op_namespace, "the missing Secret named in status",
        lambda o: "nope" in str((o.get("status") or {}).get("message", "")), 120,
    )  # fmt: skip
    assert "does not exist" in obj["status"]["message"]
    deployments = kubectl_json("get", "deployments", "-n", op_namespace)["items"]
    assert not [d for d in deployments if d["metadata"]["name"] == "no-secret"]
    kubectl("delete", "rkis", "no-secret", "-n", op_namespace, "--wait=false")


@pytest.fixture(scope="module")
def first(
    served: dict[str, Any], before: list[str], op_namespace: str, kubectl_rekindle: dict[str, str]
) -> dict[str, Any]:
    """Checkpoint "first" of the booted replica (after the oracle was read), through the
    plugin: its output and the Checkpoint once Ready."""
    r, ck = checkpoint_with_plugin(kubectl_rekindle, op_namespace, "first")
    return {"output": r.stdout, "checkpoint": ck}


def agent_at_work(name: str, ns: str, timeout: float = 180) -> dict[str, Any]:
    """The Checkpoint as soon as the operator has recorded its agent at work.

    The agent is busy for a few seconds only (SmolLM2: about 9 s from Running to
    Ready), so this polls fast, with no other call in the loop; a Checkpoint that
    finishes first fails here, saying so, rather than giving a test of nothing."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = get("rkcp", name, ns) or {}
        st = last.get("status") or {}
        if st.get("phase") == "Running" and st.get("agentState") in BUSY_STATES:
            return last
        if st.get("phase") in ("Ready", "Failed"):
            raise AssertionError(f"{name} finished before its agent was seen at work: {st}")
        time.sleep(0.2)
    raise AssertionError(f"{name}: its agent not seen at work in {timeout:.0f}s: {last}")


@pytest.fixture(scope="module")
def second(
    served: dict[str, Any], before: list[str], op_namespace: str, operator: OperatorProcess
) -> dict[str, Any]:
    """Checkpoint "second", during which the operator is killed and started again.

    The kill comes once the agent reports it is at work (draining, dumping or restoring
    to verify): from then on the
    agent finishes on its own, so the one right outcome is Ready, recorded by the new
    operator process from the agent's status (docs/operator.md, "Operator restarted
    mid-checkpoint"). Killed before the agent has begun, the outcome would depend on an
    instant (the documented OperatorRestarted case)."""
    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "second"},
        "spec": {"inferenceService": NAME},
    }
    one_replica(op_namespace)
    assert apply(ck, op_namespace).returncode == 0
    running = agent_at_work("second", op_namespace)
    operator.kill(signal.SIGKILL)  # returns once the process group is gone
    assert not operator.alive()
    operator.start()
    done = wait_status(
        "rkcp",
        "second",
        op_namespace,
        "Ready or Failed",
        lambda o: (o.get("status") or {}).get("phase") in ("Ready", "Failed"),
        900,
    )
    return {"running": running, "done": done}


def test_checkpoint_ready_then_new_replica_restores_with_same_output(
    served: dict[str, Any],
    before: list[str],
    first: dict[str, Any],
    op_namespace: str,
    kubectl_rekindle: dict[str, str],
) -> None:
    assert "Ready:" in first["output"], first["output"]
    ck = first["checkpoint"]
    st = ck["status"]
    assert st["phase"] == "Ready" and st["sizeBytes"] > 0 and st["phaseSeconds"]
    assert st["verified"] is True
    assert st["fingerprint"] == isvc(op_namespace)["status"]["fingerprint"]
    host = served["isvc"]["spec"]["coldStart"]["storage"]["hostPath"]["path"]
    assert data_dir(host, ck).is_dir()
    assert st["subPath"] == f"{op_namespace}/{NAME}"
    wait_status(
        "rkis",
        NAME,
        op_namespace,
        "checkpoint in use",
        lambda o: (o.get("status") or {}).get("checkpoint") == "first",
        60,
    )
    # The checkpointed pod is back in the Service and still answers the same.
    assert completions(served["url"]) == before

    # Scaled to zero with a stream in flight: the pod's agent refuses new requests at
    # SIGTERM and lets that stream finish (--shutdown-drain), whole.
    stream_through_scale_to_zero(served["url"], op_namespace)
    scale(op_namespace, 1)
    obj = ready_with(op_namespace, "restored")
    cond = {c["type"]: c for c in obj["status"]["conditions"]}["Restored"]
    assert cond["status"] == "True", cond
    assert "restored" in obj["status"]["lastColdStartSeconds"]
    # The pod's own figure, from the agent's timestamps, recorded by the operator.
    assert obj["status"]["pods"][0]["agentReadySeconds"] > 0, obj["status"]["pods"]
    # vLLM's tree passed every check for the zero-copy restore; its images are immutable.
    assert obj["status"]["pods"][0]["memory"] == "mmap", obj["status"]["pods"]
    pages = sorted(data_dir(host, ck).glob("images/pages-*.img"))
    assert pages and all(immutable.is_immutable(p) for p in pages)
    assert completions(served["url"]) == before

    status = run_plugin(kubectl_rekindle, "-n", op_namespace, "status", NAME)
    assert status.returncode == 0, status.stdout
    assert " on rekindle-node: restore, ready=True" in status.stdout, status.stdout
    assert "memory mmap" in status.stdout, status.stdout
    assert "rekindle-node: 1/1 ready, checkpoint cached" in status.stdout, status.stdout


def test_plugin_talks_to_the_context_it_is_given(
    served: dict[str, Any], op_namespace: str, kubectl_rekindle: dict[str, str], tmp_path: Path
) -> None:
    """kubectl's rules: --context picks the cluster and user; without it the current
    context is used, and an unreachable one is one line and exit status 3."""
    real = yaml.safe_load(Path(kubectl_rekindle["KUBECONFIG"]).read_text())
    real_context = real["current-context"]
    real["clusters"].append({"name": "nowhere", "cluster": {"server": "https://127.0.0.1:1"}})
    real["contexts"].append(
        {
            "name": "nowhere",
            "context": {"cluster": "nowhere", "user": real["contexts"][0]["context"]["user"]},
        }
    )
    real["current-context"] = "nowhere"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(real))
    env = {**kubectl_rekindle, "KUBECONFIG": str(kubeconfig)}
    down = run_plugin(env, "-n", op_namespace, "status", NAME)
    assert down.returncode == 3, down
    assert (
        down.stderr.startswith("error: cannot reach the cluster") and down.stderr.count("\n") == 1
    )
    up = run_plugin(env, "--context", real_context, "-n", op_namespace, "status", NAME)
    assert up.returncode == 0 and NAME in up.stdout, up


def in_use(ns: str) -> dict[str, Any]:
    """The Checkpoint new replicas restore from (status.checkpoint of the service)."""
    obj = wait_status(
        "rkis",
        NAME,
        ns,
        "a checkpoint in use",
        lambda o: bool((o.get("status") or {}).get("checkpoint")),
        60,
    )
    ck = get("rkcp", obj["status"]["checkpoint"], ns)
    assert ck is not None and ck["status"]["phase"] == "Ready", ck
    return ck


def test_corrupted_checkpoint_boots_normally_and_says_why(
    served: dict[str, Any], before: list[str], first: dict[str, Any], op_namespace: str,
    host_dir: Path,
) -> None:  # fmt: skip
    ck = in_use(op_namespace)
    where = data_dir(host_dir, ck)
    images = sorted(where.rglob("pages-*.img"), key=lambda p: p.stat().st_size)
    assert images, f"no CRIU pages image under {where}"
    biggest = images[-1]
    # No replica maps the file while it is changed (as if the node's disk went bad).
    scale(op_namespace, 0)
    wait_until("no pods left", lambda: not pods_of(NAME, op_namespace), 180)
    with pytest.raises(PermissionError):  # immutable: root cannot write it as it is
        biggest.open("r+b")
    immutable.set_immutable(biggest, False)  # what a root attacker on the node would do
    flip_middle(biggest)
    try:
        scale(op_namespace, 1)
        obj = ready_with(op_namespace, "booted")
        pod = obj["status"]["pods"][0]
        # The agent checked the file against the manifest, named it and fell back.
        assert pod["reason"].startswith("checksum_mismatch: "), pod
        assert str(biggest.relative_to(where)) in pod["reason"], pod
        assert "differs from the manifest" in pod["reason"], pod
        cond = {c["type"]: c for c in obj["status"]["conditions"]}["Restored"]
        assert cond["status"] == "False" and pod["reason"][:40] in cond["message"], cond
        events = kubectl_json(
            "get", "events", "-n", op_namespace, "--field-selector", f"involvedObject.name={NAME}"
        )["items"]
        assert any(e["reason"] == "RestoredSomeBooted" for e in events)
        assert completions(served["url"]) == before
    finally:
        # The checkpoint as it was, for whatever restores from it next.
        flip_middle(biggest)
        immutable.set_immutable(biggest, True)


def test_a_tampered_restore_pointer_boots_normally_and_says_why(
    served: dict[str, Any], before: list[str], first: dict[str, Any], op_namespace: str,
    operator: OperatorProcess,
) -> None:  # fmt: skip
    """Someone with `update configmaps` points new replicas at another directory: the
    operator's signature no longer matches, so the pod boots (and reads nothing there)."""
    ck = in_use(op_namespace)
    scale(op_namespace, 0)
    wait_until("no pods left", lambda: not pods_of(NAME, op_namespace), 180)
    # The status says so too, or an old pod's report would pass for the new one's below.
    wait_status(
        "rkis", NAME, op_namespace, "no pods in status",
        lambda o: not (o.get("status") or {}).get("pods"), 60,
    )  # fmt: skip
    # Stopped, the operator cannot rewrite the pointer before the new pod reads it.
    operator.kill(signal.SIGKILL)
    try:
        cm = kubectl_json("get", "configmap", f"{NAME}-rekindle", "-n", op_namespace)
        signed = cm["data"]["checkpoint"]
        assert cm["data"]["signature"].startswith(f"v1:{ck['metadata']['uid']}:"), cm["data"]
        forged = signed.rsplit("/", 1)[0] + "/elsewhere-" + ck["metadata"]["uid"][:8]
        patch = json.dumps({"data": {"checkpoint": forged}})
        kubectl("patch", "configmap", f"{NAME}-rekindle", "-n", op_namespace, "-p", patch)
        kubectl("patch", f"rkis/{NAME}", "-n", op_namespace, "--type=merge", "-p",
                json.dumps({"spec": {"replicas": 1}}))  # fmt: skip
        kubectl("scale", f"deployment/{NAME}", "-n", op_namespace, "--replicas=1")
        # The new pod waits for the operator to place it (warm placement's scheduling
        # gate); with the operator stopped, the test releases it as the operator would.
        wait_until("the new pod", lambda: bool(pods_of(NAME, op_namespace)), 60)
        for p in pods_of(NAME, op_namespace):
            if placement.gated(p):
                release = placement.release_patch(p, [], [])
                kubectl("patch", "pod", p["metadata"]["name"], "-n", op_namespace,
                        "--type=merge", "-p", json.dumps(release))  # fmt: skip

        def started() -> bool:
            pods = pods_of(NAME, op_namespace)
            statuses = [
                c for p in pods for c in (p.get("status") or {}).get("containerStatuses") or []
            ]
            return any("running" in (c.get("state") or {}) for c in statuses)

        wait_until("the new pod's container started", started, 180)
        (new_pod,) = [p["metadata"]["name"] for p in pods_of(NAME, op_namespace)]
    finally:
        operator.start()
    obj = ready_with(op_namespace, "booted")
    pod = obj["status"]["pods"][0]
    assert pod["name"] == new_pod, pod
    assert pod["reason"].startswith("pointer_refused: "), pod
    assert "does not match" in pod["reason"], pod
    assert completions(served["url"]) == before
    # The operator put its own pointer back: the next replica restores again.
    cm = kubectl_json("get", "configmap", f"{NAME}-rekindle", "-n", op_namespace)
    assert cm["data"]["checkpoint"] == signed


def test_operator_killed_mid_checkpoint_recovers(
    served: dict[str, Any],
    before: list[str],
    second: dict[str, Any],
    op_namespace: str,
    host_dir: Path,
    operator: OperatorProcess,
) -> None:
    st, pod_name = second["done"]["status"], second["running"]["status"]["pod"]
    # The new operator process recorded the checkpoint the agent finished.
    assert (st["phase"], st["reason"]) == ("Ready", "Verified"), json.dumps(st, indent=1)
    assert st["message"] == (
        "checkpoint written and restored once by the agent "
        "(recorded after an operator restart, from the agent's status)"
    ), st
    assert st["pod"] == pod_name and st["verified"] is True, st
    events = kubectl_json(
        "get", "events", "-n", op_namespace, "--field-selector", "involvedObject.name=second"
    )["items"]
    assert any(
        e["reason"] == "CheckpointReady"
        and e["message"] == f"pod {pod_name} finished it while the operator restarted"
        for e in events
    ), [(e["reason"], e["message"]) for e in events]
    data = data_dir(host_dir, second["done"])
    assert (data / "manifest.json").is_file(), sorted(p.name for p in data.iterdir())
    # Nothing left over: the same pod (not a replacement), back in the Service; no
    # Checkpoint still running; the service Ready and pointing at the new checkpoint.
    wait_until(
        "the pod back in the Service",
        lambda: (
            [
                (p["metadata"]["name"], p["metadata"]["labels"].get(SERVING))
                for p in pods_of(NAME, op_namespace)
            ]
            == [(pod_name, "true")]
        ),
        120,
    )
    wait_until(
        f"the Service's only endpoint to be {pod_name}",
        lambda: ready_endpoints(op_namespace) == [pod_name],
        120,
    )
    obj = wait_status(
        "rkis",
        NAME,
        op_namespace,
        "Ready, new replicas pointed at second",
        lambda o: (
            (o.get("status") or {}).get("phase") == "Ready"
            and (o.get("status") or {}).get("checkpoint") == "second"
        ),
        120,
    )
    assert [p["name"] for p in obj["status"]["pods"]] == [pod_name], obj["status"]["pods"]
    assert obj["status"]["pods"][0]["ready"] is True, obj["status"]["pods"]
    phases = {
        c["metadata"]["name"]: (c.get("status") or {}).get("phase")
        for c in kubectl_json("get", "rkcp", "-n", op_namespace)["items"]
    }
    assert not [n for n, ph in phases.items() if ph not in ("Ready", "Failed")], phases
    assert operator.alive(), operator.tail()
    assert completions(served["url"]) == before


SERVING = "rekindle.dev/serving"


def ready_endpoints(ns: str) -> list[str]:
    """Names of the pods the Service routes to (its EndpointSlices' ready endpoints)."""
    slices = kubectl_json(
        "get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={NAME}"
    )["items"]
    return sorted(
        ep["targetRef"]["name"]
        for sl in slices
        for ep in sl.get("endpoints") or []
        if (ep.get("conditions") or {}).get("ready") and ep.get("targetRef")
    )


def test_checkpoint_naming_missing_isvc_fails_at_once(
    operator: OperatorProcess, op_namespace: str
) -> None:
    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "orphan"},
        "spec": {"inferenceService": "nope"},
    }
    assert apply(ck, op_namespace).returncode == 0
    obj = wait_status(
        "rkcp",
        "orphan",
        op_namespace,
        "Failed",
        lambda o: (o.get("status") or {}).get("phase") == "Failed",
        60,
    )
    assert obj["status"]["reason"] == "InferenceServiceNotFound"
    assert "'nope' does not exist" in obj["status"]["message"]


def test_shm_below_full_need_refused_by_operator(
    operator: OperatorProcess, op_namespace: str
) -> None:
    # 600Mi passes the CEL rule (>= the 512Mi multimodal cache) but not the full formula.
    doc = isvc_manifest("undersized", "/var/lib/rekindle/unused", sharedMemory={"size": "600Mi"})
    assert apply(doc, op_namespace).returncode == 0
    need = shm_need(parse_spec("undersized", op_namespace, doc["spec"])).total
    obj = wait_status(
        "rkis",
        "undersized",
        op_namespace,
        "Failed",
        lambda o: (o.get("status") or {}).get("phase") == "Failed",
        60,
    )
    cond = {c["type"]: c for c in obj["status"]["conditions"]}["SharedMemorySized"]
    assert cond["status"] == "False" and f"{need // 2**20}Mi" in cond["message"]
    events = kubectl_json(
        "get", "events", "-n", op_namespace, "--field-selector", "involvedObject.name=undersized"
    )["items"]
    assert any(e["reason"] == "SharedMemorySizedBelowNeed" for e in events)
    assert kubectl("get", "deploy", "undersized", "-n", op_namespace, check=False).returncode != 0
    kubectl("delete", "rkis", "undersized", "-n", op_namespace, "--wait=false")


def test_someone_elses_service_with_our_name_is_left_alone(
    operator: OperatorProcess, op_namespace: str
) -> None:
    """A Service `squat` of another application: the InferenceService `squat` goes
    Failed and neither the Service's selector nor anything else of ours is written."""
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "squat"},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]},
    }
    assert apply(svc, op_namespace).returncode == 0
    try:
        assert (
            apply(isvc_manifest("squat", "/var/lib/rekindle/unused"), op_namespace).returncode == 0
        )
        obj = wait_status(
            "rkis", "squat", op_namespace, "Failed: the Service is not ours",
            lambda o: "is not ours" in str((o.get("status") or {}).get("message", "")), 60,
        )  # fmt: skip
        assert obj["status"]["phase"] == "Failed"
        assert obj["status"]["message"].startswith("Service squat exists and is not ours")
        after = get("service", "squat", op_namespace)
        assert after is not None and after["spec"]["selector"] == {"app": "theirs"}
        for kind in ("deployment", "secret", "configmap"):
            names = [
                o["metadata"]["name"]
                for o in kubectl_json("get", kind, "-n", op_namespace)["items"]
            ]
            assert not [n for n in names if n.startswith("squat")], (kind, names)
    finally:
        kubectl("delete", "rkis", "squat", "-n", op_namespace, "--wait=false")
        kubectl("delete", "service", "squat", "-n", op_namespace, "--wait=false")


def test_deleting_a_checkpoint_a_replica_maps_waits_for_the_replica(
    served: dict[str, Any],
    before: list[str],
    op_namespace: str,
    host_dir: Path,
    kubectl_rekindle: dict[str, str],
) -> None:
    _, ck = checkpoint_with_plugin(kubectl_rekindle, op_namespace, "third")
    assert ck["status"]["phase"] == "Ready", ck
    path, data = ck["status"]["path"], data_dir(host_dir, ck)
    scale_zero_then_one(op_namespace)
    obj = ready_with(op_namespace, "restored")
    assert obj["status"]["checkpoint"] == "third", obj["status"]

    def annotated() -> bool:
        pods = pods_of(NAME, op_namespace)
        ann = (pods[0]["metadata"].get("annotations") or {}) if pods else {}
        return path in ann.get("rekindle.dev/restored-from", "")

    wait_until("the replica to report it was restored from the checkpoint", annotated, 60)
    (pod,) = pods_of(NAME, op_namespace)
    kubectl("delete", "rkcp", "third", "-n", op_namespace, "--wait=false")
    wait_until(
        "the deletion to say it waits for the replica",
        lambda: any(
            e["reason"] == "CheckpointDeletionWaiting" and pod["metadata"]["name"] in e["message"]
            for e in kubectl_json(
                "get",
                "events",
                "-n",
                op_namespace,
                "--field-selector",
                "involvedObject.name=third",
            )["items"]
        ),
        60,
    )
    kept = get("rkcp", "third", op_namespace)
    assert kept is not None and kept["metadata"].get("deletionTimestamp")
    assert data.is_dir() and any(data.rglob("pages-*.img"))
    # The restored replica maps the checkpoint's files: it keeps serving the same answers.
    assert completions(served["url"]) == before
    assert data.is_dir()
    # Once no pod maps it, the Checkpoint goes and so does its data.
    scale(op_namespace, 0)
    wait_until("the Checkpoint gone", lambda: get("rkcp", "third", op_namespace) is None, 240)
    wait_until(f"{data} removed", lambda: not data.exists(), 180)


class ServingWatch:
    """Counts the Service's ready endpoints every 0.25 s in a thread: the fewest seen."""

    def __init__(self, ns: str) -> None:
        from rekindle_operator.kube import Kube, load_configuration

        self.kube = Kube(load_configuration(ENV["KUBECONFIG"]))
        self.url = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
        self.fewest: int | None = None
        self.samples = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def ready(self) -> int:
        out = self.kube.request(
            "GET", self.url, query={"labelSelector": f"kubernetes.io/service-name={NAME}"}
        )
        return sum(
            1
            for s in out.get("items", [])
            for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready")
        )

    def _run(self) -> None:
        while not self.stop.wait(0.25):
            n = self.ready()
            self.samples += 1
            self.fewest = n if self.fewest is None else min(self.fewest, n)

    def __enter__(self) -> ServingWatch:
        assert self.ready() >= 1, "no ready endpoint before the spec change"
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def test_a_changed_spec_is_checkpointed_by_itself_with_a_replica_always_serving(
    served: dict[str, Any], second: dict[str, Any], op_namespace: str, host_dir: Path
) -> None:
    """spec.coldStart.checkpoint.auto: a spec change (one env var) rolls the service, the
    new spec's replica boots, and the operator checkpoints it by itself with one replica
    more meanwhile; the Service has a ready endpoint throughout. keep: 1 retires the
    older automatic checkpoint with its data ("second", made by hand, relabelled as an
    automatic one of the old spec for this)."""
    one_replica(op_namespace)
    old = get("rkcp", "second", op_namespace)
    assert old is not None and old["status"]["phase"] == "Ready", old
    old_data = data_dir(host_dir, old)
    kubectl("label", "rkcp", "second", "-n", op_namespace,
            "rekindle.dev/auto-checkpoint=true",
            f"rekindle.dev/spec-fingerprint={old['status']['fingerprint']}")  # fmt: skip
    spec = isvc(op_namespace)["spec"]
    patch = {
        "spec": {
            "coldStart": {"checkpoint": {"auto": True, "keep": 1}},
            "env": [*(spec.get("env") or []), {"name": "REKINDLE_TEST_SPEC", "value": "2"}],
        }
    }
    with ServingWatch(op_namespace) as watch:
        kubectl("patch", "rkis", NAME, "-n", op_namespace, "--type=merge", "-p", json.dumps(patch))
        before = old["status"]["fingerprint"]
        fp = wait_status(
            "rkis", NAME, op_namespace, "the new spec's fingerprint",
            lambda o: (o.get("status") or {}).get("fingerprint") not in (None, before), 60,
        )["status"]["fingerprint"]  # fmt: skip
        auto = f"{NAME}-auto-{fp[:10]}"
        done = wait_status(
            "rkcp", auto, op_namespace, "the automatic checkpoint Ready",
            lambda o: (o.get("status") or {}).get("phase") in ("Ready", "Failed"), 900,
        )  # fmt: skip
        assert done["status"]["phase"] == "Ready", done["status"]
        wait_status(
            "rkis", NAME, op_namespace, "new replicas pointed at it, surge over",
            lambda o: (o.get("status") or {}).get("checkpoint") == auto
            and (get("deploy", NAME, op_namespace) or {}).get("spec", {}).get("replicas") == 1,
            120,
        )  # fmt: skip
    assert watch.samples > 20 and watch.fewest is not None and watch.fewest >= 1, (
        watch.samples,
        watch.fewest,
    )
    # keep: 1: the older automatic checkpoint is retired, its data removed.
    wait_until(
        "Checkpoint second retired", lambda: get("rkcp", "second", op_namespace) is None, 300
    )
    wait_until(f"{old_data} removed", lambda: not old_data.exists(), 300)
    assert get("rkcp", "first", op_namespace) is not None  # made by hand: never retired
    events = kubectl_json(
        "get", "events", "-n", op_namespace, "--field-selector", f"involvedObject.name={NAME}"
    )["items"]
    assert {"AutoCheckpoint", "CheckpointRetired"} <= {e["reason"] for e in events}


def test_delete_cleans_up_owned_objects_and_checkpoint_data(
    served: dict[str, Any], first: dict[str, Any], op_namespace: str, host_dir: Path
) -> None:
    """Deleting the InferenceService takes everything it owns with it, every Checkpoint of
    it and their data (so this runs last: it deletes the module's service)."""
    mine = [
        c
        for c in kubectl_json("get", "rkcp", "-n", op_namespace)["items"]
        if c["spec"]["inferenceService"] == NAME and (c.get("status") or {}).get("phase") == "Ready"
    ]
    assert "first" in [c["metadata"]["name"] for c in mine], mine
    datas = [data_dir(host_dir, c) for c in mine]
    assert all(d.is_dir() for d in datas), datas
    kubectl("delete", "rkis", NAME, "-n", op_namespace, "--wait=false")
    owned = [
        ("deploy", NAME),
        ("svc", NAME),
        ("secret", f"{NAME}-agent-token"),
        ("configmap", f"{NAME}-rekindle"),
        *(("rkcp", c["metadata"]["name"]) for c in mine),
    ]
    wait_until(
        f"{', '.join(f'{k}/{n}' for k, n in owned)} deleted",
        lambda: all(get(k, n, op_namespace) is None for k, n in owned),
        180,
    )
    wait_until(
        f"{', '.join(map(str, datas))} removed (deletionPolicy Delete)",
        lambda: not any(d.exists() for d in datas),
        180,
    )
    assert not pods_of(NAME, op_namespace)
