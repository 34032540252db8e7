"""The embedded local cluster is a real, usable Kubernetes node."""

from __future__ import annotations

import json
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cluster.cluster_tools import (
    NODE1,
    NODE2,
    NODE2_TAINT,
    NODE2_TOLERATION,
    helm,
    kubectl,
    kubectl_json,
    require_second_node,
    wait_until,
)

pytestmark = pytest.mark.cluster
CHART = Path(__file__).parent / "charts" / "hello"


def pod_yaml(name: str, image: str, shm_limit: str | None = None) -> str:
    volumes = mounts = ""
    if shm_limit:
        volumes = f"""
  volumes:
  - name: dshm
    emptyDir: {{medium: Memory, sizeLimit: {shm_limit}}}"""
        mounts = """
    volumeMounts:
    - {name: dshm, mountPath: /dev/shm}"""
    return (
        textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata: {{name: {name}}}
        spec:
          terminationGracePeriodSeconds: 0
          containers:
          - name: main
            image: {image}
            imagePullPolicy: Never
            args: ["echo started; sleep 3600"]""")
        + mounts
        + volumes
        + "\n"
    )


def run_pod(namespace: str, name: str, image: str, shm_limit: str | None = None) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=pod_yaml(name, image, shm_limit))
    kubectl("wait", "-n", namespace, "--for=condition=Ready", f"pod/{name}", "--timeout=120s")


def shm_kib(namespace: str, pod: str) -> int:
    out = kubectl("exec", "-n", namespace, pod, "--", "df", "-k", "/dev/shm").stdout
    return int(out.splitlines()[-1].split()[1])


def test_both_nodes_are_ready_and_only_the_second_is_tainted(cluster: dict[str, str]) -> None:
    nodes = {n["metadata"]["name"]: n for n in kubectl_json("get", "nodes")["items"]}
    assert set(nodes) == {NODE1, NODE2}
    for n in nodes.values():
        ready = {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"]
        assert ready == "True"
        assert n["status"]["nodeInfo"]["kubeletVersion"] == "v1.35.4"
    assert "taints" not in nodes[NODE1]["spec"]
    assert nodes[NODE2]["spec"]["taints"] == [
        {"key": NODE2_TAINT, "value": "second", "effect": "NoSchedule"}
    ]
    address = {
        name: next(a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP")
        for name, n in nodes.items()
    }
    assert address[NODE2] == "10.245.0.2" and address[NODE1] != address[NODE2]


def test_pods_on_the_two_nodes_reach_each_other_directly_and_by_service(
    namespace: str, smoke_image: str
) -> None:
    """The second node's pod network is routed to the first's (and back through
    Services, which its own kube-proxy masquerades); logs and exec reach its kubelet."""
    require_second_node()
    for name, node in (("one", NODE1), ("two", NODE2)):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "tolerations": [NODE2_TOLERATION],
                "containers": [
                    {
                        "name": "web",
                        "image": smoke_image,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "hostname > /tmp/id; httpd -f -p 8080 -h /tmp"],
                    }
                ],
            },
        }
        svc = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": 8080}]},
        }
        for obj in (pod, svc):
            kubectl("apply", "-f", "-", input=json.dumps(obj))
    kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/one", "pod/two", "--timeout=60s")
    ip = {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in kubectl_json("get", "pods", "-n", namespace)["items"]
    }
    svc_ip = {
        n: kubectl_json("get", "service", "-n", namespace, n)["spec"]["clusterIP"]
        for n in ("one", "two")
    }
    assert ip["two"].startswith("10.244.1.") and ip["one"].startswith("10.244.0.")

    def fetch(client: str, host: str, port: int) -> str:
        """GET /id from host:port, in pod client (busybox nc): the body's last line."""
        get = f"printf 'GET /id HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port}"
        r = kubectl("exec", "-n", namespace, client, "--", "sh", "-c", get, check=False)
        return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""

    for client, server in (("one", "two"), ("two", "one")):
        assert fetch(client, ip[server], 8080) == server
        # kube-proxy programs a new Service's rules a moment after its endpoints appear.
        wait_until(
            f"{client} to reach {server}'s Service",
            lambda c=client, s=server: fetch(c, svc_ip[s], 80) == s,
            60,
        )
    assert kubectl("logs", "-n", namespace, "two").returncode == 0


def test_crd_roundtrip(namespace: str) -> None:
    crd = textwrap.dedent("""\
        apiVersion: apiextensions.k8s.io/v1
        kind: CustomResourceDefinition
        metadata: {name: widgets.smoke.rekindle.dev}
        spec:
          group: smoke.rekindle.dev
          scope: Namespaced
          names: {plural: widgets, singular: widget, kind: Widget}
          versions:
          - name: v1
            served: true
            storage: true
            schema:
              openAPIV3Schema:
                type: object
                properties:
                  spec:
                    type: object
                    properties: {size: {type: integer, minimum: 1}}
        """)
    kubectl("apply", "-f", "-", input=crd)
    try:
        kubectl(
            "wait", "--for=condition=Established", "crd/widgets.smoke.rekindle.dev", "--timeout=60s"
        )
        obj = (
            "apiVersion: smoke.rekindle.dev/v1\nkind: Widget\n"
            "metadata: {name: w1}\nspec: {size: 3}\n"
        )
        kubectl("apply", "-n", namespace, "-f", "-", input=obj)
        assert kubectl_json("get", "-n", namespace, "widget", "w1")["spec"] == {"size": 3}
        bad = obj.replace("size: 3", "size: 0")
        refused = kubectl("apply", "-n", namespace, "-f", "-", input=bad, check=False)
        assert refused.returncode != 0
        assert "spec.size" in refused.stderr
    finally:
        kubectl("delete", "crd", "widgets.smoke.rekindle.dev", "--wait=false", check=False)


def test_dev_shm_is_sized_by_memory_emptydir(namespace: str, smoke_image: str) -> None:
    run_pod(namespace, "sized", smoke_image, shm_limit="2Gi")
    run_pod(namespace, "default", smoke_image)
    assert shm_kib(namespace, "sized") == 2 * 1024 * 1024
    # containerd's runtime default, which is what breaks vLLM without Rekindle.
    assert shm_kib(namespace, "default") == 64 * 1024


def test_logs_and_exec(namespace: str, smoke_image: str) -> None:
    run_pod(namespace, "chatty", smoke_image)
    wait_until(
        "the container's log line",
        lambda: "started" in kubectl("logs", "-n", namespace, "chatty").stdout,
        30,
    )
    out = kubectl("exec", "-n", namespace, "chatty", "--", "sh", "-c", "echo $((6 * 7))")
    assert out.stdout.strip() == "42"


def test_deployment_scales_0_2_0(namespace: str, smoke_image: str) -> None:
    deploy = textwrap.dedent(f"""\
        apiVersion: apps/v1
        kind: Deployment
        metadata: {{name: scaler}}
        spec:
          replicas: 0
          selector: {{matchLabels: {{app: scaler}}}}
          template:
            metadata: {{labels: {{app: scaler}}}}
            spec:
              terminationGracePeriodSeconds: 0
              containers:
              - {{name: main, image: {smoke_image}, imagePullPolicy: Never}}
        """)
    kubectl("apply", "-n", namespace, "-f", "-", input=deploy)

    def ready_pods() -> list[dict]:
        pods = kubectl_json("get", "pods", "-n", namespace, "-l", "app=scaler")["items"]
        return [
            p
            for p in pods
            if p["metadata"].get("deletionTimestamp") is None
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", [])
            )
        ]

    assert ready_pods() == []
    kubectl("scale", "-n", namespace, "deployment/scaler", "--replicas=2")
    wait_until("2 ready pods", lambda: len(ready_pods()) == 2, namespace=namespace)
    images = {c["image"] for p in ready_pods() for c in p["spec"]["containers"]}
    assert images == {smoke_image}
    kubectl("scale", "-n", namespace, "deployment/scaler", "--replicas=0")
    wait_until(
        "no pods",
        lambda: kubectl_json("get", "pods", "-n", namespace, "-l", "app=scaler")["items"] == [],
    )


def test_unschedulable_pod_fails_a_wait_at_once(namespace: str, smoke_image: str) -> None:
    """A pod the node cannot hold fails a wait with the scheduler's reason, not a timeout."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-big"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": smoke_image,
                    "imagePullPolicy": "Never",
                    "resources": {"requests": {"cpu": "1000"}},
                }
            ]
        },
    }
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="Insufficient cpu") as err:
        wait_until("a pod that never fits", lambda: False, timeout=300, namespace=namespace)
    assert time.monotonic() - t0 < 120, "the wait should fail well before its timeout"
    assert "too-big" in str(err.value)


def test_helm_install_and_uninstall(namespace: str, smoke_image: str) -> None:
    helm("install", "hello", str(CHART), "-n", namespace, "--set", f"image={smoke_image}", "--wait")
    cm = kubectl_json("get", "configmap", "-n", namespace, "hello-greeting")
    assert cm["data"]["greeting"] == "hello from helm"
    assert "hello" in helm("list", "-n", namespace, "-q").stdout.split()
    helm("uninstall", "hello", "-n", namespace, "--wait")
    gone = kubectl("get", "configmap", "-n", namespace, "hello-greeting", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    assert helm("list", "-n", namespace, "-q").stdout.strip() == ""


def test_service_routes_to_its_pod(namespace: str, smoke_image: str) -> None:
    manifest = textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata: {{name: web, labels: {{app: web}}}}
        spec:
          terminationGracePeriodSeconds: 0
          containers:
          - name: main
            image: {smoke_image}
            imagePullPolicy: Never
            args: ["mkdir /www; echo hello-$HOSTNAME >/www/index.html; httpd -f -p 8080 -h /www"]
            readinessProbe: {{tcpSocket: {{port: 8080}}, periodSeconds: 1}}
        ---
        apiVersion: v1
        kind: Service
        metadata: {{name: web}}
        spec:
          selector: {{app: web}}
          ports: [{{port: 80, targetPort: 8080}}]
        """)
    kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
    kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/web", "--timeout=120s")
    ip = kubectl_json("get", "-n", namespace, "service", "web")["spec"]["clusterIP"]

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"http://{ip}/", timeout=2) as resp:
                return bool(resp.read().decode().strip() == "hello-web")
        except OSError:
            return False

    # kube-proxy programs the Service's rules a moment after the endpoints appear.
    wait_until("the Service to answer from its pod", answers, 60)


def test_pods_reach_the_apiserver_and_nothing_else(namespace: str, smoke_image: str) -> None:
    """In-cluster clients (the chart's operator) need the kubernetes Service; the
    network rule needs pods confined to this machine: routes to the pod network,
    the Services and this node only, no default route. (Checked on the routing
    table: the test itself sends nothing off this machine.)"""
    kubectl(
        "run",
        "probe",
        "-n",
        namespace,
        f"--image={smoke_image}",
        "--image-pull-policy=Never",
        "--restart=Never",
        "--command",
        "--",
        "sh",
        "-c",
        "echo | nc -w 3 10.96.0.1 443 && echo api-ok; ip -4 route",
    )
    wait_until(
        "the probe pod to finish",
        lambda: (
            kubectl_json("get", "pod", "probe", "-n", namespace)["status"]["phase"]
            in ("Succeeded", "Failed")
        ),
        90,
    )
    out = kubectl("logs", "-n", namespace, "probe").stdout.splitlines()
    assert out[0] == "api-ok"
    node = kubectl_json("get", "node", NODE1)
    node_ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    destinations = {line.split()[0] for line in out[1:]}
    # Services, its own node's pods (on link), every node's pods, the machine, and the
    # link to the second node: no default route.
    assert destinations == {
        "10.96.0.0/16",
        "10.244.0.0/24",
        "10.244.0.0/16",
        node_ip,
        "10.245.0.0/30",
    }
