"""spec.autoscaling end to end, driven by a real KEDA: 0 -> 1 on a first request
held by the front (answered, not refused), 1 -> 2 under load, back to 0 when idle.
The service has an API key (spec.apiKeySecretRef): clients send it through the
front, which holds none and still reads every replica's load.

The chart installs everything in-cluster: the operator, the front and KEDA (the
optional dependency, built from its Go module: `make images` loads
rekindle.local/keda:dev). KEDA's CRDs come from the same build. The local cluster
has no DNS, so the front and KEDA's operator get fixed Service addresses (in
the Service range's static band) and the chart is told to use them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.cluster_tools import REPO, SCRIPTS, helm, kubectl, kubectl_json, wait_until
from tests.cluster.operator_fixtures import (
    OPERATOR_IMAGE,
    RUNTIME_IMAGE,
    apply,
    install_crds,
    isvc_manifest,
    pods_of,
    require_image,
    wait_status,
)

pytestmark = pytest.mark.cluster

FRONT_IP = "10.96.0.200"
KEDA_OPERATOR_IP = "10.96.0.201"
FRONT = f"http://{FRONT_IP}:8080"
KEDA_IMAGE = "rekindle.local/keda:dev"
# Long enough for the second replica to finish booting once the load stops (a boot
# under full load on 2 cores takes minutes), short enough for the test.
SCALE_DOWN_DELAY_S = 60
API_KEY = "sk-autoscaling-" + uuid.uuid4().hex


def keda_crds() -> str:
    return (
        subprocess.run(
            [str(SCRIPTS / "build-keda")], check=True, stdout=subprocess.PIPE, text=True
        ).stdout.strip()
        + "/crds"
    )


def require_aggregation_layer() -> None:
    """KEDA's metrics adapter is an extension API server: the apiserver must proxy to it."""
    ca = kubectl(
        "get", "configmap", "extension-apiserver-authentication", "-n", "kube-system",
        "-o", "jsonpath={.data.requestheader-client-ca-file}", check=False,
    ).stdout  # fmt: skip
    if not ca.strip():
        pytest.fail(
            "the cluster's apiserver has no aggregation layer (--requestheader-client-ca-file), "
            "which KEDA's metrics adapter needs; a local cluster started before "
            "scripts/local-cluster set one up must be restarted: "
            "`scripts/local-cluster down && scripts/local-cluster up --nodes 2`"
        )


@pytest.fixture(scope="module")
def stack(cluster: dict[str, str]) -> Iterator[str]:
    """The chart with its operator, the front and KEDA, watching a fresh namespace."""
    for image, build in ((OPERATOR_IMAGE, "operator"), (RUNTIME_IMAGE, "runtime-cpu"),
                         (KEDA_IMAGE, "keda")):  # fmt: skip
        require_image(image, build)
    require_aggregation_layer()
    install_crds()
    kubectl("apply", "--server-side", "--force-conflicts", "-f", keda_crds())
    ns = f"as-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", ns)
    name = "rk"
    repo, tag = OPERATOR_IMAGE.rsplit(":", 1)
    r = helm(
        "install", name, str(REPO / "charts" / "rekindle"), "-n", ns,
        "--set", "crds.install=false",
        "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
        "--set", "image.pullPolicy=Never",
        "--set", f"watchNamespaces={{{ns}}}",
        "--set", "statusIntervalSeconds=2",
        "--set", "front.enabled=true", "--set", "front.image.pullPolicy=Never",
        "--set", f"front.service.clusterIP={FRONT_IP}", "--set", f"front.url={FRONT}",
        "--set", "front.holdTimeoutSeconds=300",
        "--set", "keda.enabled=true", "--set", "keda.image.pullPolicy=Never",
        "--set", f"keda.operatorClusterIP={KEDA_OPERATOR_IP}",
        "--wait", "--timeout", "300s",
        check=False,
    )  # fmt: skip
    if r.returncode != 0:
        logs = kubectl("logs", "-n", ns, "deploy/keda-operator", "--tail=40", check=False).stdout
        helm("uninstall", name, "-n", ns, check=False)
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
        pytest.fail(f"helm install failed: {r.stdout}{r.stderr}\nKEDA operator log:\n{logs}")
    wait_until(
        "KEDA's external metrics API to be available",
        lambda: kubectl(
            "get", "apiservice", "v1beta1.external.metrics.k8s.io",
            "-o", 'jsonpath={.status.conditions[?(@.type=="Available")].status}',
            check=False,
        ).stdout.strip() == "True",
        180,
    )  # fmt: skip
    yield ns
    kubectl("scale", "rkis", "--all", "-n", ns, "--replicas=0", check=False)
    kubectl("delete", "inferenceservices.rekindle.dev", "--all", "-n", ns, "--timeout=90s",
            check=False)  # fmt: skip
    # KEDA's finalizer on the (owned, garbage-collected) ScaledObjects needs KEDA:
    # they go before KEDA does.
    kubectl("delete", "scaledobjects.keda.sh", "--all", "-n", ns, "--timeout=90s", check=False)
    helm("uninstall", name, "-n", ns, "--wait", check=False)
    kubectl("delete", "namespace", ns, "--wait=false", check=False)
    shutil.rmtree(host_root(ns), ignore_errors=True)  # no checkpoint here: CRIU's kdat cache


def host_root(ns: str) -> str:
    return f"/var/lib/rekindle/test-{ns}"


def post(
    path: str, body: dict[str, Any], timeout: float, key: str | None = API_KEY
) -> tuple[int, Any, float]:
    """POST JSON through the front, with the service's API key; (status, answer, seconds)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(FRONT + path, data=json.dumps(body).encode(), headers=headers)
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), time.monotonic() - start
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), time.monotonic() - start
    except (urllib.error.URLError, OSError) as e:  # no answer at all: status 0
        return 0, repr(e), time.monotonic() - start


def replicas(ns: str) -> tuple[int, int]:
    obj = kubectl_json("get", "rkis", "auto", "-n", ns)
    return int(obj["spec"].get("replicas", 0)), int(
        (obj.get("status") or {}).get("readyReplicas") or 0
    )


def front_metric(line_start: str) -> float:
    text = urllib.request.urlopen(FRONT + "/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)
    )


def test_zero_to_one_on_a_held_request_then_two_under_load_then_zero(stack: str) -> None:
    ns = stack
    doc = isvc_manifest(
        "auto", host_root(ns), replicas=0,
        autoscaling={"minReplicas": 0, "maxReplicas": 2, "metric": "requests", "target": 2,
                     "scaleDownDelay": SCALE_DOWN_DELAY_S},
    )  # fmt: skip
    doc["spec"]["resources"]["cpu"] = "500m"  # two replicas beside KEDA on 2 cores
    kubectl("create", "secret", "generic", "auto-key", "-n", ns,
            f"--from-literal=api-key={API_KEY}")  # fmt: skip
    doc["spec"]["apiKeySecretRef"] = {"name": "auto-key"}
    assert apply(doc, ns).returncode == 0
    # The operator made the ScaledObject and KEDA took it (its HPA exists).
    wait_until(
        "KEDA's HPA for the InferenceService",
        lambda: kubectl("get", "hpa", "keda-hpa-auto", "-n", ns, check=False).returncode == 0,
        120,
    )
    so = kubectl_json("get", "scaledobject", "auto", "-n", ns)
    assert so["spec"]["triggers"][0]["metadata"]["url"] == f"{FRONT}/load/{ns}/auto"
    assert replicas(ns)[0] == 0 and not pods_of("auto", ns)

    # 0 -> 1: the first request is held while KEDA wakes a replica, then answered.
    status, answer, waited = post(
        f"/{ns}/auto/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4}, 300
    )
    assert status == 200, answer
    assert answer["choices"][0]["text"], answer
    assert replicas(ns)[0] == 1  # KEDA scaled the service to one replica
    assert (
        front_metric(
            f'rekindle_front_hold_seconds_count{{namespace="{ns}",outcome="served",service="auto"}}'
        )
        == 1
    )
    held_for = front_metric(
        f'rekindle_front_hold_seconds_sum{{namespace="{ns}",outcome="served",service="auto"}}'
    )
    print(f"first request: answered after {waited:.1f}s, held {held_for:.1f}s")
    assert 0 < held_for <= waited
    # The key is the agent's to check: without it, refused by the replica (through the front).
    status, answer, _ = post(
        f"/{ns}/auto/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1}, 30,
        key=None,
    )  # fmt: skip
    assert status == 401 and "API key" in answer, answer

    # 1 -> 2: six clients keep long completions in flight (target 2 per replica).
    stop = threading.Event()
    codes: list[int] = []

    def client() -> None:
        while not stop.is_set():
            got = post(
                f"/{ns}/auto/v1/completions",
                {"model": "tiny", "prompt": "Count:", "max_tokens": 200, "ignore_eos": True},
                120,
            )
            codes.append(got[0])

    threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        # KEDA's HPA asks for a second replica (6 in flight / target 2, at most 2).
        wait_status(
            "rkis", "auto", ns, "two replicas asked for under load",
            lambda o: o["spec"].get("replicas") == (o.get("status") or {}).get("replicas") == 2,
            240,
        )  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    assert codes and set(codes) == {200}, codes
    # The second replica boots (faster without the load) and is Ready before the delay
    # lets the autoscaler take it away again.
    wait_status(
        "rkis", "auto", ns, "the second replica Ready",
        lambda o: (o.get("status") or {}).get("readyReplicas") == 2, SCALE_DOWN_DELAY_S,
    )  # fmt: skip

    # Idle: back to 0 (the HPA to 1 after the delay, KEDA to 0 after its cooldown).
    wait_status(
        "rkis", "auto", ns, "scaled back to zero when idle",
        lambda o: o["spec"].get("replicas") == 0, 4 * SCALE_DOWN_DELAY_S,
    )  # fmt: skip
    wait_until("the replicas' pods to go", lambda: not pods_of("auto", ns), 180)
