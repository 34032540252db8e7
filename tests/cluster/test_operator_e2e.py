"""The operator end to end on the real local cluster, with the real CPU runtime image.

One InferenceService is shared by the module (each vLLM boot costs ~30-60 s),
serving the trained SmolLM2 (examples/smollm2-cpu.yaml), so "the same output"
after a restore is also a right one ("Paris"):
serve -> checkpoint -> scale 0->1 restores with identical greedy output ->
a corrupted checkpoint boots normally and says why -> the operator killed
mid-checkpoint recovers -> a Checkpoint deleted while a restored replica maps
it waits for that replica (which keeps serving the same answers) -> deleting
cleans up. Refusals that need the
operator (a Checkpoint naming a missing InferenceService, /dev/shm below the
full computed need) run beside it.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent import immutable
from rekindle_agent.immutable import remove_tree
from rekindle_operator.quantity import to_bytes
from rekindle_operator.shm_sizing import shm_need
from rekindle_operator.spec import parse_spec

from tests.cluster.cluster_tools import kubectl, kubectl_json, wait_until
from tests.cluster.operator_fixtures import (
    OperatorProcess,
    apply,
    data_dir,
    get,
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

__all__ = ["kubectl_rekindle", "op_namespace", "operator"]  # fixtures used by name

pytestmark = pytest.mark.cluster
NAME = "smollm2"
PROMPTS = ("Hello, my name is", "The capital of France is", "1, 2, 3, 4,")


@pytest.fixture(scope="module")
def host_dir(op_namespace: str) -> Iterator[Path]:
    path = Path(f"/var/lib/rekindle/test-{op_namespace}")
    yield path
    with contextlib.suppress(OSError):
        remove_tree(path)  # immutable pages images: rm -rf cannot


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


def accepts(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def scale(ns: str, n: int) -> None:
    kubectl("scale", f"rkis/{NAME}", "-n", ns, f"--replicas={n}")


def scale_zero_then_one(ns: str) -> None:
    scale(ns, 0)
    wait_until("no pods left", lambda: not pods_of(NAME, ns), 180)
    scale(ns, 1)


@pytest.fixture(scope="module")
def served(operator: OperatorProcess, op_namespace: str, host_dir: Path) -> dict[str, Any]:
    require_runtime_image()
    r = apply(isvc_manifest(NAME, str(host_dir), example="smollm2-cpu.yaml"), op_namespace)
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
        30,
    )


def test_checkpoint_ready_then_new_replica_restores_with_same_output(
    served: dict[str, Any], before: list[str], op_namespace: str, kubectl_rekindle: dict[str, str]
) -> None:
    r = run_plugin(
        kubectl_rekindle,
        "-n",
        op_namespace,
        "checkpoint",
        NAME,
        "--checkpoint-name",
        "first",
        "--wait",
        "--timeout",
        "900",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Ready:" in r.stdout
    ck = get("rkcp", "first", op_namespace)
    assert ck is not None
    st = ck["status"]
    assert st["phase"] == "Ready" and st["sizeBytes"] > 0 and st["phaseSeconds"]
    assert st["fingerprint"] == isvc(op_namespace)["status"]["fingerprint"]
    assert data_dir(served["isvc"]["spec"]["coldStart"]["storage"]["hostPath"]["path"], ck).is_dir()
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

    scale_zero_then_one(op_namespace)
    obj = ready_with(op_namespace, "restored")
    cond = {c["type"]: c for c in obj["status"]["conditions"]}["Restored"]
    assert cond["status"] == "True", cond
    assert "restored" in obj["status"]["lastColdStartSeconds"]
    # The pod's own figure, from the agent's timestamps, recorded by the operator.
    assert obj["status"]["pods"][0]["agentReadySeconds"] > 0, obj["status"]["pods"]
    # vLLM's tree passed every check for the zero-copy restore; its images are immutable.
    assert obj["status"]["pods"][0]["memory"] == "mmap", obj["status"]["pods"]
    pages = sorted(
        data_dir(served["isvc"]["spec"]["coldStart"]["storage"]["hostPath"]["path"], ck).glob(
            "images/pages-*.img"
        )
    )
    assert pages and all(immutable.is_immutable(p) for p in pages)
    assert completions(served["url"]) == before

    status = run_plugin(kubectl_rekindle, "-n", op_namespace, "status", NAME)
    assert status.returncode == 0 and ": restored" in status.stdout, status.stdout
    assert "memory mmap" in status.stdout, status.stdout


def test_corrupted_checkpoint_boots_normally_and_says_why(
    served: dict[str, Any], before: list[str], op_namespace: str, host_dir: Path
) -> None:
    ck = get("rkcp", "first", op_namespace)
    assert ck is not None
    where = data_dir(host_dir, ck)
    images = sorted(where.rglob("pages-*.img"), key=lambda p: p.stat().st_size)
    assert images, f"no CRIU pages image under {where}"
    with pytest.raises(PermissionError):  # immutable: root cannot write it as it is
        images[-1].open("r+b")
    immutable.set_immutable(images[-1], False)  # what a root attacker on the node would do
    with images[-1].open("r+b") as f:  # flip bytes in the middle of the biggest image
        f.seek(images[-1].stat().st_size // 2)
        chunk = f.read(4096)
        f.seek(-len(chunk), 1)
        f.write(bytes(b ^ 0xFF for b in chunk))
    scale_zero_then_one(op_namespace)
    obj = ready_with(op_namespace, "booted")
    pod = obj["status"]["pods"][0]
    assert pod["reason"] and "no checkpoint" not in pod["reason"], pod
    cond = {c["type"]: c for c in obj["status"]["conditions"]}["Restored"]
    assert cond["status"] == "False" and pod["reason"][:40] in cond["message"]
    events = kubectl_json(
        "get", "events", "-n", op_namespace, "--field-selector", f"involvedObject.name={NAME}"
    )["items"]
    assert any(e["reason"] == "RestoredSomeBooted" for e in events)
    assert completions(served["url"]) == before


def test_operator_killed_mid_checkpoint_recovers(
    served: dict[str, Any], op_namespace: str, operator: OperatorProcess
) -> None:
    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "second"},
        "spec": {"inferenceService": NAME},
    }
    assert apply(ck, op_namespace).returncode == 0
    wait_status(
        "rkcp",
        "second",
        op_namespace,
        "Running",
        lambda o: (o.get("status") or {}).get("phase") == "Running",
        120,
    )
    operator.kill(signal.SIGKILL)
    time.sleep(2)
    operator.start()
    done = wait_status(
        "rkcp",
        "second",
        op_namespace,
        "Ready or Failed",
        lambda o: (o.get("status") or {}).get("phase") in ("Ready", "Failed"),
        900,
    )
    if done["status"]["phase"] == "Failed":
        assert done["status"]["reason"] in ("OperatorRestarted", "AgentCheckpointFailed")
        assert done["status"]["message"], done["status"]
    wait_until(
        "the pod back in the Service",
        lambda: all(
            p["metadata"]["labels"].get("rekindle.dev/serving") == "true"
            for p in pods_of(NAME, op_namespace)
        ),
        120,
    )
    wait_status(
        "rkis",
        NAME,
        op_namespace,
        "Ready",
        lambda o: (o.get("status") or {}).get("phase") == "Ready",
        300,
    )
    assert completions(served["url"])


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
    kubectl("delete", "rkis", "undersized", "-n", op_namespace)


def test_deleting_a_checkpoint_a_replica_maps_waits_for_the_replica(
    served: dict[str, Any],
    before: list[str],
    op_namespace: str,
    host_dir: Path,
    kubectl_rekindle: dict[str, str],
) -> None:
    r = run_plugin(
        kubectl_rekindle,
        "-n",
        op_namespace,
        "checkpoint",
        NAME,
        "--checkpoint-name",
        "third",
        "--wait",
        "--timeout",
        "900",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    ck = get("rkcp", "third", op_namespace)
    assert ck is not None
    path, data = ck["status"]["path"], data_dir(host_dir, ck)
    scale_zero_then_one(op_namespace)
    ready_with(op_namespace, "restored")

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
                "get", "events", "-n", op_namespace, "--field-selector", "involvedObject.name=third"
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


def test_delete_cleans_up_owned_objects_and_checkpoint_data(
    served: dict[str, Any], op_namespace: str, host_dir: Path
) -> None:
    ck = get("rkcp", "first", op_namespace)
    assert ck is not None
    data = data_dir(host_dir, ck)
    assert data.is_dir()
    kubectl("delete", "rkis", NAME, "-n", op_namespace, "--wait=false")
    for kind, name in (
        ("deploy", NAME),
        ("svc", NAME),
        ("secret", f"{NAME}-agent-token"),
        ("configmap", f"{NAME}-rekindle"),
        ("rkcp", "first"),
    ):
        wait_until(
            f"{kind}/{name} deleted", lambda k=kind, n=name: get(k, n, op_namespace) is None, 180
        )
    wait_until(f"{data} removed (deletionPolicy Delete)", lambda: not data.exists(), 180)
