"""What the node agent does for a pod: dump its tree, restore a tree into it, report.

Every operation acts on the caller's own pod, found from the caller (its pid
namespace's PID 1), never from the request. A dump (CRIU's images) and then the
caller's own files (commit: the weight dump, /dev/shm copies) are written by the
node agent into its root-only staging directory, hashed as they land, signed
with the fleet's key, and sealed into the node cache as they are. A restore
reads only a cache entry, and only into a pod of the namespace the checkpoint
was made in (the name index is per namespace; the signed identity agrees).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from rekindle_contract.gpu_map import device_map
from rekindle_contract.manifest import (
    IMAGES_SUBDIR,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
)
from rekindle_store import manifest_io, object_copy, published, verified_copy
from rekindle_store.node_cache import NodeCache, VerifiedCheckpoint
from rekindle_store.s3 import Bucket

from rekindle_node import criu_run, cuda, identity
from rekindle_node.keep_resident import NodeResidency
from rekindle_node.pod_resources import PodResourcesClient, PodResourcesError
from rekindle_node.requests import FD_KEY, Caller, OperationError, Refused, Request

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
    # The node agent's own cuda-checkpoint, for trees that use a GPU (None: refused).
    cuda: cuda.CudaCheckpoint | None = None


@dataclass(frozen=True)
class ObjectStore:
    """The fleet's object store, where proven checkpoints travel between nodes."""

    bucket: Bucket
    prefix: str = "rekindle"
    threads: int = 8  # ranged reads (and part uploads) in flight


@dataclass
class _Pending:
    """A dump waiting for its commit (one per pod)."""

    stage: Path
    pid: int
    seconds: float
    cuda_pids: tuple[int, ...] = ()  # pids in the pod that cuda-checkpoint checkpointed


class Operations:
    """The handlers of the request socket (requests.RequestServer)."""

    def __init__(
        self,
        settings: NodeSettings,
        cache: NodeCache,
        key: bytes,
        pod_resources: PodResourcesClient | None = None,
        store: ObjectStore | None = None,
        resident: NodeResidency | None = None,
    ) -> None:
        self.settings = settings
        self.resident = resident  # the node's resident budget (None: none)
        self.cache = cache
        self.key = key
        self.store = store
        self.store_threads = store.threads if store else 1
        self.pod_resources = pod_resources
        self.pending: dict[str, _Pending] = {}  # by pod UID
        self._lock = threading.Lock()
        settings.work.mkdir(mode=0o700, parents=True, exist_ok=True)

    def handlers(self) -> dict[str, Any]:
        return {
            "dump": self.dump,
            "commit": self.commit,
            "open": self.open,
            "mark_verified": self.mark_verified,
            "publish": self.publish,
            "pull": self.pull,
            "unpublish": self.unpublish,
            "evict": self.evict,
            "restore": self.restore,
            "mapped_failed": self.mapped_failed,
            "reserve_pids": self.reserve_pids,
            "status": self.status,
            "devices": self.devices,
        }

    def dump(self, caller: Caller, req: Request) -> dict[str, Any]:
        """CRIU-dump the tree rooted at args.pid (its pid in the caller's pod) into staging.

        CRIU ends the tree. The dump waits for the caller's commit, which adds the
        files the caller saved after it (the /dev/shm files, the weight dump).
        """
        pid = _int_arg(req, "pid")
        pod_init = identity.namespace_init(caller.pid)
        t0 = time.monotonic()
        want_gpu = _bool_arg(req, "cuda")
        gpu: dict[int, int] = {}  # pod pid -> host pid, of what cuda-checkpoint checkpointed
        stage = self.cache.new_staging()
        work = Path(tempfile.mkdtemp(prefix="dump.", dir=self.settings.work))
        try:
            (stage / IMAGES_SUBDIR).mkdir(mode=0o700)
            if want_gpu:
                gpu = self._checkpoint_gpu(pod_init, pid)
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
        except BaseException as e:
            shutil.rmtree(stage, ignore_errors=True)
            if gpu:
                # CRIU left the tree running: give its processes their GPUs back.
                left = cuda.undo(self._cuda(), list(gpu.values()))
                if left and isinstance(e, OperationError):
                    raise OperationError(e.reason, f"{e}; cuda-checkpoint undo: {left}") from e
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        seconds = time.monotonic() - t0
        with self._lock:
            old = self.pending.pop(caller.container.pod_uid, None)
            self.pending[caller.container.pod_uid] = _Pending(stage, pid, seconds, tuple(gpu))
        if old is not None:
            shutil.rmtree(old.stage, ignore_errors=True)
        return {"seconds": seconds, "cuda_pids": sorted(gpu)}

    def _cuda(self) -> cuda.CudaCheckpoint:
        if self.settings.cuda is None:
            raise OperationError(
                "unsupported",
                "this node agent has no cuda-checkpoint (--cuda-checkpoint): GPU trees are "
                "neither dumped nor restored here",
            )
        return self.settings.cuda

    def _checkpoint_gpu(self, pod_init: int, pid: int) -> dict[int, int]:
        """cuda-checkpoint every GPU process of the tree at pid (pod pid -> host pid);
        after it the tree holds no GPU resource and CRIU dumps it as a CPU tree."""
        tool = self._cuda()
        try:
            tree = cuda.gpu_tree(pod_init, pid)
            if not tree:
                raise cuda.CudaError(f"no process of the tree at pid {pid} uses a GPU")
            cuda.checkpoint(tool, list(tree.values()))
        except cuda.CudaError as e:
            raise OperationError("cuda_failed", str(e)) from e
        return tree

    def commit(self, caller: Caller, req: Request) -> dict[str, Any]:
        """Finish the caller's dump as checkpoint args.name: the files below args.dir (in
        the pod) and the caller's args.manifest join the images, signed by this node."""
        name = _name_arg(req)
        body = _dict_arg(req, "manifest")
        with self._lock:
            pending = self.pending.pop(caller.container.pod_uid, None)
        if pending is None:
            raise OperationError("no_dump", "no dump of this pod waits for a commit: dump first")
        t0 = time.monotonic()
        try:
            files: list[FileEntry] = []
            src = req.args.get("dir")
            if src is not None:
                files = self._take(caller, str(src), pending.stage)
            taken = {f["path"] for f in files}  # hashed as they were copied in
            images = [p for p in manifest_io.list_files(pending.stage) if p not in taken]
            files = manifest_io.checksum_files(pending.stage, images, threads=4) + files
            man = cast(
                Manifest,
                {
                    **{k: v for k, v in body.items() if k not in _NODE_KEYS},
                    "format": MANIFEST_FORMAT,
                    "files": sorted(files, key=lambda f: f["path"]),
                    "identity": {**_identity(caller, self.settings.node), "name": name},
                },
            )
            man.setdefault("fingerprint", {})
            # What dumped it: the node agent's CRIU (the agent's record names its own).
            man["criu"] = {
                "binary": str(self.settings.criu.criu),
                "dumped_by": "node agent",
                "dump_flags": list(DUMP_FLAGS),
            }
            if pending.cuda_pids:
                man["cuda"] = {"pids": list(pending.cuda_pids)}
            man.setdefault("vllm", {"root_pid": pending.pid})
            man["vllm"]["root_pid"] = pending.pid
            timings = dict(man.get("timings") or {})
            timings.update(criu_dump=pending.seconds, commit=time.monotonic() - t0)
            man["timings"] = timings
            manifest_io.write(pending.stage, man, self.key)
            os.chmod(pending.stage / MANIFEST_NAME, 0o444)
            c = caller.container
            entry = self.cache.add_own(pending.stage, f"{c.namespace}/{c.pod}: {name}", self.key)
        except BaseException:
            shutil.rmtree(pending.stage, ignore_errors=True)
            raise
        self.cache.name(caller.container.namespace, name, entry.entry)
        return {"checkpoint": entry.entry, "bytes": entry.bytes, "files": len(man["files"])}

    def _take(self, caller: Caller, src: str, stage: Path) -> list[FileEntry]:
        """Copy the caller's directory src (a path in its pod) into stage, hashing."""
        if not src.startswith("/"):
            raise ValueError("dir: an absolute path in the pod")
        src_fd = self._pod_dir(caller, src)
        try:
            taken = verified_copy.take_tree(src_fd, stage, f"pod:{src}")
        finally:
            os.close(src_fd)
        clash = [f["path"] for f in taken if f["path"].startswith(IMAGES_SUBDIR + "/")]
        if clash:
            raise ValueError(f"dir holds {clash[0]}: images/ is the node agent's")
        return taken

    def _entry(self, caller: Caller, req: Request) -> VerifiedCheckpoint:
        """The caller's namespace's checkpoint args.name, verified in this node's cache."""
        name = _name_arg(req)
        ns = caller.container.namespace
        entry = self.cache.resolve(ns, name)
        found = self.cache.lookup(entry, self.key) if entry else None
        if found is None:
            raise OperationError(
                "no_checkpoint", f"checkpoint {name} of namespace {ns} is not in this node's cache"
            )
        made_in = str(found.manifest.get("identity", {}).get("namespace", ""))
        if made_in != ns:  # the name index is per namespace; the signed identity agrees
            raise Refused(f"checkpoint {name} was made in namespace {made_in!r}, not {ns!r}")
        return found

    def open(self, caller: Caller, req: Request) -> dict[str, Any]:
        """A read-only descriptor of the checkpoint's verified directory."""
        entry = self._entry(caller, req)
        fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return {"checkpoint": entry.entry, FD_KEY: fd}

    def mark_verified(self, caller: Caller, req: Request) -> dict[str, Any]:
        entry = self._entry(caller, req)
        self.cache.mark_verified(entry.entry, _dict_arg(req, "details"), self.key)
        return {"checkpoint": entry.entry}

    def publish(self, caller: Caller, req: Request) -> dict[str, Any]:
        """Copy checkpoint args.name to args.dir in the caller's pod (its shared checkpoint
        volume): a new directory, owned by the caller's user (the pod's storage; nothing
        runs from it), the manifest signed as it is. With args.to "store": to the node
        agent's object store instead (the pod never sees its credentials).

        What is published is for transport only: it comes back into a cache (this
        node's after an eviction or a reboot, another node's) through pull.
        """
        entry = self._entry(caller, req)
        if req.args.get("to") == "store":
            loc = self._store_location(caller, req)
            sent = object_copy.publish(entry.path, loc, self.store_threads)
            return {
                "checkpoint": entry.entry,
                "bytes": sent.bytes,
                "stored": sent.stored,
                "seconds": sent.seconds,
                "where": str(loc),
            }
        parent, base = _pod_dir_arg(req)
        parent_fd = self._pod_dir(caller, parent)
        try:
            done = published.publish(
                entry.path, parent_fd, base, f"pod:{parent}", owner=(caller.uid, caller.gid)
            )
        finally:
            os.close(parent_fd)
        return {"checkpoint": entry.entry, "bytes": done.bytes, "seconds": done.seconds}

    def pull(self, caller: Caller, req: Request) -> dict[str, Any]:
        """Verify the checkpoint published at args.dir (in the caller's pod) into the cache
        under args.name (args.from "store": from the object store). The manifest must be
        signed by this node agent's key (the fleet's) and name this namespace and
        args.name (an older checkpoint, or another namespace's, is refused)."""
        name = _name_arg(req)
        if req.args.get("from") == "store":
            loc = self._store_location(caller, req)
            src = str(loc)
            entry = self.cache.get_from_store(loc, self.key, self.store_threads)
        else:
            path = req.args.get("dir")
            if not isinstance(path, str) or not path.startswith("/"):
                raise ValueError("dir: an absolute path in the pod")
            src = path
            src_fd = self._pod_dir(caller, path)
            try:
                entry = self.cache.get(src_fd, self.key, where=f"pod:{path}")
            finally:
                os.close(src_fd)
        ns = caller.container.namespace
        made = entry.manifest.get("identity", {})
        if made.get("namespace") != ns or made.get("name") != name:
            raise Refused(
                f"{src} holds checkpoint {made.get('name')!r} of namespace "
                f"{made.get('namespace')!r}, not {name!r} of {ns!r}"
            )
        self.cache.name(ns, name, entry.entry)
        return {
            "checkpoint": entry.entry,
            "bytes": entry.bytes,
            "seconds": entry.seconds,
            "copied": entry.copied,
        }

    def unpublish(self, caller: Caller, req: Request) -> dict[str, Any]:
        """Delete the caller's namespace's checkpoint args.name from the object store, and
        this node's cached copy unless a replica maps it (other nodes' copies go by their
        budget; none of them is published any more, so no new node pulls it)."""
        loc = self._store_location(caller, req)
        removed = object_copy.delete(loc)
        entry = self.cache.resolve(caller.container.namespace, _name_arg(req))
        dropped = self.cache.drop(entry) if entry else False
        return {"objects": removed, "where": str(loc), "cache_entry_removed": dropped}

    def evict(self, caller: Caller, req: Request) -> dict[str, Any]:
        """Drop this node's cached copy of the caller's namespace's checkpoint args.name,
        unless a replica maps it: what the cache's budget does to an unused entry, on
        request (a benchmark's node that must pull; an operator freeing a node's disk).
        The published copy stays."""
        entry = self.cache.resolve(caller.container.namespace, _name_arg(req))
        if entry is None:
            return {"evicted": False, "held": False, "why": "not in this node's cache"}
        holders = self.cache.pinned_by(entry)
        if holders:
            why = f"mapped by {len(holders)} replica(s) on this node"
            return {"evicted": False, "held": True, "why": why}
        dropped = self.cache.drop(entry)
        return {"evicted": dropped, "held": not dropped, "checkpoint": entry}

    def _store_location(self, caller: Caller, req: Request) -> object_copy.StoreLocation:
        """Where the caller's checkpoint args.name lives in the object store: below the
        caller's own namespace, so a pod never reaches another namespace's objects."""
        if self.store is None:
            raise OperationError(
                "no_store",
                "this node agent has no object store: set the chart's nodeAgent.objectStore",
            )
        return object_copy.StoreLocation.of(
            self.store.bucket, self.store.prefix, caller.container.namespace, _name_arg(req)
        )

    def _pod_dir(self, caller: Caller, path: str) -> int:
        """A descriptor of directory path in the caller's pod, no link followed on the way."""
        root = os.open(
            f"/proc/{identity.namespace_init(caller.pid)}/root", os.O_RDONLY | os.O_DIRECTORY
        )
        try:
            return verified_copy.open_dir_below(root, path, "pod:")
        finally:
            os.close(root)

    def restore(self, caller: Caller, req: Request) -> dict[str, Any]:
        """CRIU-restore checkpoint args.name into the caller's pod; its root pid there."""
        entry = self._entry(caller, req)
        flags = list(RESTORE_FLAGS)
        copy_why = self.cache.copy_only(entry.entry) if _bool_arg(req, "mmap") else None
        if _bool_arg(req, "mmap") and copy_why is None:
            flags.append("--mmap-restore")
            if _bool_arg(req, "mmap_heap"):
                flags.append("--mmap-restore-heap")
        if _bool_arg(req, "stopped"):
            flags.append("--leave-stopped")
        # A GPU tree: its GPUs are mapped onto the caller's, refused before CRIU runs
        # when this node agent cannot or the counts differ.
        gpu_map = self._gpu_map(caller, entry) if entry.manifest.get("cuda") else None
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
                flags,
                timeout=self.settings.timeout,
                cgroup_root=self.settings.cgroup_root,
            )
            if res.returncode != 0:
                raise OperationError("criu_failed", _criu_failure("restore", res, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        gpu_seconds = None if gpu_map is None else self._resume_gpu(entry, pod_init, gpu_map)
        answer: dict[str, Any] = {
            "checkpoint": entry.entry,
            "pid": entry.manifest["vllm"]["root_pid"],
            "seconds": time.monotonic() - t0,
        }
        if copy_why is not None:
            answer["copied"] = f"the node agent copies this checkpoint's memory: {copy_why}"
        if gpu_seconds is not None:
            answer["cuda_seconds"] = gpu_seconds
        return answer

    def _gpu_map(self, caller: Caller, entry: VerifiedCheckpoint) -> str:
        """The checkpoint's GPUs onto the ones the kubelet allocated to the caller."""
        self._cuda()
        saved = (entry.manifest.get("fingerprint") or {}).get("gpu_uuid")
        try:
            return device_map(saved, self.devices(caller, Request("devices", "", {}))["gpus"])
        except ValueError as e:
            raise OperationError("fingerprint_mismatch", str(e)) from e

    def _resume_gpu(self, entry: VerifiedCheckpoint, pod_init: int, gpu_map: str) -> float:
        """Give the restored tree its GPU state back, on the caller's GPUs (gpu_map); a
        tree that does not come back running is killed (it cannot serve) and the restore
        fails (the pod's agent then boots)."""
        tool = self._cuda()
        t0 = time.monotonic()
        pod_pids = [int(p) for p in entry.manifest["cuda"].get("pids") or []]
        restored: list[int] = []
        try:
            restored = cuda.translate(pod_pids, pod_init)
            cuda.resume(tool, restored, gpu_map)
        except cuda.CudaError as e:
            root = entry.manifest["vllm"]["root_pid"]
            with contextlib.suppress(cuda.CudaError):
                restored = cuda.translate([root, *pod_pids], pod_init)
            cuda.kill(restored)
            raise OperationError("cuda_failed", f"GPU state not restored (tree killed): {e}") from e
        return time.monotonic() - t0

    def mapped_failed(self, caller: Caller, req: Request) -> dict[str, Any]:
        """A tree of the caller's restored from args.name with mapped memory died of
        SIGBUS: restore that checkpoint by copying from now on (mapped memory has one
        hazard by nature: a range grown past a mapped run)."""
        entry = self._entry(caller, req)
        why = req.args.get("why")
        if not isinstance(why, str):
            raise ValueError("why: what happened, in words")
        c = caller.container
        self.cache.set_copy_only(
            entry.entry, f"a replica ({c.namespace}/{c.pod}) died after a mapped restore: {why}"
        )
        return {"checkpoint": entry.entry, "copy_only": True}

    def reserve_pids(self, caller: Caller, req: Request) -> dict[str, Any]:
        """Move the pod's next pid to args.floor (writing ns_last_pid needs a capability
        the pod does not have): vLLM, started next, gets pids its helpers never take, so
        a restore in a new pod finds them free."""
        floor = req.args.get("floor")
        if not isinstance(floor, int) or isinstance(floor, bool) or not 1 < floor < 1 << 22:
            raise ValueError("floor: an integer between 2 and 4194303")
        pod_init = identity.namespace_init(caller.pid)
        script = (
            "import sys\n"
            "p = '/proc/sys/kernel/ns_last_pid'\n"
            "if int(open(p).read()) < int(sys.argv[1]):\n"
            "    open(p, 'w').write(sys.argv[1])\n"
        )
        # nsenter -p: the child runs in the pod's pid namespace (the sysctl is per
        # namespace: its writer's); no -m, so it is this node agent's own Python.
        res = subprocess.run(
            [
                "nsenter",
                "-t",
                str(pod_init),
                "-p",
                "--",
                sys.executable,
                "-I",
                "-S",
                "-c",
                script,
                str(floor),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if res.returncode != 0:
            raise OperationError("reserve_failed", res.stderr.strip()[-500:])
        return {"floor": floor}

    def status(self, caller: Caller, req: Request) -> dict[str, Any]:
        """The node cache's entries of the caller's namespace."""
        ns = caller.container.namespace
        mine = []
        for name in self.cache.names():
            entry = self.cache.lookup(name, self.key)
            if entry is not None and entry.manifest.get("identity", {}).get("namespace") == ns:
                mine.append(name)
        # Residency (mincore over every file) only for the caller's own entries.
        kept = self.resident.kept() if self.resident else set()
        return {
            "entries": [
                {**e, "kept_resident": e["entry"] in kept} for e in self.cache.report_json(mine)
            ]
        }

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


# What a caller's manifest may not set: the node agent's own record of the checkpoint.
_NODE_KEYS = frozenset({"files", "identity", "signature", "verified", "format", "cuda"})


def _name_arg(req: Request) -> str:
    name = req.args.get("name")
    if not isinstance(name, str) or not name or len(name) > 512 or "\0" in name:
        raise ValueError("name: the checkpoint's name (a non-empty string, at most 512 bytes)")
    return name


def _pod_dir_arg(req: Request) -> tuple[str, str]:
    """args.dir split into its parent and its last component."""
    path = req.args.get("dir")
    if not isinstance(path, str) or not path.startswith("/") or path.rstrip("/") == "":
        raise ValueError("dir: an absolute path in the pod, below a directory")
    parent, _, base = path.rstrip("/").rpartition("/")
    return parent or "/", base


def _bool_arg(req: Request, name: str) -> bool:
    value = req.args.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{name}: true or false")
    return value


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
