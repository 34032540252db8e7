"""`rekindle-node`: the node agent's entry point (the DaemonSet's command)."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from pathlib import Path

from rekindle_store.node_cache import NodeCache
from rekindle_store.s3 import Bucket, Credentials

from rekindle_node import criu_run
from rekindle_node.cuda import CudaCheckpoint
from rekindle_node.keep_resident import NodeResidency
from rekindle_node.operations import NodeSettings, ObjectStore, Operations
from rekindle_node.pod_resources import PodResourcesClient
from rekindle_node.pod_sockets import PodSockets

KEY_FILE = "node-signing-key"

log = logging.getLogger("rekindle.node")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rekindle-node", description=__doc__)
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/var/lib/rekindle-node"),
        help="root-only node storage: the verified cache, a node key (without "
        "--signing-key-file), CRIU's logs",
    )
    p.add_argument(
        "--cache-budget-gib",
        type=float,
        default=50.0,
        help="bytes of checkpoints the cache may hold (least recently used unpinned go first)",
    )
    p.add_argument(
        "--resident-budget-gib",
        type=float,
        default=0.0,
        help="bytes of the most recently used checkpoints kept locked in memory by vmtouch -l "
        "(0: none); charged to this process's memory cgroup",
    )
    p.add_argument(
        "--containerd-tasks",
        type=Path,
        default=Path("/run/containerd/io.containerd.runtime.v2.task/k8s.io"),
        help="containerd's task bundles of the CRI namespace: how pods are found and identified",
    )
    p.add_argument("--criu", type=Path, default=Path(os.environ.get("REKINDLE_CRIU", "criu")))
    p.add_argument(
        "--criu-plugins",
        type=Path,
        default=None,
        help="CRIU's -L; never CRIU's CUDA plugin (it would run the pod's cuda-checkpoint): "
        "GPU trees go through --cuda-checkpoint",
    )
    p.add_argument(
        "--cuda-checkpoint",
        type=Path,
        default=None,
        help="NVIDIA's cuda-checkpoint, in the node agent's filesystem: run by the node agent "
        "around CRIU for trees that use a GPU (unset: GPU trees are refused)",
    )
    p.add_argument(
        "--cgroup-root",
        type=Path,
        default=Path("/sys/fs/cgroup"),
        help="the node's cgroupfs (a hostPath mount): CRIU joins a pod's cgroups through it",
    )
    p.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=None,
        help="the kubelet's PodResources socket (<kubelet root>/pod-resources/kubelet.sock): "
        "the devices a pod was allocated",
    )
    p.add_argument(
        "--signing-key-file",
        type=Path,
        default=None,
        help="the fleet's signing key (a mounted Secret, 32+ bytes): every node agent that "
        "shares it trusts the others' checkpoints (needed with --store-endpoint); default: a "
        "key of this node alone, made once under --state-dir",
    )
    store = p.add_argument_group("object store (checkpoints shared between nodes)")
    store.add_argument("--store-endpoint", default=None, help="http(s)://HOST[:PORT] of S3")
    store.add_argument("--store-bucket", default=None)
    store.add_argument("--store-prefix", default="rekindle", help="keys start PREFIX/NAMESPACE/")
    store.add_argument("--store-region", default="us-east-1")
    store.add_argument(
        "--store-credentials",
        type=Path,
        default=None,
        help="a directory with files accessKeyID and secretAccessKey (a mounted Secret)",
    )
    store.add_argument("--store-ca-file", type=Path, default=None, help="CA bundle for https")
    store.add_argument("--store-threads", type=int, default=8, help="ranged reads in flight")
    p.add_argument("--scan-interval", type=float, default=0.1, help="seconds between pod scans")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME") or socket.gethostname())
    return p


def node_key(state: Path) -> bytes:
    """A key of this node alone (no --signing-key-file): made once, root-only, never
    leaves the node agent; no other node accepts what it signs."""
    path = state / KEY_FILE
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
    if len(key) < 32:
        raise SystemExit(f"{path}: shorter than 32 bytes; remove it to make a new key")
    return key


def fleet_key(path: Path) -> bytes:
    key = path.read_bytes().strip()
    if len(key) < 32:
        raise SystemExit(f"{path}: the signing key must be at least 32 bytes")
    return key


def object_store(args: argparse.Namespace) -> ObjectStore | None:
    """The object store the flags describe (None: none configured)."""
    if not args.store_endpoint:
        return None
    missing = [
        flag
        for flag, value in (
            ("--store-bucket", args.store_bucket),
            ("--store-credentials", args.store_credentials),
            ("--signing-key-file", args.signing_key_file),
        )
        if not value
    ]
    if missing:
        raise SystemExit(
            f"rekindle-node: --store-endpoint needs {', '.join(missing)} (a node's own key "
            "cannot sign for the others)"
        )
    try:
        creds = Credentials.from_dir(args.store_credentials)
        bucket = Bucket(
            args.store_endpoint, args.store_bucket, creds, args.store_region, args.store_ca_file
        )
    except ValueError as e:
        raise SystemExit(f"rekindle-node: {e}") from e
    return ObjectStore(bucket, args.store_prefix, max(1, args.store_threads))


def gpu_problem(plugins: Path | None, cuda_checkpoint: Path | None) -> str:
    """What is wrong with the GPU settings ("" when nothing is)."""
    if plugins is not None and (plugins / "cuda_plugin.so").exists():
        return (
            f"--criu-plugins {plugins} holds CRIU's CUDA plugin, which would run the pod's "
            "cuda-checkpoint as root: leave it out and set --cuda-checkpoint instead"
        )
    if cuda_checkpoint is not None and not os.access(cuda_checkpoint, os.X_OK):
        return f"--cuda-checkpoint {cuda_checkpoint} is not an executable file"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if os.geteuid() != 0:
        print("rekindle-node: must run as root (it runs CRIU for the node's pods)", file=sys.stderr)
        return 2
    if not args.containerd_tasks.is_dir():
        print(
            f"rekindle-node: {args.containerd_tasks} is not a directory: mount containerd's "
            "task directory (hostPath) there or set --containerd-tasks",
            file=sys.stderr,
        )
        return 2
    problem = gpu_problem(args.criu_plugins, args.cuda_checkpoint)
    if problem:
        print(f"rekindle-node: {problem}", file=sys.stderr)
        return 2
    state: Path = args.state_dir
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    cache = NodeCache(state / "cache", budget_bytes=int(args.cache_budget_gib * (1 << 30)))
    store = object_store(args)
    key = fleet_key(args.signing_key_file) if args.signing_key_file else node_key(state)
    budget = int(args.resident_budget_gib * (1 << 30))
    resident = NodeResidency(cache, budget) if budget > 0 else None
    ops = Operations(
        NodeSettings(
            criu=criu_run.CriuFiles(criu=args.criu, plugins=args.criu_plugins),
            work=state / "work",
            node=args.node_name,
            cgroup_root=args.cgroup_root,
            cuda=CudaCheckpoint(args.cuda_checkpoint) if args.cuda_checkpoint else None,
        ),
        cache,
        key,
        PodResourcesClient(str(args.pod_resources_socket)) if args.pod_resources_socket else None,
        store,
        resident,
    )
    sockets = PodSockets(args.containerd_tasks, ops.handlers(), on_gone=cache.unpin_holder)
    signal.signal(signal.SIGTERM, lambda *_: sockets.stop())
    keeper_stop = threading.Event()
    if resident is not None:
        threading.Thread(
            target=resident.run, args=(keeper_stop,), name="keep-resident", daemon=True
        ).start()
    log.info("node %s: watching %s", args.node_name, args.containerd_tasks)
    if store is not None:
        log.info("object store: %s, prefix %s", store.bucket, store.prefix)
    try:
        sockets.run(args.scan_interval)
    finally:
        keeper_stop.set()
        if resident is not None:  # its vmtouch child runs in a session of its own: kill it
            resident.lock.release()
        sockets.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
