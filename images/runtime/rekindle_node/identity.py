"""Who is calling: a pod, as the kernel and the container runtime say, never as the
caller says.

A connection on a unix socket carries its peer's credentials (SO_PEERCRED:
pid, uid, gid, set by the kernel at connect time). The pid's cgroup names its
container (the runtime puts every container in a cgroup whose last path
component holds the 64-hex container id, under every cgroup driver); the
container runtime's own record of that container (the OCI bundle's
config.json, which containerd writes and only root can change) names the pod:
namespace, name, UID and container name. Nothing the pod wrote is read.
"""

from __future__ import annotations

import json
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# containerd's task bundles for the CRI plugin's namespace (k8s.io).
BUNDLES = Path("/run/containerd/io.containerd.runtime.v2.task/k8s.io")

_CONTAINER_ID = re.compile(r"(?:^|[/-])([0-9a-f]{64})(?:\.scope)?$")
_UCRED = struct.Struct("3i")

# The annotations containerd's CRI plugin puts on every container it creates.
A_POD_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
A_POD_NAME = "io.kubernetes.cri.sandbox-name"
A_POD_UID = "io.kubernetes.cri.sandbox-uid"
A_CONTAINER_NAME = "io.kubernetes.cri.container-name"
A_CONTAINER_TYPE = "io.kubernetes.cri.container-type"


class IdentityError(PermissionError):
    """The caller is not a container of a pod this node runs."""


@dataclass(frozen=True)
class Peer:
    pid: int  # in the node agent's pid namespace (the host's: it runs with hostPID)
    uid: int
    gid: int


@dataclass(frozen=True)
class PodContainer:
    """A container of a pod on this node, from the runtime's record."""

    container_id: str
    container: str
    namespace: str
    pod: str
    pod_uid: str


def peer(conn: socket.socket) -> Peer:
    """The kernel's credentials of the process at the other end of a unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def container_id(pid: int, proc: Path = PROC) -> str:
    """The container id in pid's cgroup path (v1: any hierarchy; v2: the one line)."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError as e:
        raise IdentityError(f"process {pid}: its cgroup cannot be read ({e.strerror})") from e
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        m = _CONTAINER_ID.search(path.rstrip("/"))
        if m:
            return m.group(1)
    raise IdentityError(f"process {pid} is in no container's cgroup: not a pod's process")


def pod_container(cid: str, bundles: Path = BUNDLES) -> PodContainer:
    """The pod a container belongs to, from the runtime's bundle of that container."""
    try:
        spec = json.loads((bundles / cid / "config.json").read_bytes())
    except (OSError, ValueError) as e:
        raise IdentityError(f"container {cid[:12]}: no runtime record ({e})") from e
    ann = spec.get("annotations") or {}
    if ann.get(A_CONTAINER_TYPE) != "container" or not ann.get(A_POD_UID):
        raise IdentityError(f"container {cid[:12]} is not a pod's application container")
    return PodContainer(
        container_id=cid,
        container=str(ann.get(A_CONTAINER_NAME, "")),
        namespace=str(ann.get(A_POD_NAMESPACE, "")),
        pod=str(ann.get(A_POD_NAME, "")),
        pod_uid=str(ann[A_POD_UID]),
    )


def identify(pid: int, proc: Path = PROC, bundles: Path = BUNDLES) -> PodContainer:
    """The pod container that process pid runs in (IdentityError: none)."""
    return pod_container(container_id(pid, proc), bundles)


def namespace_init(pid: int, proc: Path = PROC) -> int:
    """The host pid of PID 1 of pid's pid namespace (the in-pod agent of a serving pod).

    /proc/PID/status's NSpid lists a process's pid in each nested namespace, the
    innermost last. Walking up the parents from pid stays inside its namespace
    until that namespace's init, the first one whose innermost pid is 1.
    """
    current = pid
    for _ in range(4096):
        try:
            status = proc_status(proc, current)
        except OSError as e:
            raise IdentityError(f"process {current}: its status cannot be read ({e})") from e
        if int(status["NSpid"].split()[-1]) == 1:
            return current
        current = int(status["PPid"])
    raise IdentityError(f"process {pid}: no PID 1 found above it")


def proc_status(proc: Path, pid: int) -> dict[str, str]:
    """/proc/PID/status as its fields (key -> value, stripped)."""
    out = {}
    for line in (proc / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out
