"""The node agent's caller identity against the local cluster's real containerd:
a container's process maps to its pod through its cgroup and the runtime's record."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from rekindle_node import identity
from rekindle_node.identity import IdentityError

from tests.cluster.cluster_tools import kubectl, kubectl_json

pytestmark = pytest.mark.cluster

# scripts/local-cluster runs containerd with its state under /run/rekindle-cluster.
BUNDLES = Path("/run/rekindle-cluster/containerd/state/io.containerd.runtime.v2.task/k8s.io")
PAUSE_IMAGE = "rekindle.local/pause:1"


def test_a_containers_process_is_identified_as_its_pod(namespace: str) -> None:
    pod = textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata: {{name: caller}}
        spec:
          terminationGracePeriodSeconds: 0
          containers:
          - {{name: main, image: {PAUSE_IMAGE}, imagePullPolicy: Never}}
        """)
    kubectl("apply", "-n", namespace, "-f", "-", input=pod)
    try:
        kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/caller", "--timeout=120s")
        doc = kubectl_json("get", "-n", namespace, "pod/caller")
        cid = doc["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
        pid = int((BUNDLES / cid / "init.pid").read_text())

        got = identity.identify(pid, bundles=BUNDLES)
        assert got == identity.PodContainer(
            container_id=cid,
            container="main",
            namespace=namespace,
            pod="caller",
            pod_uid=doc["metadata"]["uid"],
        )
        # The container's PID 1 is its own namespace's init.
        assert identity.namespace_init(pid) == pid
    finally:
        kubectl("delete", "-n", namespace, "pod/caller", "--wait=false", check=False)
    # A process of the node itself (this test) is no pod's.
    with pytest.raises(IdentityError, match="in no container's cgroup"):
        identity.identify(os.getpid(), bundles=BUNDLES)
