"""Before every GPU checkpoint or restore: is CRIU's CUDA plugin really going to work?

CRIU's CUDA plugin never fails a dump on its own account: without
/proc/driver/nvidia/gpus, without `cuda-checkpoint` on CRIU's PATH, or with a
cuda-checkpoint whose help does not list `--action` (drivers before r555), it
logs a warning and turns itself off. The dump then meets the /dev/nvidia*
descriptors and fails late, after the weights were already released. So the
agent checks first, says everything that is missing, and refuses the
checkpoint while vLLM still serves (reason "unsupported"):

- the plugin file (cuda_plugin.so in --criu-plugins);
- cuda-checkpoint (--cuda-checkpoint: a path, or a name looked up on PATH),
  whose `--help` lists `--action`; its directory goes first on CRIU's PATH;
- the driver version in /proc/driver/nvidia/version, at least r555;
- /proc/driver/nvidia/gpus, with the allocated GPU(s) in it;
- the allocation: NVIDIA_VISIBLE_DEVICES (set by NVIDIA's device plugin or
  container toolkit) names GPU UUIDs, one per tensor-parallel rank, and vLLM's
  CUDA_VISIBLE_DEVICES is exactly those UUIDs. A privileged container sees
  every GPU of the node, and CUDA would otherwise number them all and take
  GPU 0, which may belong to another pod: pin_visible_devices() sets it;
- no MIG on the pod's GPUs (a MIG-... id, or GPU instances under
  /proc/driver/nvidia/capabilities/gpuN for their device minors; MIG on
  another GPU of the node does not matter)
  and no MPS (CUDA_MPS_PIPE_DIRECTORY, or the daemon's default pipe directory):
  cuda-checkpoint supports neither;
- tensor parallel 1: with TP > 1 vLLM's NCCL communicators hold state
  cuda-checkpoint does not save, and Rekindle does not tear them down and
  rebuild them around a checkpoint.

Every path is read below `root` so tests can hand in a fake /proc tree.
None of this has run on a GPU yet (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN_FILE = "cuda_plugin.so"
CUDA_CHECKPOINT = "cuda-checkpoint"
MIN_DRIVER_MAJOR = 555  # the CUDA plugin's own floor: `--action` appeared in r555
# The image's own floor, set by the image that knows its CUDA runtime (the GPU
# image's CUDA 13 needs r580); the preflight refuses below the higher of the two.
DRIVER_FLOOR_ENV = "REKINDLE_MIN_NVIDIA_DRIVER"
REQUIRED_OPTIONS = ("--action",)  # what cuda_plugin_init() looks for in `cuda-checkpoint -h`
ACTIONS = ("lock", "checkpoint", "restore", "unlock")  # what the plugin runs
MPS_PIPE_DEFAULT = "tmp/nvidia-mps"
DEVICE_LIST_ENV = "NVIDIA_VISIBLE_DEVICES"
CUDA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# Read by the patched CUDA plugin (criu-patches/0007): the restore's GPU map.
DEVICE_MAP_ENV = "CRIU_CUDA_DEVICE_MAP"

# (argv) -> (exit code, stdout+stderr); a fake in tests.
Runner = Callable[[Sequence[str]], tuple[int, str]]


def run_command(argv: Sequence[str]) -> tuple[int, str]:
    """Run argv briefly and return (exit code, output); OSError becomes code 127."""
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return res.returncode, res.stdout + res.stderr


@dataclass(frozen=True)
class GpuFacts:
    """What the preflight found; the identity parts go into the checkpoint's fingerprint."""

    driver: str | None = None
    gpu_uuids: tuple[str, ...] = ()
    cuda_checkpoint: str | None = None  # resolved path
    cuda_checkpoint_version: str | None = None
    plugin_sha256: str | None = None

    def fingerprint(self) -> dict[str, str | None]:
        return {
            "gpu_uuid": ",".join(self.gpu_uuids) or None,
            "cuda_checkpoint": self.cuda_checkpoint_version,
            "cuda_plugin": self.plugin_sha256,
        }


@dataclass
class Preflight:
    facts: GpuFacts
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def message(self) -> str:
        return "GPU checkpoint preflight failed: " + "; ".join(self.problems)


def under(root: str | Path, path: str) -> Path:
    """path (absolute, as on the node) below root."""
    return Path(root) / path.lstrip("/")


def find_cuda_checkpoint(name: str, path_env: str | None = None) -> str | None:
    """The cuda-checkpoint binary: name if it is a path, else looked up on PATH."""
    if os.sep in name:
        return name if os.access(name, os.X_OK) and os.path.isfile(name) else None
    return shutil.which(name, path=path_env)


def cuda_checkpoint_version(help_text: str, binary: str | None) -> str | None:
    """The version its help prints, else a digest of the binary (stable per build)."""
    m = re.search(r"[Vv]ersion\s+(\d+(?:\.\d+)+)", help_text)
    if m:
        return m.group(1)
    if binary:
        try:
            return "sha256:" + file_sha256(binary)[:16]
        except OSError:
            return None
    return None


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def driver_version(root: str | Path = "/") -> str | None:
    """The kernel module's version from /proc/driver/nvidia/version, e.g. '570.86.15'."""
    try:
        text = under(root, "/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else None


def node_gpus(root: str | Path = "/") -> dict[str, str]:
    """UUID -> PCI bus id of every GPU the driver lists in /proc/driver/nvidia/gpus."""
    out: dict[str, str] = {}
    gdir = under(root, "/proc/driver/nvidia/gpus")
    try:
        entries = sorted(gdir.iterdir())
    except OSError:
        return out
    for d in entries:
        try:
            info = (d / "information").read_text()
        except OSError:
            continue
        m = re.search(r"GPU UUID:\s*(\S+)", info)
        if m:
            out[m.group(1)] = d.name
    return out


def allocated_devices(env: Mapping[str, str]) -> list[str]:
    """The entries of NVIDIA_VISIBLE_DEVICES (empty when unset)."""
    raw = env.get(DEVICE_LIST_ENV, "").strip()
    return [x.strip() for x in raw.split(",") if x.strip()]


def with_allocation(env: Mapping[str, str], gpus: Sequence[str] | None) -> dict[str, str]:
    """env with DEVICE_LIST_ENV replaced by the kubelet's allocation (gpus, in its
    order), so every check and pin below reads the record instead of what the pod's
    environment claims; env unchanged when gpus is None (nobody could ask)."""
    out = dict(env)
    if gpus is not None:
        out[DEVICE_LIST_ENV] = ",".join(gpus)
    return out


def pin_visible_devices(
    env: Mapping[str, str], agent_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """vLLM's env with CUDA_VISIBLE_DEVICES set to the allocated GPUs' UUIDs.

    A privileged container sees every GPU on the node; CUDA_VISIBLE_DEVICES
    by UUID makes CUDA see only the ones the device plugin allocated (and
    the same ones after a restore). Left alone when the allocation names no
    UUIDs (the preflight says why that is not checkpointable). agent_env is where
    the allocation is read (with_allocation's; env itself when None).
    """
    out = dict(env)
    allocated = allocated_devices(env if agent_env is None else agent_env)
    uuids = [d for d in allocated if d.startswith("GPU-")]
    if uuids and len(uuids) == len(allocated):
        out[CUDA_DEVICES_ENV] = ",".join(uuids)
    return out


def device_minors(root: str | Path = "/") -> dict[str, str]:
    """GPU UUID -> its device minor, from /proc/driver/nvidia/gpus/*/information."""
    out = {}
    for info in under(root, "/proc/driver/nvidia/gpus").glob("*/information"):
        fields = {}
        with contextlib.suppress(OSError):
            for line in info.read_text().splitlines():
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip()] = value.strip()
        if fields.get("GPU UUID") and fields.get("Device Minor"):
            out[fields["GPU UUID"]] = fields["Device Minor"]
    return out


def mig_enabled(root: str | Path = "/", uuids: Sequence[str] = ()) -> bool:
    """Whether the GPUs uuids (every GPU of the node when their minors are unknown)
    have MIG GPU instances, from the driver's capability tree. Another GPU of the
    node in MIG mode does not concern this pod's checkpoint."""
    caps = under(root, "/proc/driver/nvidia/capabilities")
    minors = device_minors(root)
    if uuids and all(u in minors for u in uuids):
        return any(any(caps.glob(f"gpu{minors[u]}/mig/gi*")) for u in uuids)
    return any(caps.glob("gpu*/mig/gi*"))


def _plugin(plugins_dir: str | None, problems: list[str]) -> str | None:
    if not plugins_dir:
        problems.append(
            "no --criu-plugins: CRIU would not load its CUDA plugin and cannot dump /dev/nvidia* "
            "(the operator passes it for device gpu; the GPU image has it in "
            "/opt/criu/patched/plugins)"
        )
        return None
    path = Path(plugins_dir) / PLUGIN_FILE
    try:
        return file_sha256(path)
    except OSError as e:
        problems.append(f"the CUDA plugin {path} cannot be read ({e.strerror or e})")
        return None


def _cuda_checkpoint(name: str, run: Runner, problems: list[str]) -> tuple[str | None, str | None]:
    binary = find_cuda_checkpoint(name)
    if binary is None:
        problems.append(
            f"cuda-checkpoint {name!r} not found (set --cuda-checkpoint to its path); "
            "without it the plugin turns itself off"
        )
        return None, None
    code, text = run([binary, "--help"])
    missing = [o for o in REQUIRED_OPTIONS if o not in text]
    if missing:
        problems.append(
            f"{binary} --help (exit {code}) does not list {', '.join(missing)}: it cannot run "
            f"the plugin's {'/'.join(ACTIONS)} actions (driver r{MIN_DRIVER_MAJOR}+ needed)"
        )
    else:
        line = next(ln for ln in text.splitlines() if "--action" in ln)
        absent = [a for a in ACTIONS if not re.search(rf"\b{a}\b", line)]
        if absent:
            problems.append(
                f"{binary} --help lists --action without {', '.join(absent)} "
                f"(the plugin runs {', '.join(ACTIONS)})"
            )
    return binary, cuda_checkpoint_version(text, binary)


def driver_floor(agent_env: Mapping[str, str]) -> tuple[int, str]:
    """The lowest driver major version this image runs with, and who needs it."""
    image = agent_env.get(DRIVER_FLOOR_ENV, "")
    if image.isdigit() and int(image) > MIN_DRIVER_MAJOR:
        return int(image), "this image's CUDA runtime"
    return MIN_DRIVER_MAJOR, "the CUDA plugin"


def _driver(root: str | Path, agent_env: Mapping[str, str], problems: list[str]) -> str | None:
    version = driver_version(root)
    floor, who = driver_floor(agent_env)
    if version is None:
        problems.append("no NVIDIA driver: /proc/driver/nvidia/version is missing or unreadable")
    elif int(version.split(".")[0]) < floor:
        problems.append(
            f"NVIDIA driver {version} is older than r{floor}, which {who} needs: "
            "upgrade the node's driver or use an image built for this one"
        )
    return version


def _allocation(
    agent_env: Mapping[str, str],
    vllm_env: Mapping[str, str],
    gpus: dict[str, str],
    tp: int,
    root: str | Path,
    problems: list[str],
) -> tuple[str, ...]:
    devices = allocated_devices(agent_env)
    raw = agent_env.get(DEVICE_LIST_ENV)
    if not devices or devices[0] in ("all", "none", "void"):
        problems.append(
            f"{DEVICE_LIST_ENV} is {raw!r}: request the GPU through the device plugin "
            "(resources nvidia.com/gpu) so the pod knows which GPU is its own"
        )
        return ()
    if any(d.startswith("MIG-") or ":" in d for d in devices) or mig_enabled(root, devices):
        problems.append("MIG is in use on this pod's GPU: cuda-checkpoint does not support MIG")
    bad = [d for d in devices if not d.startswith(("GPU-", "MIG-"))]
    if bad:
        problems.append(
            f"{DEVICE_LIST_ENV} names GPUs by index ({','.join(bad)}), not by UUID: set the "
            "device plugin's DEVICE_ID_STRATEGY to uuid"
        )
    if len(devices) != tp:
        problems.append(
            f"{len(devices)} GPU(s) allocated ({','.join(devices)}) for tensor parallel {tp}: "
            "exactly one per rank must be visible"
        )
    if gpus:
        unknown = [d for d in devices if d.startswith("GPU-") and d not in gpus]
        if unknown:
            problems.append(
                f"allocated GPU(s) {','.join(unknown)} not in /proc/driver/nvidia/gpus "
                f"(the driver lists {','.join(sorted(gpus))})"
            )
    want = ",".join(devices)
    have = vllm_env.get(CUDA_DEVICES_ENV)
    if have != want:
        problems.append(
            f"vLLM's {CUDA_DEVICES_ENV} is {have!r}, not the allocated {want!r}: a privileged "
            "pod sees every GPU, so vLLM must be pinned to its own by UUID"
        )
    return tuple(devices)


def _mps(vllm_env: Mapping[str, str], root: str | Path, problems: list[str]) -> None:
    if vllm_env.get("CUDA_MPS_PIPE_DIRECTORY") or under(root, MPS_PIPE_DEFAULT).exists():
        problems.append(
            "CUDA MPS is in use (pipe directory found): cuda-checkpoint does not support MPS"
        )


def check(
    plugins_dir: str | None,
    cuda_checkpoint: str,
    agent_env: Mapping[str, str],
    vllm_env: Mapping[str, str],
    tensor_parallel_size: int,
    root: str | Path = "/",
    run: Runner = run_command,
) -> Preflight:
    """Every check above; .problems lists each one that fails, with what to change."""
    problems: list[str] = []
    plugin_sha = _plugin(plugins_dir, problems)
    binary, version = _cuda_checkpoint(cuda_checkpoint, run, problems)
    driver = _driver(root, agent_env, problems)
    if not under(root, "/proc/driver/nvidia/gpus").is_dir():
        problems.append("/proc/driver/nvidia/gpus is missing: the plugin would turn itself off")
    gpus = node_gpus(root)
    uuids = _allocation(agent_env, vllm_env, gpus, tensor_parallel_size, root, problems)
    _mps(vllm_env, root, problems)
    if tensor_parallel_size != 1:
        problems.append(
            f"tensor parallel {tensor_parallel_size}: NCCL communicators are not saved by "
            "cuda-checkpoint and Rekindle does not rebuild them yet; GPU checkpoints need TP 1"
        )
    facts = GpuFacts(driver, uuids, binary, version, plugin_sha)
    return Preflight(facts, problems)


def criu_env_argv(
    argv: list[str], cuda_checkpoint: str | None, base_path: str | None, gpu_map: str = ""
) -> list[str]:
    """argv run through env(1) with cuda-checkpoint's directory first on PATH, and the
    restore's GPU map (rekindle_contract.gpu_map) where there is one.

    CRIU's plugin runs `cuda-checkpoint` by name (execvp): the one it finds
    must be the one the preflight checked. The patched plugin (criu-patches/0007)
    passes DEVICE_MAP_ENV on to cuda-checkpoint's restore action as --device-map.
    """
    if not cuda_checkpoint:
        return argv
    first = os.path.dirname(os.path.abspath(cuda_checkpoint))
    path = f"{first}:{base_path}" if base_path else first
    extra = [f"{DEVICE_MAP_ENV}={gpu_map}"] if gpu_map else []
    return ["env", f"PATH={path}", *extra, *argv]
