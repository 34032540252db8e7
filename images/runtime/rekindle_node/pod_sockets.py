"""One request socket per serving pod, inside that pod's own volume.

A serving pod mounts an emptyDir at NODE_SOCKET_DIR (no hostPath: Pod
Security baseline allows it). The node agent finds the pod's containers in the
runtime's task directory (containerd writes a bundle per container, with its
mounts and the pod's identity), and binds a socket inside that emptyDir's
directory on the node. Only that pod sees the socket; a connection on it is
still checked: the caller must be a container of that same pod (identity from
the kernel and the runtime), so a socket passed to another pod is refused there.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rekindle_contract.pod import NODE_SOCKET_DIR, NODE_SOCKET_NAME

from rekindle_node import identity, requests
from rekindle_node.identity import IdentityError, PodContainer

log = logging.getLogger("rekindle.node.sockets")


@dataclass(frozen=True)
class _Bound:
    server: requests.RequestServer
    dir_fd: int
    pod_uid: str


@dataclass(frozen=True)
class SocketVolume:
    """A pod container that mounts the node socket's directory, and where it is on the node."""

    container: PodContainer
    host_dir: Path


class NotYet(Exception):
    """The container's record cannot be read yet (being written): look again later."""


def socket_volume(bundle: Path) -> SocketVolume | None:
    """The container's socket directory on the node, if it mounts one (None: it does not,
    or it is no pod's application container). NotYet while its record is incomplete."""
    try:
        spec = json.loads((bundle / "config.json").read_bytes())
    except (OSError, ValueError) as e:
        raise NotYet(str(e)) from e
    try:
        container = identity.pod_container(bundle.name, bundle.parent)
    except IdentityError:
        return None  # a sandbox, or not the CRI's
    for m in spec.get("mounts") or []:
        if m.get("destination") == NODE_SOCKET_DIR and m.get("source"):
            return SocketVolume(container=container, host_dir=Path(m["source"]))
    return None


class PodSockets:
    """Keeps a request server bound in every serving pod's socket volume on this node."""

    def __init__(
        self,
        tasks: Path,
        handlers: dict[str, requests.Handler],
        on_gone: Callable[[str], None] = lambda _uid: None,
        resolve: Callable[[int, Path], PodContainer] | None = None,
    ) -> None:
        self.tasks = tasks
        self.handlers = handlers
        self.on_gone = on_gone
        self.resolve = resolve or (lambda pid, tasks: identity.identify(pid, bundles=tasks))
        self.servers: dict[str, _Bound] = {}  # by container id
        self.other: set[str] = set()  # containers that mount no socket volume: read once
        self._stop = threading.Event()

    def scan(self) -> None:
        """Bind sockets for new containers, close those of containers that ended."""
        try:
            present = {p.name for p in self.tasks.iterdir() if p.is_dir()}
        except OSError as e:
            log.warning("cannot list %s: %s", self.tasks, e)
            return
        for cid in present - set(self.servers) - self.other:
            try:
                vol = socket_volume(self.tasks / cid)
            except NotYet:
                continue
            if vol is None:
                self.other.add(cid)
            else:
                self._bind(cid, vol)
        for cid in set(self.servers) - present:
            self._close(cid)
        self.other &= present

    def _bind(self, cid: str, vol: SocketVolume) -> None:
        pod_uid = vol.container.pod_uid

        def same_pod(pid: int) -> PodContainer:
            caller = self.resolve(pid, self.tasks)
            if caller.pod_uid != pod_uid:
                raise IdentityError(
                    f"pod {caller.namespace}/{caller.pod} connected through the socket of "
                    f"pod {vol.container.namespace}/{vol.container.pod}: refused"
                )
            return caller

        try:
            dir_fd = os.open(vol.host_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            log.warning("pod %s: socket directory %s: %s", vol.container.pod, vol.host_dir, e)
            return
        # Through the directory's descriptor: bound where the pod's volume is, however
        # long its path on the node (a socket path is limited to 107 bytes).
        path = Path(f"/proc/self/fd/{dir_fd}/{NODE_SOCKET_NAME}")
        try:
            path.unlink(missing_ok=True)
            server = requests.RequestServer(path, self.handlers, resolve=same_pod)
            os.chmod(path, 0o666)  # the pod's user (non-root) connects; only that pod sees it
        except OSError as e:
            os.close(dir_fd)
            log.warning("pod %s: cannot bind %s: %s", vol.container.pod, vol.host_dir, e)
            return
        requests.serve_in_thread(server)
        self.servers[cid] = _Bound(server=server, dir_fd=dir_fd, pod_uid=pod_uid)
        log.info(
            "serving pod %s/%s (container %s)",
            vol.container.namespace,
            vol.container.pod,
            vol.container.container,
        )

    def _close(self, cid: str) -> None:
        bound = self.servers.pop(cid)
        bound.server.shutdown()
        bound.server.server_close()
        os.close(bound.dir_fd)
        if not any(b.pod_uid == bound.pod_uid for b in self.servers.values()):
            self.on_gone(bound.pod_uid)

    def run(self, interval: float) -> None:
        """Scan every interval seconds until stop()."""
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(interval)

    def stop(self) -> None:
        """Make run() return (safe from a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        for cid in list(self.servers):
            self._close(cid)
