"""Who runs CRIU for this pod, and where its checkpoints live: one class per way.

InPod     the agent runs CRIU itself (a privileged pod); a checkpoint is a directory
          on the pod's checkpoint volume, written, signed and read by the agent.
NodeAgent the node agent runs CRIU (the pod is unprivileged); a checkpoint lives in
          the node agent's verified cache, named by the path the operator gave it,
          and (publish) is copied to that path on shared storage once proven, or
          (store) to the node agent's object store, from where a node whose cache
          lacks it pulls it back, verifying every byte.
          The agent saves what only it can (the weight dump, /dev/shm files) into a
          scratch directory, the node agent takes those in with the images and
          signs them; a restore reads the verified copy through a descriptor the
          node agent hands over, and the node agent restores the tree into this pod.

The flows (checkpoint.py, restore.py) call these methods at the steps that
differ and nothing else changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rekindle_contract import node_api
from rekindle_contract.manifest import Manifest
from rekindle_store import manifest_io

from rekindle_agent.checkpointing import criu
from rekindle_agent.process_tree.reaper import Reaper

log = logging.getLogger("rekindle.criu_backend")


class BackendError(RuntimeError):
    """CRIU (or the node agent) failed; message says why, reason in a word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# Wraps CRIU's argv (the GPU path puts cuda-checkpoint first on CRIU's PATH).
ArgvWrap = Callable[[list[str]], list[str]]


@dataclass(frozen=True)
class RestoreOptions:
    mmap: bool
    mmap_heap: bool
    stopped: bool
    plugins: str | None
    timeout: float


class CriuBackend:
    """The steps of a checkpoint and a restore that depend on who runs CRIU."""

    #: checkpoints are signed with the service's key by the agent (False: by the node)
    agent_signs = True
    #: the agent can protect checkpoint files (read-only, immutable) and mounts
    privileged = True
    #: what readable() gives was verified, every byte, into storage no tenant can write
    verified_content = False
    #: a GPU tree's CUDA state is restored and checked running by the backend itself
    #: (the node agent's cuda-checkpoint); False: CRIU's CUDA plugin did it, the agent checks
    resumes_cuda = False
    #: set by restore() when memory was copied although mapping was asked for: why
    copied: str | None = None
    #: set by readable(): seconds spent pulling the checkpoint from shared storage first
    pulled: float | None = None
    #: set by mark_verified(): where the proven checkpoint was published, in words
    published: str | None = None

    def dump(
        self,
        reaper: Reaper,
        root: int,
        images: Path,
        log_file: str,
        plugins: str | None,
        timeout: float,
        env_argv: ArgvWrap | None = None,
        cuda: bool = False,
    ) -> None:
        """Dump the tree at root into images; cuda: it uses a GPU (plugins and env_argv
        are what CRIU's CUDA plugin needs when CRIU runs in the pod)."""
        raise NotImplementedError

    def finish(self, ckpt: Path, man: Manifest, key: bytes | None) -> None:
        raise NotImplementedError

    def readable(self, ckpt: Path) -> Path:
        raise NotImplementedError

    def where(self, ckpt: str | None) -> str | None:
        """Where checkpoint ckpt's files can be read now without asking anyone (None: nowhere)."""
        raise NotImplementedError

    def restore(
        self,
        reaper: Reaper,
        ckpt: Path,
        readable: Path,
        run_dir: str,
        opts: RestoreOptions,
        env_argv: ArgvWrap | None = None,
    ) -> int:
        raise NotImplementedError

    def mark_verified(
        self, ckpt: Path, man: Manifest, details: dict[str, Any], key: bytes | None
    ) -> None:
        raise NotImplementedError

    def reserve_pids(self, floor: int) -> None:
        raise NotImplementedError

    def mapped_failed(self, ckpt: Path, why: str) -> None:
        """A tree restored from ckpt with mapped memory died of SIGBUS (why)."""
        raise NotImplementedError

    def gpu_allocation(self) -> list[str] | None:
        """This container's GPUs as the kubelet allocated them, in its order; None when
        this backend cannot ask the kubelet (the environment is all there is)."""
        return None

    def can_prewarm(self, ckpt: Path) -> bool:
        """Whether prewarm(ckpt) has somewhere to pull ckpt from."""
        return False

    def prewarm(self, ckpt: Path) -> dict[str, Any]:
        """Put ckpt into this node's verified cache ahead of a restore that needs it."""
        raise BackendError(
            "unsupported",
            "pre-warming needs storage type node with a published checkpoint "
            "(spec.coldStart.storage.node.publish)",
        )


def _log_tail(log_file: str) -> str:
    """The end of a CRIU log that says why it failed ("" if unreadable)."""
    with contextlib.suppress(OSError):
        return criu.log_tail(Path(log_file).read_text(errors="replace"))
    return ""


class InPod(CriuBackend):
    def __init__(self, binary: str) -> None:
        self.binary = binary

    def dump(
        self,
        reaper: Reaper,
        root: int,
        images: Path,
        log_file: str,
        plugins: str | None,
        timeout: float,
        env_argv: ArgvWrap | None = None,
        cuda: bool = False,
    ) -> None:
        argv = criu.dump_argv(self.binary, root, str(images), log_file, plugins=plugins)
        if env_argv is not None:
            argv = env_argv(argv)
        res = reaper.run(argv, timeout=timeout)  # TimeoutError and OSError: the caller's
        if res.returncode != 0:
            raise BackendError(
                "criu_failed", f"criu dump exited {res.returncode}:\n{_log_tail(log_file)}"
            )

    def finish(self, ckpt: Path, man: Manifest, key: bytes | None) -> None:
        manifest_io.write(ckpt, man, key)

    def readable(self, ckpt: Path) -> Path:
        return ckpt

    def where(self, ckpt: str | None) -> str | None:
        return ckpt

    def restore(
        self,
        reaper: Reaper,
        ckpt: Path,
        readable: Path,
        run_dir: str,
        opts: RestoreOptions,
        env_argv: ArgvWrap | None = None,
    ) -> int:
        pidfile = os.path.join(run_dir, "restore.pid")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)
        # Never into the checkpoint: it is shared by every pod restoring from it.
        criu_log = os.path.join(run_dir, "restore.log")
        argv = criu.restore_argv(
            self.binary,
            str(readable / "images"),
            criu_log,
            pidfile,
            mmap=opts.mmap,
            mmap_heap=opts.mmap_heap,
            plugins=opts.plugins,
            stopped=opts.stopped,
        )
        if env_argv is not None:
            argv = env_argv(argv)
        try:
            res = reaper.run(argv, timeout=opts.timeout)
        except TimeoutError as e:
            raise BackendError(
                "criu_restore_failed", f"criu restore took longer than {opts.timeout:g}s"
            ) from e
        if res.returncode != 0:
            raise BackendError(
                "criu_restore_failed",
                f"criu restore exited {res.returncode}: {res.output[-500:]}{_log_tail(criu_log)}",
            )
        return int(Path(pidfile).read_text().strip())

    def mark_verified(
        self, ckpt: Path, man: Manifest, details: dict[str, Any], key: bytes | None
    ) -> None:
        manifest_io.mark_verified(ckpt, man, details, key)

    def mapped_failed(self, ckpt: Path, why: str) -> None:
        """Nothing to record: an in-pod agent decides per restore (mmap_policy)."""

    def reserve_pids(self, floor: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            if int(Path(NS_LAST_PID).read_text()) < floor:
                Path(NS_LAST_PID).write_text(str(floor))


NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"
# How long a call waits for the node agent's socket to appear in the pod.
SOCKET_WAIT_S = 10.0


class NodeAgent(CriuBackend):
    agent_signs = False
    privileged = False
    verified_content = True
    resumes_cuda = True

    def __init__(
        self, socket: str, pod_uid: str, publish: bool = False, store: bool = False
    ) -> None:
        self.socket = socket
        self.pod_uid = pod_uid
        # publish: the checkpoint volume is shared storage; store: the node agent's
        # object store is. Proven checkpoints are published there, and one missing
        # from the node's cache is pulled back from there.
        self.publish = publish
        self.store = store
        self._open: dict[str, int] = {}  # checkpoint name -> directory descriptor

    def _call(self, op: str, args: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        self._wait_for_socket()
        try:
            answer, fd = node_api.call(self.socket, op, self.pod_uid, args, timeout=timeout)
        except node_api.NodeAgentError as e:
            raise BackendError(e.reason, f"node agent {op}: {e.message}") from e
        if fd is not None:
            answer["_fd"] = fd
        return answer

    def _wait_for_socket(self) -> None:
        """The node agent binds the socket once it has seen the container start (it scans
        every 0.1 s): at container start, wait for it a few seconds rather than fail."""
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not os.path.exists(self.socket) and time.monotonic() < deadline:
            time.sleep(0.02)

    def dump(
        self,
        reaper: Reaper,
        root: int,
        images: Path,
        log_file: str,
        plugins: str | None,
        timeout: float,
        env_argv: ArgvWrap | None = None,
        cuda: bool = False,
    ) -> None:
        # The node agent runs its own cuda-checkpoint around its CRIU (never the pod's).
        args: dict[str, Any] = {"pid": root, **({"cuda": True} if cuda else {})}
        self._call("dump", args, timeout=timeout)

    def finish(self, ckpt: Path, man: Manifest, key: bytes | None) -> None:
        """The node agent takes the scratch directory's files and the manifest in."""
        body = {k: v for k, v in man.items() if k not in ("files", "signature")}
        answer = self._call("commit", {"name": str(ckpt), "dir": str(ckpt), "manifest": body})
        log.info(
            "node agent holds %s as %s (%s files)",
            ckpt,
            answer.get("checkpoint"),
            answer.get("files"),
        )
        # The scratch copy is the node agent's now: free the pod's volume.
        shutil.rmtree(ckpt, ignore_errors=True)

    def readable(self, ckpt: Path) -> Path:
        """The verified copy, through a descriptor: /proc/<this pid>/fd/N, which vLLM's
        workers (same user) can open too, for the weight reload."""
        old = self._open.pop(str(ckpt), None)
        if old is not None:
            os.close(old)
        self.pulled = None
        try:
            answer = self._call("open", {"name": str(ckpt)}, timeout=60)
        except BackendError as e:
            if e.reason != "no_checkpoint" or not self._pullable(ckpt):
                raise
            self._pull(ckpt)
            answer = self._call("open", {"name": str(ckpt)}, timeout=60)
        fd = int(answer["_fd"])
        self._open[str(ckpt)] = fd
        return Path(f"/proc/{os.getpid()}/fd/{fd}")

    def can_prewarm(self, ckpt: Path) -> bool:
        return self._pullable(ckpt)

    def prewarm(self, ckpt: Path) -> dict[str, Any]:
        """The node agent's pull: a no-op where its cache holds ckpt already."""
        if not self._pullable(ckpt):
            return super().prewarm(ckpt)
        return self._call("pull", {"name": str(ckpt), **self._where(ckpt)})

    def _pullable(self, ckpt: Path) -> bool:
        return self.store or (self.publish and ckpt.is_dir())

    def _where(self, ckpt: Path) -> dict[str, str]:
        """Where the published copy of ckpt is, as publish and pull take it."""
        return {"to": "store", "from": "store"} if self.store else {"dir": str(ckpt)}

    def _pull(self, ckpt: Path) -> None:
        """Have the node agent verify the published copy of ckpt into its cache."""
        t0 = time.monotonic()
        answer = self._call("pull", {"name": str(ckpt), **self._where(ckpt)})
        self.pulled = time.monotonic() - t0
        log.info(
            "node agent pulled %s from %s: %s bytes verified in %.2f s",
            ckpt,
            answer.get("where") or "shared storage",
            answer.get("bytes"),
            self.pulled,
        )

    def where(self, ckpt: str | None) -> str | None:
        fd = self._open.get(ckpt or "")
        return None if fd is None else f"/proc/{os.getpid()}/fd/{fd}"

    def restore(
        self,
        reaper: Reaper,
        ckpt: Path,
        readable: Path,
        run_dir: str,
        opts: RestoreOptions,
        env_argv: ArgvWrap | None = None,
    ) -> int:
        args = {
            "name": str(ckpt),
            "mmap": opts.mmap,
            "mmap_heap": opts.mmap_heap,
            "stopped": opts.stopped,
        }
        answer = self._call("restore", args, timeout=opts.timeout)
        self.copied = str(answer["copied"]) if answer.get("copied") else None
        return int(answer["pid"])

    def mapped_failed(self, ckpt: Path, why: str) -> None:
        self._call("mapped_failed", {"name": str(ckpt), "why": why}, timeout=30)

    def mark_verified(
        self, ckpt: Path, man: Manifest, details: dict[str, Any], key: bytes | None
    ) -> None:
        self._call("mark_verified", {"name": str(ckpt), "details": details}, timeout=60)
        if self.publish or self.store:
            self.published = self._publish(ckpt)

    def _publish(self, ckpt: Path) -> str:
        """Copy the proven checkpoint to shared storage; a failure leaves it on this node
        only (it still restores here), and says so."""
        try:
            answer = self._call("publish", {"name": str(ckpt), **self._where(ckpt)})
        except BackendError as e:
            log.warning("checkpoint %s not published (only this node has it): %s", ckpt, e)
            return f"not published, only this node has it: {e}"
        where = answer.get("where") or ckpt
        stored = f", {answer['stored']} stored" if "stored" in answer else ""
        return (
            f"published to {where} ({answer.get('bytes')} bytes{stored}, "
            f"{answer.get('seconds'):.1f} s)"
        )

    def unpublish(self, ckpt: str) -> dict[str, Any]:
        """Have the node agent delete the published copy of ckpt from its object store."""
        return self._call("unpublish", {"name": ckpt}, timeout=600)

    def evict(self, ckpt: str) -> dict[str, Any]:
        """Have the node agent drop its cached copy of ckpt (unless a replica maps it)."""
        return self._call("evict", {"name": ckpt}, timeout=60)

    def gpu_allocation(self) -> list[str] | None:
        """The node agent's answer from the kubelet's PodResources API: under CDI
        injection NVIDIA_VISIBLE_DEVICES says `all`, and a tenant sets its own
        environment anyway. None (with a warning) when the node agent cannot tell."""
        try:
            answer = self._call("devices", {}, timeout=30)
        except BackendError as e:
            log.warning("the node agent cannot say which GPUs this pod has: %s", e)
            return None
        gpus = answer.get("gpus")
        if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
            log.warning("the node agent's devices answer has no list of GPUs: %r", answer)
            return None
        return list(gpus)

    def reserve_pids(self, floor: int) -> None:
        try:
            self._call("reserve_pids", {"floor": floor}, timeout=30)
        except BackendError as e:
            log.warning("could not reserve low pids for the agent: %s", e)
