"""The GPU preflight and its wiring into a checkpoint, with /proc/driver/nvidia faked in tmp_path.

No GPU here: the node's driver files, NVIDIA_VISIBLE_DEVICES and cuda-checkpoint
are stand-ins shaped like the real ones; CRIU is replaced by a recorder, so what
is checked is what the agent would hand CRIU (-L, the PATH) and when it refuses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.checkpointing import checkpoint, criu, fingerprint, gpu_memory, gpu_preflight
from rekindle_agent.config import AgentConfig
from rekindle_agent.process_tree.reaper import Result
from rekindle_agent.supervision.vllm_process import VllmProcess
from rekindle_contract.gpu_map import device_map

UUID = "GPU-3f1c2a9e-8b7d-4e21-9c0a-5d6e7f8a9b0c"
OTHER = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
# The shape of r570's `cuda-checkpoint --help` (NVIDIA's README shows it): a version
# line, then one line per operation.
HELP = (
    "CUDA checkpoint and restore utility.\n"
    "Version 570.86.10. Copyright (C) 2025 NVIDIA Corporation. All rights reserved.\n\n"
    "Operations:\n--get-state --pid <pid>\n"
    "--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]\n"
    "--toggle --pid <pid>\n--get-restore-tid --pid <pid>\n"
)


def fake_node(root: Path, driver: str = "570.86.15", gpus: Sequence[str] = (UUID, OTHER)) -> Path:
    """A /proc/driver/nvidia tree as the open kernel module writes it."""
    nv = root / "proc/driver/nvidia"
    (nv / "gpus").mkdir(parents=True)
    (nv / "version").write_text(
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver}  Release Build\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    for i, uuid in enumerate(gpus):
        d = nv / "gpus" / f"0000:{i + 1:02x}:00.0"
        d.mkdir()
        (d / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t {uuid}\n"
            f"Device Minor: \t {i}\n"
        )
    return root


def fake_tools(tmp: Path, help_text: str = HELP) -> tuple[Path, Path]:
    """(plugin dir with cuda_plugin.so, a cuda-checkpoint that prints help_text)."""
    plugins = tmp / "plugins"
    plugins.mkdir()
    (plugins / "cuda_plugin.so").write_bytes(b"\x7fELF plugin stand-in")
    bindir = tmp / "cc-bin"
    bindir.mkdir()
    cc = bindir / "cuda-checkpoint"
    cc.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}EOF\n")
    cc.chmod(0o755)
    return plugins, cc


@pytest.fixture()
def node(tmp_path: Path) -> tuple[Path, Path, Path]:
    root = fake_node(tmp_path / "root")
    plugins, cc = fake_tools(tmp_path)
    return root, plugins, cc


def good_env() -> tuple[dict[str, str], dict[str, str]]:
    agent = {"NVIDIA_VISIBLE_DEVICES": UUID, "PATH": "/usr/bin:/bin"}
    return agent, gpu_preflight.pin_visible_devices(agent)


def run_check(node: tuple[Path, Path, Path], **change: Any) -> gpu_preflight.Preflight:
    root, plugins, cc = node
    agent, vllm = good_env()
    args: dict[str, Any] = {
        "plugins_dir": str(plugins),
        "cuda_checkpoint": str(cc),
        "agent_env": agent,
        "vllm_env": vllm,
        "tensor_parallel_size": 1,
        "root": root,
    }
    args.update(change)
    return gpu_preflight.check(**args)


def test_a_good_node_passes_and_gives_the_identity(node: tuple[Path, Path, Path]) -> None:
    pre = run_check(node)
    assert pre.ok, pre.problems
    f = pre.facts
    assert f.driver == "570.86.15"
    assert f.gpu_uuids == (UUID,)
    assert f.cuda_checkpoint_version == "570.86.10"
    assert f.plugin_sha256 == gpu_preflight.file_sha256(node[1] / "cuda_plugin.so")
    assert f.fingerprint() == {
        "gpu_uuid": UUID,
        "cuda_checkpoint": "570.86.10",
        "cuda_plugin": f.plugin_sha256,
    }


def test_mig_on_another_gpu_of_the_node_is_not_this_pods_concern(
    node: tuple[Path, Path, Path],
) -> None:
    (node[0] / "proc/driver/nvidia/capabilities/gpu1/mig/gi1").mkdir(parents=True)  # OTHER
    pre = run_check(node)
    assert pre.ok, pre.problems
    assert gpu_preflight.device_minors(node[0]) == {UUID: "0", OTHER: "1"}


def test_pinning_by_uuid() -> None:
    assert (
        gpu_preflight.pin_visible_devices({"NVIDIA_VISIBLE_DEVICES": UUID})["CUDA_VISIBLE_DEVICES"]
        == UUID
    )
    # indices or "all" are not pinned (the preflight refuses them instead)
    assert "CUDA_VISIBLE_DEVICES" not in gpu_preflight.pin_visible_devices(
        {"NVIDIA_VISIBLE_DEVICES": "all"}
    )
    assert "CUDA_VISIBLE_DEVICES" not in gpu_preflight.pin_visible_devices(
        {"NVIDIA_VISIBLE_DEVICES": "0"}
    )


def _mutate_no_gpus_dir(node: tuple[Path, Path, Path]) -> dict[str, Any]:
    import shutil

    shutil.rmtree(node[0] / "proc/driver/nvidia/gpus")
    return {}


def _mutate_mig(node: tuple[Path, Path, Path]) -> dict[str, Any]:
    (node[0] / "proc/driver/nvidia/capabilities/gpu0/mig/gi1").mkdir(parents=True)
    return {}


def _mutate_mps(node: tuple[Path, Path, Path]) -> dict[str, Any]:
    (node[0] / "tmp/nvidia-mps").mkdir(parents=True)
    return {}


def _mutate_no_plugin(node: tuple[Path, Path, Path]) -> dict[str, Any]:
    (node[1] / "cuda_plugin.so").unlink()
    return {}


def _mutate_old_driver(node: tuple[Path, Path, Path]) -> dict[str, Any]:
    v = node[0] / "proc/driver/nvidia/version"
    v.write_text(v.read_text().replace("570.86.15", "550.54.14"))
    return {}


def _mutate_old_cuda_checkpoint(node: tuple[Path, Path, Path]) -> dict[str, Any]:
    node[2].write_text("#!/bin/sh\necho '--toggle --pid <value>'\n")
    return {}


def _mutate_no_unlock(node: tuple[Path, Path, Path]) -> dict[str, Any]:
    node[2].write_text("#!/bin/sh\necho '--action lock | checkpoint | restore --pid <pid>'\n")
    return {}


CASES: dict[str, tuple[Any, str]] = {
    "cuda-checkpoint without unlock": (_mutate_no_unlock, "--action without unlock"),
    "no plugin dir": (lambda n: {"plugins_dir": None}, "no --criu-plugins"),
    "plugin file missing": (_mutate_no_plugin, "cuda_plugin.so cannot be read"),
    "cuda-checkpoint missing": (
        lambda n: {"cuda_checkpoint": "cuda-checkpoint-not-installed"},
        "not found",
    ),
    "cuda-checkpoint without --action": (_mutate_old_cuda_checkpoint, "does not list --action"),
    "no driver": (lambda n: {"root": n[0] / "nowhere"}, "no NVIDIA driver"),
    "old driver": (_mutate_old_driver, "older than r555, which the CUDA plugin needs"),
    "driver older than the image's CUDA": (
        lambda n: {
            "agent_env": {"NVIDIA_VISIBLE_DEVICES": UUID, "REKINDLE_MIN_NVIDIA_DRIVER": "580"}
        },
        "570.86.15 is older than r580, which this image's CUDA runtime needs",
    ),
    "no /proc/driver/nvidia/gpus": (_mutate_no_gpus_dir, "/proc/driver/nvidia/gpus is missing"),
    "no allocation": (lambda n: {"agent_env": {}}, "request the GPU through the device plugin"),
    "every GPU": (
        lambda n: {"agent_env": {"NVIDIA_VISIBLE_DEVICES": "all"}},
        "request the GPU through the device plugin",
    ),
    "by index": (
        lambda n: {
            "agent_env": {"NVIDIA_VISIBLE_DEVICES": "0"},
            "vllm_env": {"CUDA_VISIBLE_DEVICES": "0"},
        },
        "DEVICE_ID_STRATEGY",
    ),
    "not pinned": (lambda n: {"vllm_env": {}}, "vLLM's CUDA_VISIBLE_DEVICES is None"),
    "unknown GPU": (
        lambda n: {
            "agent_env": {"NVIDIA_VISIBLE_DEVICES": "GPU-0000"},
            "vllm_env": {"CUDA_VISIBLE_DEVICES": "GPU-0000"},
        },
        "not in /proc/driver/nvidia/gpus",
    ),
    "MIG device": (
        lambda n: {
            "agent_env": {"NVIDIA_VISIBLE_DEVICES": "MIG-1234"},
            "vllm_env": {"CUDA_VISIBLE_DEVICES": "MIG-1234"},
        },
        "MIG",
    ),
    "MIG instances on the pod's GPU": (_mutate_mig, "MIG is in use on this pod's GPU"),
    "MPS env": (
        lambda n: {"vllm_env": {"CUDA_VISIBLE_DEVICES": UUID, "CUDA_MPS_PIPE_DIRECTORY": "/x"}},
        "MPS",
    ),
    "MPS daemon": (_mutate_mps, "MPS"),
    "tensor parallel 2": (lambda n: {"tensor_parallel_size": 2}, "GPU checkpoints need TP 1"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_problem_is_found_and_named(node: tuple[Path, Path, Path], case: str) -> None:
    mutate, needle = CASES[case]
    change = mutate(node)
    pre = run_check(node, **change)
    assert not pre.ok
    assert needle in pre.message(), pre.problems


def test_criu_gets_cuda_checkpoint_first_on_path() -> None:
    argv = ["criu", "dump"]
    out = gpu_preflight.criu_env_argv(argv, "/opt/nvidia/bin/cuda-checkpoint", "/usr/bin:/bin")
    assert out == ["env", "PATH=/opt/nvidia/bin:/usr/bin:/bin", "criu", "dump"]
    assert gpu_preflight.criu_env_argv(argv, None, "/usr/bin") == argv
    # env(1) really hands that PATH to the program it runs
    res = subprocess.run(
        gpu_preflight.criu_env_argv(["sh", "-c", 'echo "$PATH"'], "/x/cc", "/usr/bin:/bin"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert res.stdout.strip() == "/x:/usr/bin:/bin"


def test_device_map_pairs_the_checkpoints_gpus_with_the_pods_rank_by_rank() -> None:
    a, b, c, d = (f"GPU-{i}{i}{i}{i}0000-0000-0000-0000-000000000000" for i in range(4))
    assert device_map(f"{a},{b}", [c, d]) == f"{a}={c},{b}={d}"
    assert device_map(f"{a},{b}", [b, a]) == f"{a}={b},{b}={a}"  # order kept
    assert device_map(a, [a]) == ""  # every rank keeps its GPU: no map
    with pytest.raises(ValueError, match=r"made on 2 GPU\(s\).*this pod has 1 .*tensor parallel"):
        device_map(f"{a},{b}", [c])
    with pytest.raises(ValueError, match="this pod has 0 \\(none\\)"):
        device_map(a, [])
    with pytest.raises(ValueError, match="does not record which GPUs"):
        device_map(None, [a])


def test_the_gpu_map_reaches_criu_through_its_environment() -> None:
    out = gpu_preflight.criu_env_argv(["criu", "restore"], "/x/cc", "/bin", "GPU-a=GPU-b")
    assert out == ["env", "PATH=/x:/bin", "CRIU_CUDA_DEVICE_MAP=GPU-a=GPU-b", "criu", "restore"]
    assert "CRIU_CUDA_DEVICE_MAP" not in " ".join(
        gpu_preflight.criu_env_argv(["criu"], "/x/cc", "/bin", "")
    )


def test_fingerprint_holds_the_cuda_identity(
    node: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _root, plugins, cc = node
    facts = fingerprint.cuda_facts(str(plugins), str(cc), {"NVIDIA_VISIBLE_DEVICES": UUID})
    assert facts["gpu_uuid"] == UUID
    assert facts["cuda_checkpoint"] == "570.86.10"
    assert facts["cuda_plugin"] == gpu_preflight.file_sha256(plugins / "cuda_plugin.so")
    saved = {"cuda_plugin": facts["cuda_plugin"], "cuda_checkpoint": "570.86.10", "gpu_uuid": OTHER}
    # another GPU of the same model is fine; another plugin build is not
    assert fingerprint.mismatches(saved, facts) == []
    assert fingerprint.mismatches({**saved, "cuda_plugin": "0" * 64}, facts) != []
    assert fingerprint.mismatches({**saved, "cuda_checkpoint": "555.42.02"}, facts) != []


# -- the checkpoint flow ------------------------------------------------------------------


class RecordingReaper:
    """Stands in for the agent's reaper: records CRIU's argv, answers like a failed dump."""

    def __init__(self) -> None:
        self.argvs: list[list[str]] = []

    def run(self, argv: Sequence[str], *, timeout: float | None = None) -> Result:
        self.argvs.append(list(argv))
        return Result(1, "")


class RecordingControl:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def greedy(self, model: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
        self.calls.append("canary")
        return [{"tokens": ["x"] * max_tokens, "logprobs": [-1.0] * max_tokens} for _ in prompts]

    def dump_weights(self, d: str) -> None:
        self.calls.append("dump_weights")

    def release_weights(self) -> None:
        self.calls.append("release_weights")

    def wake(self, d: str, verify: bool = True) -> dict[str, float]:
        self.calls.append("wake")
        return {}


@pytest.fixture()
def sleeper() -> Iterator[int]:
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def fake_nvidia_smi(bindir: Path, used_mib: int | None) -> None:
    """bindir/nvidia-smi answering the memory query for UUID (None: no nvidia-smi)."""
    smi = bindir / "nvidia-smi"
    if used_mib is None:
        smi.unlink(missing_ok=True)
        return
    smi.write_text(
        '#!/bin/sh\n[ "$*" = "--query-gpu=uuid,memory.used --format=csv,noheader,nounits" ]'
        f' || exit 9\necho "{UUID}, {used_mib}"\necho "{OTHER}, 70000"\n'
    )
    smi.chmod(0o755)


def _flow(
    tmp_path: Path,
    node: tuple[Path, Path, Path],
    pid: int,
    monkeypatch: pytest.MonkeyPatch,
    agent_env: str | None,
    gpu_used_mib: int | None = 512,
) -> tuple[RecordingReaper, RecordingControl, checkpoint.CheckpointError]:
    root, plugins, cc = node
    fake_nvidia_smi(cc.parent, gpu_used_mib)
    monkeypatch.setenv("PATH", f"{cc.parent}:{os.environ['PATH']}")
    if agent_env is None:
        monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", agent_env)
    cfg = AgentConfig(
        model="/models/m",
        device="cuda",
        criu_plugins=str(plugins),
        cuda_checkpoint=str(cc),
        run_dir=str(tmp_path / "run"),
    )
    reaper = RecordingReaper()
    vllm = VllmProcess(
        ["vllm"],
        gpu_preflight.pin_visible_devices(dict(os.environ)),
        "/dev/null",
        reaper,  # type: ignore[arg-type]
    )
    vllm.root_pid = pid
    control = RecordingControl()
    info = criu.CriuInfo("/opt/criu/patched/criu", "4.2.1", True)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.checkpoint(
            tmp_path / "ck",
            vllm,
            control,  # type: ignore[arg-type]
            info,
            cfg,
            {},
            preflight_root=str(root),
        )
    return reaper, control, e.value


def test_gpu_checkpoint_hands_criu_the_plugin_and_path(
    tmp_path: Path, node: tuple[Path, Path, Path], sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reaper, control, err = _flow(tmp_path, node, sleeper, monkeypatch, UUID)
    (argv,) = reaper.argvs
    assert argv[0] == "env"
    assert argv[1].startswith(f"PATH={node[2].parent}:")
    assert argv[2:4] == ["/opt/criu/patched/criu", "dump"]
    i = argv.index("-L")
    assert argv[i + 1] == str(node[1])
    # the (recorded) dump failed: the release is undone and vLLM keeps serving
    assert control.calls == ["canary", "dump_weights", "release_weights", "wake"]
    assert err.reason == "criu_failed" and err.serving


def test_sleep_leaving_more_than_the_host_copy_budget_is_undone_before_criu(
    tmp_path: Path, node: tuple[Path, Path, Path], sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reaper, control, err = _flow(tmp_path, node, sleeper, monkeypatch, UUID, gpu_used_mib=1500)
    assert reaper.argvs == []  # CRIU never ran
    assert control.calls == ["canary", "dump_weights", "release_weights", "wake"]
    assert err.reason == "gpu_memory_left" and err.serving
    assert "left 1.46 GiB" in str(err) and "1.00 GiB" in str(err)


def test_gpu_checkpoint_without_nvidia_smi_is_refused_before_the_release(
    tmp_path: Path, node: tuple[Path, Path, Path], sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    reaper, control, err = _flow(tmp_path, node, sleeper, monkeypatch, UUID, gpu_used_mib=None)
    assert reaper.argvs == [] and control.calls == []
    assert err.reason == "unsupported" and err.serving and "nvidia-smi" in str(err)


def test_gpu_memory_is_read_per_gpu_and_summed() -> None:
    answer = f"{UUID}, 812\n{OTHER}, 3\n"
    assert gpu_memory.used_bytes([UUID], lambda argv: answer) == 812 << 20
    assert gpu_memory.used_bytes([UUID, OTHER], lambda argv: answer) == 815 << 20
    with pytest.raises(gpu_memory.Unmeasured, match="does not list GPU-ffff"):
        gpu_memory.used_bytes(["GPU-ffff"], lambda argv: answer)
    with pytest.raises(gpu_memory.Unmeasured, match="answered"):
        gpu_memory.used_bytes([UUID], lambda argv: f"{UUID}, [N/A]\n")


def test_gpu_checkpoint_refused_before_anything_is_released(
    tmp_path: Path, node: tuple[Path, Path, Path], sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reaper, control, err = _flow(tmp_path, node, sleeper, monkeypatch, None)
    assert reaper.argvs == [] and control.calls == []
    assert err.reason == "unsupported" and err.serving
    assert "NVIDIA_VISIBLE_DEVICES" in str(err)


def test_cpu_checkpoint_has_no_preflight_and_no_path(tmp_path: Path) -> None:
    cfg = AgentConfig(model="/m", device="cpu")
    assert checkpoint.gpu_checks(cfg, {}) is None
    assert criu.dump_argv("criu", 1, "/i", "/l")[0] == "criu"


def test_agent_pins_vllm_to_its_gpu_and_fingerprints_the_cuda_parts(
    tmp_path: Path,
    node: tuple[Path, Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rekindle_agent.agent import Agent

    _root, plugins, cc = node
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", UUID)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = AgentConfig(
        model=str(tmp_path),
        run_dir=str(tmp_path / "run"),
        worker_extension="none",
        device="cuda",
        criu_plugins=str(plugins),
        cuda_checkpoint=str(cc),
    )
    with caplog.at_level("WARNING", logger="rekindle.agent"):
        agent = Agent(cfg, b"t" * 24)
    try:
        assert agent.vllm.env["CUDA_VISIBLE_DEVICES"] == UUID
        fp = agent.fingerprint()
        assert fp["gpu_uuid"] == UUID and fp["cuda_checkpoint"] == "570.86.10"
        assert fp["cuda_plugin"] == gpu_preflight.file_sha256(plugins / "cuda_plugin.so")
        # this machine has no /proc/driver/nvidia: the start-up warning names it
        assert "no NVIDIA driver" in caplog.text and "refused until fixed" in caplog.text
    finally:
        agent.reaper.stop()


def test_a_cuda_state_other_than_running_is_a_failed_resume() -> None:
    """restoring/cuda_resume: what cuda-checkpoint --get-state says per process; a process
    CUDA does not know (an error) has nothing to resume."""
    from rekindle_agent.restoring import cuda_resume

    answers = {
        "10": (0, "running\n"),
        "11": (0, "checkpointed\n"),
        "12": (1, "cuda-checkpoint: get-state: CUDA_ERROR_NOT_INITIALIZED (3)"),
        "13": (0, "locked"),
    }
    seen: list[list[str]] = []

    def run(argv: Sequence[str]) -> tuple[int, str]:
        seen.append(list(argv))
        return answers[argv[-1]]

    found = cuda_resume.states("/x/cuda-checkpoint", [10, 11, 12, 13], run)
    assert found == {10: "running", 11: "checkpointed", 13: "locked"}
    assert seen[0] == ["/x/cuda-checkpoint", "--get-state", "--pid", "10"]
    assert cuda_resume.not_resumed(found) == ["pid 11 is checkpointed", "pid 13 is locked"]
    assert cuda_resume.not_resumed({10: "running"}) == []


def test_a_gpu_restore_starts_criu_before_the_weight_dump_is_checked() -> None:
    """restore.checked_before_criu: on GPU the tree runs as soon as CRIU is done, so all it
    uses is checked first, but never the weight dump (only the reload reads it, and waits
    for its check then); on CPU only what CRIU parses (the stopped tree waits for the rest)."""
    from rekindle_agent.restoring import restore

    files: list[Any] = [
        {"path": p, "size": 1}
        for p in (
            "images/core-7.img",
            "images/pages-1.img",
            "shm/psm_1",
            "weights/weights-rank0.bin",
            "weights/index-rank0.json",
        )
    ]
    gpu = restore.checked_before_criu("cuda", files)
    assert gpu == {"images/core-7.img", "images/pages-1.img", "shm/psm_1"}
    cpu = restore.checked_before_criu("cpu", files)
    assert "images/core-7.img" in cpu and "images/pages-1.img" not in cpu
    assert not any(p.startswith("weights/") for p in gpu | cpu)


def test_the_allocation_is_the_kubelets_record_not_the_environment(
    tmp_path: Path,
    node: tuple[Path, Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under CDI injection NVIDIA_VISIBLE_DEVICES is `all`: through the node agent the
    pod's GPUs come from the kubelet's PodResources answer (a real gRPC server here),
    and vLLM's pin, the fingerprint and the preflight all read that record."""
    from concurrent import futures

    import grpc  # type: ignore[import-untyped]
    from rekindle_agent.agent import Agent
    from rekindle_node import requests
    from rekindle_node.identity import PodContainer
    from rekindle_node.operations import NodeSettings, Operations
    from rekindle_node.pod_resources import PodResourcesClient
    from rekindle_node.requests import RequestServer
    from rekindle_store.node_cache import NodeCache

    from tests.unit.test_node_pod_resources import PB, Kubelet, kubelet_methods

    pod = PB["PodResources"](
        name="vllm-0",
        namespace="serving",
        containers=[
            PB["ContainerResources"](
                name="vllm",
                devices=[
                    PB["ContainerDevices"](resource_name="nvidia.com/gpu", device_ids=[OTHER])
                ],
            )
        ],
    )
    kubelet_sock = str(tmp_path / "kubelet.sock")
    kubelet = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    kubelet.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "v1.PodResourcesLister", kubelet_methods(Kubelet([pod]))
            ),
        )
    )
    kubelet.add_insecure_port("unix://" + kubelet_sock)
    kubelet.start()
    ops = Operations(
        NodeSettings(criu=None, work=tmp_path / "work", node="node-a"),  # type: ignore[arg-type]
        NodeCache(tmp_path / "cache", budget_bytes=1 << 20),
        b"k" * 32,
        pod_resources=PodResourcesClient(kubelet_sock),
    )
    me = PodContainer("cid", "vllm", "serving", "vllm-0", "uid-a")
    node_sock = tmp_path / "node.sock"
    server = RequestServer(node_sock, {"devices": ops.devices}, resolve=lambda pid: me)
    requests.serve_in_thread(server)

    _root, plugins, cc = node
    fake_nvidia_smi(cc.parent, 512)
    monkeypatch.setenv("PATH", f"{cc.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = AgentConfig(
        model=str(tmp_path),
        run_dir=str(tmp_path / "run"),
        worker_extension="none",
        device="cuda",
        criu_plugins=str(plugins),
        cuda_checkpoint=str(cc),
        node_socket=str(node_sock),
        pod_uid="uid-a",
    )
    try:
        agent = Agent(cfg, b"t" * 24)
        try:
            assert agent.gpu_env["NVIDIA_VISIBLE_DEVICES"] == OTHER
            assert agent.vllm.env["CUDA_VISIBLE_DEVICES"] == OTHER
            assert agent.fingerprint()["gpu_uuid"] == OTHER
            facts = checkpoint.gpu_checks(cfg, agent.vllm.env, str(node[0]), agent.gpu_env)
            assert facts is not None and facts.gpu_uuids == (OTHER,)
            # The environment alone says `all`: refused, naming it.
            with pytest.raises(checkpoint.CheckpointError, match="NVIDIA_VISIBLE_DEVICES is 'all'"):
                checkpoint.gpu_checks(cfg, agent.vllm.env, str(node[0]))
        finally:
            agent.reaper.stop()
    finally:
        server.shutdown()
        server.server_close()
        kubelet.stop(0)


def test_without_a_kubelet_answer_the_environment_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "PATH": "/bin"}
    assert gpu_preflight.with_allocation(env, None) == env
    assert gpu_preflight.with_allocation(env, [])["NVIDIA_VISIBLE_DEVICES"] == ""
    assert gpu_preflight.with_allocation(env, [UUID, OTHER])["NVIDIA_VISIBLE_DEVICES"] == (
        f"{UUID},{OTHER}"
    )
