"""The node agent's PodResources client against the local cluster's real kubelet."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from rekindle_node.pod_resources import PodNotFoundError, PodResourcesClient

from tests.cluster.cluster_tools import kubectl, wait_until

pytestmark = pytest.mark.cluster

# scripts/local-cluster's run directory, where it keeps the pid of each component.
KUBELET_PID = Path("/run/rekindle-cluster/pids/kubelet.pid")
# The sandbox image scripts/local-cluster builds into the node: it runs /pause forever.
PAUSE_IMAGE = "rekindle.local/pause:1"


def kubelet_socket() -> str:
    """<root dir>/pod-resources/kubelet.sock of the running kubelet: scripts/local-cluster
    starts it with --root-dir under its state directory, not /var/lib/kubelet."""
    pid = KUBELET_PID.read_text().strip()
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    root = args[args.index("--root-dir") + 1]
    return str(Path(root) / "pod-resources" / "kubelet.sock")


def test_get_and_list_find_a_running_pod_with_no_gpus(namespace: str) -> None:
    pod = textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata: {{name: idle}}
        spec:
          terminationGracePeriodSeconds: 0
          containers:
          - {{name: main, image: {PAUSE_IMAGE}, imagePullPolicy: Never}}
        """)
    kubectl("apply", "-n", namespace, "-f", "-", input=pod)
    client = PodResourcesClient(kubelet_socket())
    try:
        kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/idle", "--timeout=120s")

        got = client.get(namespace, "idle")
        assert (got.namespace, got.name) == (namespace, "idle")
        assert [c.container for c in got.containers] == ["main"]
        assert got.containers[0].devices == ()
        assert got.containers[0].cdi_devices == ()
        assert got.gpus == ()

        listed = {(p.namespace, p.name): p for p in client.list()}
        assert listed[(namespace, "idle")] == got
    finally:
        kubectl("delete", "-n", namespace, "pod/idle", "--wait=true", "--timeout=60s", check=False)

    # The real kubelet's answer for a pod it no longer runs reads as "not found".
    def gone() -> bool:
        try:
            client.get(namespace, "idle")
        except PodNotFoundError:
            return True
        return False

    wait_until("the kubelet to forget the deleted pod", gone, 60)
    assert (namespace, "idle") not in {(p.namespace, p.name) for p in client.list()}
