"""The node agent's caller identity: kernel credentials -> cgroup -> the runtime's record.

Peer credentials and the pid-namespace walk run on real processes; the cgroup
paths and bundle records are the formats the kubelet's cgroup drivers and
containerd write (a cluster test reads the real ones).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from rekindle_node import identity
from rekindle_node.identity import IdentityError

CID = "4f" * 32
POD_UID = "0d5a6c7e-1111-4a3b-9c2d-0123456789ab"


def test_peer_credentials_come_from_the_kernel() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        p = identity.peer(a)
    assert (p.pid, p.uid, p.gid) == (os.getpid(), os.getuid(), os.getgid())


@pytest.mark.parametrize(
    "cgroup",
    [
        # cgroup v1, cgroupfs driver (a line per hierarchy)
        f"12:memory:/kubepods/burstable/pod{POD_UID}/{CID}\n11:cpu,cpuacct:/kubepods/burstable/pod{POD_UID}/{CID}\n",
        # cgroup v2, systemd driver
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
        # no QoS cgroups (cgroupsPerQOS: false): containerd's default parent
        f"5:pids:/k8s.io/{CID}\n",
    ],
)
def test_the_container_id_is_read_from_any_cgroup_layout(tmp_path: Path, cgroup: str) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(cgroup)
    assert identity.container_id(42, proc=tmp_path) == CID


def test_a_process_outside_containers_is_refused(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text("0::/system.slice/sshd.service\n")
    with pytest.raises(IdentityError, match="in no container's cgroup"):
        identity.container_id(42, proc=tmp_path)
    with pytest.raises(IdentityError, match="cannot be read"):
        identity.container_id(43, proc=tmp_path)


def _bundle(root: Path, cid: str, **ann: str) -> None:
    (root / cid).mkdir(parents=True)
    (root / cid / "config.json").write_text(json.dumps({"annotations": ann}))


def test_the_pod_comes_from_the_runtime_record(tmp_path: Path) -> None:
    _bundle(
        tmp_path,
        CID,
        **{
            identity.A_CONTAINER_TYPE: "container",
            identity.A_CONTAINER_NAME: "vllm",
            identity.A_POD_NAMESPACE: "team-a",
            identity.A_POD_NAME: "chat-7d9f-abcde",
            identity.A_POD_UID: POD_UID,
        },
    )
    got = identity.pod_container(CID, bundles=tmp_path)
    assert got == identity.PodContainer(
        container_id=CID,
        container="vllm",
        namespace="team-a",
        pod="chat-7d9f-abcde",
        pod_uid=POD_UID,
    )


def test_a_sandbox_or_an_unknown_container_is_refused(tmp_path: Path) -> None:
    _bundle(tmp_path, CID, **{identity.A_CONTAINER_TYPE: "sandbox", identity.A_POD_UID: POD_UID})
    with pytest.raises(IdentityError, match="not a pod's application container"):
        identity.pod_container(CID, bundles=tmp_path)
    with pytest.raises(IdentityError, match="no runtime record"):
        identity.pod_container("ab" * 32, bundles=tmp_path)


def test_namespace_init_of_a_host_process_is_the_host_init() -> None:
    """In the host's pid namespace PID 1 is the machine's init (the node agent runs there)."""
    assert identity.namespace_init(os.getpid()) == 1


def test_namespace_init_of_a_process_in_a_new_pid_namespace(tmp_path: Path) -> None:
    """A 'pod': unshare's child is PID 1 of a new pid namespace, a sleeper below it."""
    proc = subprocess.Popen(
        ["unshare", "--fork", "--pid", "--kill-child", "sh", "-c", "sleep 60 & wait"],
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            init = [int(c) for c in _children(proc.pid)]
            sleepers = [s for i in init for s in _children(i)]
            if sleepers or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(init) == 1 and len(sleepers) == 1, (init, sleepers)
        assert identity.namespace_init(sleepers[0]) == init[0]
        assert identity.namespace_init(init[0]) == init[0]
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(c) for c in path.read_text().split()]
    except OSError:
        return []
