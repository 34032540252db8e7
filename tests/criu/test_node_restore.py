"""The node agent's path, on real processes: dump a non-root worker out of one pod,
publish it, verify it into the node cache, tamper with what was published, and
restore it into another pod from the verified copy only.

The pods are PID + mount namespaces with a PID 1 that stays (tests/criu/test_nonroot.py
builds them); CRIU runs as the node agent runs it (rekindle_node.criu_run: its own
loader, libraries and binary through /proc/self/fd, the directories too).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from rekindle_contract.manifest import MANIFEST_FORMAT, Manifest
from rekindle_dev.testenv import require
from rekindle_node import criu_run
from rekindle_store import manifest_io
from rekindle_store.node_cache import NodeCache
from rekindle_store.verified_copy import CopyError

from .criu_helpers import flavors, wait_gone
from .test_nonroot import PYTHON, UID, Pod, _status

pytestmark = pytest.mark.criu

KEY = b"n" * 32
FLAGS = ["--shell-job", "--file-locks"]


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[Pod]]:
    require("root", "unshare")
    assert os.access(PYTHON, os.X_OK), f"no {PYTHON}: apt-get install python3"
    made: list[Pod] = []
    try:
        yield made
    finally:
        for p in made:
            p.kill()


def _errors(work: Path, name: str) -> str:
    try:
        text = (work / name).read_text()
    except OSError as e:
        return str(e)
    return "\n".join(ln for ln in text.splitlines() if "Error (" in ln)


def _publish(staging: Path, published: Path) -> None:
    """Sign what was dumped (as the node agent will) and copy it to shared storage."""
    files = manifest_io.checksum_files(staging, manifest_io.list_files(staging), threads=2)
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "fingerprint": {},
        "criu": {},
        "vllm": {"root_pid": 1},
        "files": files,
    }
    manifest_io.write(staging, cast(Manifest, doc), KEY)
    shutil.copytree(staging, published)


def test_a_worker_restores_into_another_pod_from_the_verified_copy_only(
    criu_prefix: Path, tmp_path: Path, pods: list[Pod]
) -> None:
    files = criu_run.CriuFiles(criu=flavors(criu_prefix)["patched"].criu)
    for d in ("pod-a", "pod-b"):
        (tmp_path / d).mkdir()
    source = Pod(tmp_path / "pod-a")
    pods.append(source)
    worker = source.start_worker()
    worker.ask(worker.host_pid, 1)

    staging, work = tmp_path / "node" / "dump", tmp_path / "node" / "work"
    (staging / "images").mkdir(parents=True)
    work.mkdir()
    res = criu_run.dump(files, source.init, worker.ns_pid, staging / "images", work, FLAGS)
    assert res.returncode == 0, res.output + _errors(work, "dump.log")
    wait_gone(worker.host_pid)
    assert not (staging / "images" / "dump.log").exists()  # logs stay out of the images

    published = tmp_path / "pvc" / "ckpt"
    _publish(staging, published)
    cache = NodeCache(tmp_path / "node" / "cache", budget_bytes=1 << 30)
    verified = cache.get(published, KEY)
    assert verified.copied and verified.bytes > 0

    # After the check, whoever can write the shared storage rewrites every image.
    for img in (published / "images").iterdir():
        img.write_bytes(b"\0" * img.stat().st_size)
    # The tampering is real: a node that had not verified it yet refuses it now.
    with pytest.raises(CopyError, match="digest does not match") as e:
        NodeCache(tmp_path / "node" / "other-cache", budget_bytes=1 << 30).get(published, KEY)
    assert e.value.reason == "checksum_mismatch"
    assert cache.get(published, KEY).path == verified.path  # this node uses its copy

    target = Pod(tmp_path / "pod-b")
    pods.append(target)
    res = criu_run.restore(files, target.init, verified.path / "images", work, FLAGS)
    assert res.returncode == 0, res.output + _errors(work, "restore.log")
    restored = target.child(worker.ns_pid)
    after = _status(restored)
    assert after["Uid"].split() == [str(UID)] * 4, after["Uid"]
    assert int(after["PPid"]) == target.init  # in the other pod, under its PID 1
    worker.ask(restored, 2)  # same token, the counter went on: the verified bytes ran


# A cuda-checkpoint stand-in whose state travels with the process: it keys each process
# by its pid in its own (the pod's) namespace, which CRIU restores unchanged, so it
# answers for the process itself, wherever the node agent's host pid points.
FAKE_CUDA = r"""#!PYTHON
import os, sys
a = sys.argv[1:]
pid = a[a.index("--pid") + 1]
status = open(f"/proc/{pid}/status").read()
key = [ln.split()[-1] for ln in status.splitlines() if ln.startswith("NSpid:")][0]
path = os.path.join(os.environ["FAKE_CUDA_STATE"], key)
with open(os.environ["FAKE_CUDA_LOG"], "a") as f:
    f.write(" ".join(a) + f" (pod pid {key})\n")
state = open(path).read() if os.path.exists(path) else "running"
if a[0] == "--get-state":
    print(state); sys.exit(0)
action = a[a.index("--action") + 1]
moves = {("lock", "running"): "locked", ("checkpoint", "locked"): "checkpointed",
         ("restore", "checkpointed"): "locked", ("unlock", "locked"): "running"}
if (action, state) not in moves:
    print(f"cannot {action} a {state} process", file=sys.stderr); sys.exit(1)
open(path, "w").write(moves[(action, state)])
"""


def test_a_gpu_worker_is_checkpointed_by_host_pid_and_resumed_in_the_other_pod(
    criu_prefix: Path, tmp_path: Path, pods: list[Pod], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node agent's GPU sequence (rekindle_node.cuda) around a real dump and a restore
    into another pod: the process is named by its pod pid in between, and found again by
    its new host pid after the restore."""
    import sys

    from rekindle_node import cuda

    state, log = tmp_path / "cuda-state", tmp_path / "cuda.log"
    state.mkdir()
    binary = tmp_path / "cuda-checkpoint"
    binary.write_text(FAKE_CUDA.replace("PYTHON", sys.executable, 1))
    binary.chmod(0o755)
    monkeypatch.setenv("FAKE_CUDA_STATE", str(state))
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    tool = cuda.CudaCheckpoint(binary, timeout=30)

    files = criu_run.CriuFiles(criu=flavors(criu_prefix)["patched"].criu)
    for d in ("pod-a", "pod-b"):
        (tmp_path / d).mkdir()
    source = Pod(tmp_path / "pod-a")
    pods.append(source)
    worker = source.start_worker()
    worker.ask(worker.host_pid, 1)

    tree = cuda.gpu_tree(source.init, worker.ns_pid, uses={worker.host_pid}.__contains__)
    assert tree == {worker.ns_pid: worker.host_pid}
    cuda.checkpoint(tool, list(tree.values()))
    assert tool.state(worker.host_pid) == "checkpointed"

    images, work = tmp_path / "node" / "images", tmp_path / "node" / "work"
    images.mkdir(parents=True)
    work.mkdir()
    res = criu_run.dump(files, source.init, worker.ns_pid, images, work, FLAGS)
    assert res.returncode == 0, res.output + _errors(work, "dump.log")
    wait_gone(worker.host_pid)

    target = Pod(tmp_path / "pod-b")
    pods.append(target)
    res = criu_run.restore(files, target.init, images, work, FLAGS)
    assert res.returncode == 0, res.output + _errors(work, "restore.log")
    restored = cuda.translate(list(tree), target.init)
    assert restored == [target.child(worker.ns_pid)] and restored != [worker.host_pid]
    assert tool.state(restored[0]) == "checkpointed"  # CRIU brought the CPU side only
    cuda.resume(tool, restored, "GPU-old=GPU-new")
    assert tool.state(restored[0]) == "running"
    assert f"--action restore --pid {restored[0]} --device-map GPU-old=GPU-new" in log.read_text()
    worker.ask(restored[0], 2)  # it serves on
