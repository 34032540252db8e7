"""The node agent's cuda-checkpoint sequence around CRIU, with a stand-in cuda-checkpoint.

No GPU here: the stand-in keeps each process's CUDA state in a file and allows
only the transitions the real tool allows (running -> lock -> locked ->
checkpoint -> checkpointed -> restore -> locked -> unlock -> running), so the
order the node agent drives, its undo after a failure and the device map it
passes are what is checked. The processes are real (their pids are what the
tool is given); which of them "use a GPU" is chosen by the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rekindle_node import cuda
from rekindle_node.identity import PodContainer
from rekindle_node.operations import NodeSettings, Operations
from rekindle_node.requests import Caller, OperationError, Request
from rekindle_store.node_cache import NodeCache

FAKE = r"""#!/usr/bin/env python3
import os, sys
state_dir, log = os.environ["FAKE_CUDA_STATE"], os.environ["FAKE_CUDA_LOG"]
a = sys.argv[1:]
with open(log, "a") as f:
    f.write(" ".join(a) + "\n")
pid = a[a.index("--pid") + 1]
path = os.path.join(state_dir, pid)
state = open(path).read() if os.path.exists(path) else "running"
if a[0] == "--get-state":
    print(state)
    sys.exit(0)
action = a[a.index("--action") + 1]
if os.environ.get("FAKE_CUDA_FAIL") == f"{action}:{pid}":
    print(f"{action} failed", file=sys.stderr)
    sys.exit(1)
moves = {("lock", "running"): "locked", ("checkpoint", "locked"): "checkpointed",
         ("restore", "checkpointed"): "locked", ("unlock", "locked"): "running"}
if (action, state) not in moves:
    print(f"cannot {action} a {state} process", file=sys.stderr)
    sys.exit(1)
open(path, "w").write(moves[(action, state)])
"""


class Tool:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.state, self.log = tmp / "state", tmp / "calls.log"
        self.state.mkdir()
        self.proc = tmp / "no-proc"  # the fake pids have no /proc entry: no NVIDIA files
        binary = tmp / "cuda-checkpoint"
        binary.write_text(FAKE.replace("/usr/bin/env python3", sys.executable, 1))
        binary.chmod(0o755)
        monkeypatch.setenv("FAKE_CUDA_STATE", str(self.state))
        monkeypatch.setenv("FAKE_CUDA_LOG", str(self.log))
        self.tool = cuda.CudaCheckpoint(binary, timeout=30)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def states(self, pids: list[int]) -> list[str]:
        return [self.tool.state(p) for p in pids]


@pytest.fixture()
def tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tool:
    return Tool(tmp_path, monkeypatch)


@pytest.fixture()
def tree() -> Iterator[list[int]]:
    """A root with two children (real processes): [root, child, child]."""
    code = (
        "import subprocess, sys, time\n"
        "kids = [subprocess.Popen(['sleep', '60']) for _ in range(2)]\n"
        "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
        "time.sleep(60)\n"
    )
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert root.stdout is not None
    kids = [int(p) for p in root.stdout.readline().split()]
    try:
        yield [root.pid, *kids]
    finally:
        for pid in kids:
            os.kill(pid, 9)
        root.kill()
        root.wait()


def test_every_process_is_locked_before_any_is_checkpointed(tool: Tool) -> None:
    pids = [101, 102]
    cuda.checkpoint(tool.tool, pids, tool.proc)
    assert tool.calls() == [
        "--action lock --pid 101",
        "--action lock --pid 102",
        "--action checkpoint --pid 101",
        "--action checkpoint --pid 102",
    ]
    assert tool.states(pids) == ["checkpointed", "checkpointed"]


def test_a_failed_checkpoint_gives_every_process_its_gpu_back(
    tool: Tool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL", "checkpoint:102")
    with pytest.raises(cuda.CudaError, match="checkpoint --pid 102 exited 1: checkpoint failed"):
        cuda.checkpoint(tool.tool, [101, 102], tool.proc)
    assert tool.states([101, 102]) == ["running", "running"]
    assert "--action restore --pid 101" in tool.calls()  # the one already checkpointed
    assert "--action unlock --pid 102" in tool.calls()  # the one only locked


def test_an_nvidia_file_left_open_after_the_checkpoint_is_named_and_undone(
    tool: Tool, tmp_path: Path
) -> None:
    """NVML initialised and never shut down holds /dev/nvidiactl past cuda-checkpoint's
    release on some drivers: CRIU would fail on it, so it is named first."""
    proc = tmp_path / "proc"
    for pid, fds in ((101, {}), (102, {3: "/dev/nvidiactl", 4: "/tmp/x"})):
        (proc / str(pid) / "fd").mkdir(parents=True)
        for fd, target in fds.items():
            os.symlink(target, proc / str(pid) / "fd" / str(fd))
        (proc / str(pid) / "maps").write_text("")
    with pytest.raises(cuda.CudaError, match=r"pid 102 fd 3: /dev/nvidiactl \(control\)"):
        cuda.checkpoint(tool.tool, [101, 102], proc)
    assert tool.states([101, 102]) == ["running", "running"]


def test_resume_maps_the_gpus_unlocks_and_checks_each_runs(tool: Tool) -> None:
    cuda.checkpoint(tool.tool, [101, 102], tool.proc)
    cuda.resume(tool.tool, [101, 102], "GPU-a=GPU-b")
    assert tool.calls()[4:] == [
        "--action restore --pid 101 --device-map GPU-a=GPU-b",
        "--action restore --pid 102 --device-map GPU-a=GPU-b",
        "--action unlock --pid 101",
        "--action unlock --pid 102",
        "--get-state --pid 101",
        "--get-state --pid 102",
    ]
    assert tool.states([101, 102]) == ["running", "running"]


def test_a_restore_the_driver_refuses_is_an_error_naming_the_process(
    tool: Tool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda.checkpoint(tool.tool, [101], tool.proc)
    monkeypatch.setenv("FAKE_CUDA_FAIL", "restore:101")
    with pytest.raises(cuda.CudaError, match="restore --pid 101 --device-map GPU-a=GPU-b exited"):
        cuda.resume(tool.tool, [101], "GPU-a=GPU-b")


def test_the_gpu_tree_is_the_roots_descendants_that_use_a_gpu(tree: list[int]) -> None:
    root, gpu_kid, cpu_kid = tree
    outsider = os.getpid()  # in the namespace, not in the tree
    uses = {gpu_kid, outsider, root}.__contains__
    # This namespace stands for the pod (any of its processes names it; this test's
    # own, as /proc/1/ns may not be readable here): pod pid == host pid.
    got = cuda.gpu_tree(outsider, root, uses=uses)
    assert got == {root: root, gpu_kid: gpu_kid}
    assert cuda.gpu_tree(outsider, gpu_kid, uses=uses) == {gpu_kid: gpu_kid}
    assert cpu_kid not in got
    with pytest.raises(cuda.CudaError, match="not running"):
        cuda.translate([root, 4_000_000], outsider)


def test_no_device_file_means_no_gpu(tree: list[int]) -> None:
    assert not any(cuda.uses_gpu(p) for p in tree)


def test_a_node_agent_without_cuda_checkpoint_refuses_a_gpu_dump(tmp_path: Path) -> None:
    ops = Operations(
        NodeSettings(criu=None, work=tmp_path / "work", node="n"),  # type: ignore[arg-type]
        NodeCache(tmp_path / "cache", budget_bytes=1 << 20),
        b"k" * 32,
    )
    me = PodContainer("cid", "main", "ns", "pod", "uid")
    caller = Caller(pid=os.getpid(), uid=0, gid=0, container=me)
    with pytest.raises(OperationError, match="no cuda-checkpoint") as e:
        ops.dump(caller, Request("dump", "uid", {"pid": os.getpid(), "cuda": True}))
    assert e.value.reason == "unsupported"
    assert not list((tmp_path / "cache" / "staging").glob("*"))  # nothing left behind


def _gpu_entry(tmp_path: Path, ops: Operations, name: str) -> None:
    """A GPU tree's checkpoint of namespace ns in the node cache, as commit leaves one."""
    from rekindle_contract.manifest import MANIFEST_FORMAT
    from rekindle_store import manifest_io

    stage = ops.cache.new_staging()
    (stage / "images").mkdir()
    (stage / "images" / "core-1.img").write_bytes(b"core")
    files = manifest_io.checksum_files(stage, ["images/core-1.img"], threads=1)
    man = {
        "format": MANIFEST_FORMAT,
        "fingerprint": {"gpu_uuid": "GPU-a"},
        "vllm": {"root_pid": 7},
        "criu": {},
        "identity": {"namespace": "ns", "pod": "pod", "name": name},
        "cuda": {"pids": [7, 9]},
        "files": files,
    }
    manifest_io.write(stage, man, ops.key)  # type: ignore[arg-type]
    entry = ops.cache.add_own(stage, "test", ops.key)
    ops.cache.name("ns", name, entry.entry)


@pytest.mark.parametrize(
    ("with_cuda", "words"),
    [(False, "no cuda-checkpoint"), (True, "no kubelet PodResources socket")],
)
def test_a_gpu_restore_is_refused_before_criu_when_the_gpus_cannot_be_mapped(
    tmp_path: Path, tool: Tool, with_cuda: bool, words: str
) -> None:
    """Without its cuda-checkpoint, or without the kubelet's word on the caller's GPUs,
    the node agent refuses a GPU checkpoint's restore before CRIU runs (none is set up
    here: reaching it would fail otherwise)."""
    ops = Operations(
        NodeSettings(
            criu=None,  # type: ignore[arg-type]
            work=tmp_path / "work",
            node="n",
            cuda=tool.tool if with_cuda else None,
        ),
        NodeCache(tmp_path / "cache", budget_bytes=1 << 20),
        b"k" * 32,
    )
    _gpu_entry(tmp_path, ops, "/ck/gpu-1")
    me = PodContainer("cid", "main", "ns", "pod", "uid")
    caller = Caller(pid=os.getpid(), uid=0, gid=0, container=me)
    with pytest.raises(OperationError, match=words) as e:
        ops.restore(caller, Request("restore", "uid", {"name": "/ck/gpu-1"}))
    assert e.value.reason == "unsupported"
    assert tool.calls() == []
