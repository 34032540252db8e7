"""What the node agent does for a pod: dump its tree, restore a tree into it, report.

Every operation acts on the caller's own pod, found from the caller (its pid
namespace's PID 1), never from the request. A dump is written by the node
agent into its own root-only staging directory, hashed as it lands and
signed with the node's key; it enters the node cache as it is. A restore reads
only a cache entry, and only into a pod of the namespace the checkpoint was
made in (the signed manifest says which).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from rekindle_contract.manifest import IMAGES_SUBDIR, MANIFEST_FORMAT, Manifest
from rekindle_store import manifest_io
from rekindle_store.node_cache import NodeCache

from rekindle_node import criu_run, identity
from rekindle_node.pod_resources import PodResourcesClient, PodResourcesError
from rekindle_node.requests import Caller, OperationError, Refused, Request

# CRIU's flags for a serving tree: a session of its own, established TCP connections
# (the API server's clients), external unix sockets, deleted-but-open files, file
# locks. No network lock: CRIU's default (iptables) would run `iptables-restore` found
# in the pod's filesystem, as root; the in-pod agent has drained and refuses traffic
# while a checkpoint runs, so nothing reaches the tree's sockets.
DUMP_FLAGS = (
    "--shell-job",
    "--tcp-established",
    "--ext-unix-sk",
    "--link-remap",
    "--file-locks",
    "--network-lock",
    "skip",
)
# A restore goes into the pod's own cgroups, which CRIU joins before it starts
# (criu_run.join_cgroups): the cgroups recorded at dump time were another pod's.
RESTORE_FLAGS = (*DUMP_FLAGS, "--manage-cgroups=ignore")


@dataclass(frozen=True)
class NodeSettings:
    criu: criu_run.CriuFiles
    work: Path  # CRIU's logs, per operation
    node: str  # this node's name, recorded in what it dumps
    cgroup_root: Path = criu_run.CGROUP_ROOT  # the node's cgroupfs, as the node agent sees it
    timeout: float = 600.0


class Operations:
    """The handlers of the request socket (requests.RequestServer)."""

    def __init__(
        self,
        settings: NodeSettings,
        cache: NodeCache,
        key: bytes,
        pod_resources: PodResourcesClient | None = None,
    ) -> None:
        self.settings = settings
        self.cache = cache
        self.key = key
        self.pod_resources = pod_resources
        settings.work.mkdir(mode=0o700, parents=True, exist_ok=True)

    def handlers(self) -> dict[str, Any]:
        return {
            "dump": self.dump,
            "restore": self.restore,
            "status": self.status,
            "devices": self.devices,
        }

    def dump(self, caller: Caller, req: Request) -> dict[str, Any]:
        """Dump the tree rooted at args.pid (its pid in the caller's pod) into the cache."""
        pid = _int_arg(req, "pid")
        pod_init = identity.namespace_init(caller.pid)
        t0 = time.monotonic()
        stage = self.cache.new_staging()
        work = Path(tempfile.mkdtemp(prefix="dump.", dir=self.settings.work))
        try:
            (stage / IMAGES_SUBDIR).mkdir(mode=0o700)
            res = criu_run.dump(
                self.settings.criu,
                pod_init,
                pid,
                stage / IMAGES_SUBDIR,
                work,
                list(DUMP_FLAGS),
                timeout=self.settings.timeout,
                cgroup_root=self.settings.cgroup_root,
            )
            if res.returncode != 0:
                raise OperationError("criu_failed", _criu_failure("dump", res, work))
            t_dump = time.monotonic()
            files = manifest_io.checksum_files(stage, manifest_io.list_files(stage), threads=4)
            man = cast(
                Manifest,
                {
                    "format": MANIFEST_FORMAT,
                    "created_at": time.time(),
                    "fingerprint": _dict_arg(req, "fingerprint"),
                    "vllm": {"root_pid": pid},
                    "criu": {"dump_flags": list(DUMP_FLAGS)},
                    "files": files,
                    "identity": _identity(caller, self.settings.node),
                    "timings": {"criu_dump": t_dump - t0, "checksums": time.monotonic() - t_dump},
                },
            )
            manifest_io.write(stage, man, self.key)
            c = caller.container
            entry = self.cache.add_own(stage, f"dump of {c.namespace}/{c.pod}", self.key)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return {"checkpoint": entry.entry, "bytes": entry.bytes, "seconds": time.monotonic() - t0}

    def restore(self, caller: Caller, req: Request) -> dict[str, Any]:
        """Restore cache entry args.checkpoint into the caller's pod; its root pid there."""
        name = req.args.get("checkpoint")
        if not isinstance(name, str):
            raise ValueError("checkpoint: the name a dump answered with")
        entry = self.cache.lookup(name, self.key)
        if entry is None:
            raise OperationError("no_checkpoint", f"checkpoint {name} is not in this node's cache")
        made_in = str(entry.manifest.get("identity", {}).get("namespace", ""))
        if made_in != caller.container.namespace:
            raise Refused(
                f"checkpoint {name} was made in namespace {made_in!r}; it is restored only "
                f"into pods of that namespace, not {caller.container.namespace!r}"
            )
        pod_init = identity.namespace_init(caller.pid)
        t0 = time.monotonic()
        self.cache.pin(entry.entry, caller.container.pod_uid)
        work = Path(tempfile.mkdtemp(prefix="restore.", dir=self.settings.work))
        try:
            res = criu_run.restore(
                self.settings.criu,
                pod_init,
                entry.path / IMAGES_SUBDIR,
                work,
                list(RESTORE_FLAGS),
                timeout=self.settings.timeout,
                cgroup_root=self.settings.cgroup_root,
            )
            if res.returncode != 0:
                self.cache.unpin(entry.entry, caller.container.pod_uid)
                raise OperationError("criu_failed", _criu_failure("restore", res, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return {"pid": entry.manifest["vllm"]["root_pid"], "seconds": time.monotonic() - t0}

    def status(self, caller: Caller, req: Request) -> dict[str, Any]:
        """The node cache's entries of the caller's namespace."""
        ns = caller.container.namespace
        out = []
        for r in self.cache.report_json():
            entry = self.cache.lookup(r["entry"], self.key)
            if entry is not None and entry.manifest.get("identity", {}).get("namespace") == ns:
                out.append(r)
        return {"entries": out}

    def devices(self, caller: Caller, req: Request) -> dict[str, Any]:
        """The caller's own container's devices, as the kubelet allocated them.

        What a pod's environment says (NVIDIA_VISIBLE_DEVICES is `all` under CDI
        injection) is never read: the kubelet's PodResources API is the record.
        """
        if self.pod_resources is None:
            raise OperationError(
                "unsupported",
                "this node agent has no kubelet PodResources socket (--pod-resources-socket)",
            )
        c = caller.container
        try:
            pod = self.pod_resources.get(c.namespace, c.pod)
        except PodResourcesError as e:
            raise OperationError("kubelet_error", str(e)) from e
        mine = [x for x in pod.containers if x.container == c.container]
        return {
            "container": c.container,
            "gpus": list(mine[0].gpus) if mine else [],
            "devices": [
                {"resource": d.resource, "ids": list(d.ids)} for x in mine for d in x.devices
            ],
        }


def _identity(caller: Caller, node: str) -> dict[str, str]:
    c = caller.container
    return {"namespace": c.namespace, "pod": c.pod, "pod_uid": c.pod_uid, "node": node}


def _int_arg(req: Request, name: str) -> int:
    value = req.args.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ValueError(f"{name}: the pid (in the pod) of the tree's root, an integer > 1")
    return value


def _dict_arg(req: Request, name: str) -> dict[str, Any]:
    value = req.args.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not a JSON object")
    return value


def _criu_failure(what: str, res: criu_run.CriuResult, work: Path) -> str:
    log = work / f"{what}.log"
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "Error (" in ln]
    except OSError:
        lines = res.output.splitlines()[-10:]
    return f"criu {what} exited {res.returncode}: " + " | ".join(lines[-5:])[:1500]
