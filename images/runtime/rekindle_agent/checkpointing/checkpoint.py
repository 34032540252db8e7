"""Checkpoint flow: a drained, serving vLLM -> a checkpoint directory with a manifest.

The agent has already stopped new requests and drained in-flight ones. Here:
release the weights (dumped once into the checkpoint), refuse io_uring, dump
the tree with CRIU, save the /dev/shm files and other files it holds open,
checksum everything and write the (signed) manifest. Every failure raises
CheckpointError with a reason (rekindle_contract.api.CHECKPOINT_FAILURE_REASONS)
and whether vLLM still serves: if anything fails before CRIU kills the tree,
vLLM is put back as it was (weights reloaded) and keeps serving; after that
(or when CRIU had to be killed) it does not, and the agent boots it again.
The agent removes the partial directory either way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rekindle_contract.manifest import (
    FILES_SUBDIR,
    IMAGES_SUBDIR,
    MANIFEST_FORMAT,
    SHM_SUBDIR,
    WEIGHTS_SUBDIR,
    FileEntry,
    Manifest,
)
from rekindle_contract.rpc import DUMP_WEIGHTS
from rekindle_store import manifest_io

from rekindle_agent import __version__
from rekindle_agent.checkpointing import criu, fingerprint, gpu_memory, gpu_preflight
from rekindle_agent.checkpointing.criu_backend import BackendError, CriuBackend, InPod
from rekindle_agent.config import AgentConfig
from rekindle_agent.confinement import io_uring
from rekindle_agent.mapped_files import mmap_policy
from rekindle_agent.process_tree import proctree, shm_files
from rekindle_agent.supervision import canary
from rekindle_agent.supervision.vllm_control import VllmCallError, VllmControl, missing_method
from rekindle_agent.supervision.vllm_process import VllmProcess

DUMP_LOG = "dump.log"  # CRIU's log, kept beside the images (not checksummed)


class CheckpointError(RuntimeError):
    """The checkpoint failed; .serving says whether vLLM still runs, .reason why it failed."""

    def __init__(self, message: str, serving: bool = True, reason: str = "internal") -> None:
        super().__init__(message)
        self.serving = serving
        self.reason = reason


def os_reason(e: BaseException) -> str:
    """A checkpoint failure reason for an OSError (or a message that carries one)."""
    code = getattr(e, "errno", None)
    text = str(e)
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "quota" in text:
        return "volume_full"
    if code == errno.EROFS or "Read-only file system" in text:
        return "read_only"
    return "io_error"


def check_target(directory: str, root: str | None) -> Path:
    """The requested directory: absolute, below root if one is set, new or empty.

    Resolved with realpath (symlinks followed), and it is the resolved path
    the checkpoint is written to: a symlink below the root cannot lead out.
    """
    if not directory or not os.path.isabs(directory) or "\0" in directory:
        raise ValueError(f"'dir' must be an absolute path, got {directory!r}")
    path = Path(os.path.realpath(directory))
    if root:
        r = Path(os.path.realpath(root))
        if path == r or r not in path.parents:
            raise ValueError(
                f"'dir' {directory} (resolved: {path}) must be below the checkpoint root {r}"
            )
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(
            f"{path} already exists and is not empty; checkpoints are immutable, pick a new dir"
        )
    return path


def link_remaps(dirs: set[str]) -> set[str]:
    """link_remap.* files CRIU left in dirs (hard links of deleted-but-open files)."""
    out = set()
    for d in dirs:
        with contextlib.suppress(OSError):
            for name in os.listdir(d):
                if name.startswith("link_remap."):
                    out.add(os.path.join(d, name))
    return out


def deleted_file_dirs(pids: list[int]) -> set[str]:
    dirs = set()
    for pid in pids:
        paths = proctree.mapped_paths(pid) | set(proctree.fd_targets(pid).values())
        for p in paths:
            if p.endswith(" (deleted)") and p.startswith("/"):
                dirs.add(os.path.dirname(p))
    return dirs


def run_dir_files(pids: list[int], run_dir: str, saved: set[str]) -> list[str]:
    """Regular files below run_dir that the tree maps or holds open, besides those saved
    otherwise (saved: vLLM's log, link-remaps): what vLLM, Inductor and Triton compiled
    into their caches there (vllm_launch.cache_env) and loaded. A new pod has none of
    them, so the checkpoint keeps each one and the restore puts it back, byte for byte."""
    found: set[str] = set()
    for pid in pids:
        found |= proctree.mapped_paths(pid)
        found |= set(proctree.fd_targets(pid).values())
    return sorted(
        p for p in found if p not in saved and manifest_io.below(p, run_dir) and os.path.isfile(p)
    )


def save_extra(ckpt: Path, paths: list[str], exact: bool, start: int = 0) -> list[dict[str, Any]]:
    """Copy files the tree holds open into files/ (numbered from start); their records."""
    dest = ckpt / FILES_SUBDIR
    dest.mkdir(mode=0o700, exist_ok=True)
    out = []
    for i, src in enumerate(sorted(paths), start=start):
        if not os.path.isfile(src):
            continue
        rel = f"{FILES_SUBDIR}/{i:03d}-{os.path.basename(src)}"
        shutil.copyfile(src, ckpt / rel)
        st = os.stat(src)
        out.append(
            {
                "path": src,
                "saved": rel,
                "size": st.st_size,
                "mode": st.st_mode & 0o777,
                "exact": exact,
            }
        )
    return out


def checkpoint(
    ckpt: Path,
    vllm: VllmProcess,
    control: VllmControl,
    criu_info: criu.CriuInfo,
    cfg: AgentConfig,
    fp: dict[str, Any],
    key: bytes | None = None,
    preflight_root: str = "/",
    backend: CriuBackend | None = None,
    agent_env: Mapping[str, str] | None = None,
    gpu_memory_runner: gpu_memory.Runner = gpu_memory.run_nvidia_smi,
) -> Manifest:
    """Dump the running vLLM into ckpt; returns the manifest (signed with key, not yet verified).

    fp is the fingerprint of what runs (fingerprint.collect), recorded so a
    restore can refuse an environment that differs. With device cuda the GPU
    preflight runs first (gpu_preflight; preflight_root is where it reads
    /proc, "/" but in tests; agent_env: where it reads the pod's allocation,
    os.environ when None) and its facts join the fingerprint; after the release
    the GPU memory left is measured (gpu_memory_runner runs nvidia-smi) and held
    to --gpu-host-copy-limit-mb. Raises CheckpointError.
    """
    backend = backend or InPod(criu_info.binary)
    root = vllm.root_pid
    if root is None or not proctree.alive(root):
        raise CheckpointError("vLLM is not running", serving=False)
    gpu = gpu_checks(cfg, vllm.env, preflight_root, agent_env)
    if gpu is not None:
        fp = {**fp, **gpu.fingerprint()}
    phases: dict[str, float] = {}
    t = t_start = time.monotonic()
    images = ckpt / IMAGES_SUBDIR
    weights_dir = ckpt / WEIGHTS_SUBDIR
    try:
        ckpt.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.path.realpath(ckpt) != str(ckpt):  # a symlink appeared since check_target
            raise CheckpointError(f"{ckpt} now resolves to {os.path.realpath(ckpt)}; refused")
        os.chmod(ckpt, 0o700)  # images hold process memory: secrets, prompts, keys
        images.mkdir(mode=0o700)
        weights_dir.mkdir(mode=0o700)
    except OSError as e:
        raise CheckpointError(f"cannot create {ckpt}: {e}", reason=os_reason(e)) from e

    try:  # what every restore from it must answer the same (canary.py)
        recorded = canary.record(control, cfg.served_name)
    except VllmCallError as e:
        raise CheckpointError(
            f"the canary completion failed before anything was touched: {e}",
            reason="canary_failed",
        ) from e
    t = _mark(phases, "canary", t)

    weights, release_phases = _release(control, weights_dir)
    phases.update(release_phases)
    if gpu is not None and weights["released"]:
        weights["gpu_memory_after_release_bytes"] = _gpu_memory_left(
            cfg, gpu, control, weights_dir, gpu_memory_runner
        )
    t = _mark(phases, "release_total", t)

    try:
        pids = proctree.tree(root)
        found = io_uring.find(pids)
        if found:
            raise CheckpointError(io_uring.error_message(found), reason="io_uring")
        shm_names = shm_files.tree_shm_files(pids)
        mmap_facts = mmap_policy.tree_facts(pids)
        # Before CRIU, which kills the tree: its maps say what it uses.
        used = run_dir_files(pids, cfg.run_dir, {vllm.log_path})
        remap_dirs = {shm_files.SHM, *deleted_file_dirs(pids)}
        before = link_remaps(remap_dirs)
    except Exception as e:
        serving = not weights["released"] or _undo_release(control, weights_dir)
        if isinstance(e, CheckpointError):
            e.serving = serving
            raise
        raise CheckpointError(f"inspecting vLLM's tree failed: {e!r}", serving=serving) from e
    t = _mark(phases, "inspect", t)

    log = str(ckpt / DUMP_LOG)
    env_argv = None
    if gpu is not None:
        cuda = gpu.cuda_checkpoint
        env_argv = lambda a: gpu_preflight.criu_env_argv(a, cuda, os.environ.get("PATH"))  # noqa: E731
    try:
        backend.dump(
            vllm.reaper,
            root,
            images,
            log,
            cfg.criu_plugins,
            cfg.dump_timeout,
            env_argv,
            cuda=gpu is not None,
        )
    except TimeoutError as e:
        # Killed mid-dump, CRIU may leave the tree frozen or with its parasite
        # code inside: it cannot be trusted to serve again. The agent kills it
        # and boots vLLM.
        raise CheckpointError(
            f"criu dump took longer than --dump-timeout {cfg.dump_timeout:g}s and was killed; "
            "vLLM's tree is not trusted after that and is booted again",
            serving=False,
            reason="criu_timeout",
        ) from e
    except OSError as e:
        serving = not weights["released"] or _undo_release(control, weights_dir)
        raise CheckpointError(f"cannot run criu: {e}", serving=serving, reason=os_reason(e)) from e
    except BackendError as e:
        serving = proctree.alive(root)
        if serving and weights["released"]:
            serving = _undo_release(control, weights_dir)
        reason = os_reason(OSError(str(e)))
        if reason == "io_error":
            reason = "criu_failed"
        raise CheckpointError(str(e), serving=serving, reason=reason) from e
    t = _mark(phases, "criu_dump", t)
    vllm.dumped(pids)

    # CRIU killed the tree: from here a failure means vLLM is gone (the agent boots it).
    remaps = link_remaps(remap_dirs) - before
    shm_remaps = {os.path.basename(p) for p in remaps if os.path.dirname(p) == shm_files.SHM}
    other_remaps = sorted(p for p in remaps if os.path.dirname(p) != shm_files.SHM)
    try:
        outside = [p for p in other_remaps if not manifest_io.below(p, cfg.run_dir)]
        if outside:
            raise CheckpointError(
                f"the tree holds deleted-but-open files outside the run dir {cfg.run_dir} "
                f"({', '.join(outside[:3])}); a restore only recreates files there",
                serving=False,
                reason="unsupported",
            )
        shm_records = shm_files.save(shm_names | shm_remaps, ckpt / SHM_SUBDIR)
        extra = save_extra(ckpt, [vllm.log_path], exact=False)
        extra += save_extra(ckpt, other_remaps, exact=True, start=1)
        used = [p for p in used if p not in other_remaps]
        extra += save_extra(ckpt, used, exact=True, start=1 + len(other_remaps))
        t = _mark(phases, "save_files", t)

        entries: list[FileEntry] = []
        if backend.agent_signs:  # else the node agent hashes what it takes in
            rel = [r for r in manifest_io.list_files(ckpt) if r != DUMP_LOG]
            threads = max(2, cfg.prefetch_threads // 2)
            entries = manifest_io.checksum_files(ckpt, rel, threads=threads)
            t = _mark(phases, "checksums", t)
        phases["total"] = t - t_start

        man: Manifest = {
            "format": MANIFEST_FORMAT,
            "created_at": time.time(),
            "agent_version": __version__,
            "fingerprint": fp,
            "environment": fingerprint.environment(criu_info.version),
            "vllm": {
                "argv": fingerprint.redact_argv(vllm.argv),
                "port": cfg.vllm_port,
                "served_name": cfg.served_name,
                "root_pid": root,
                "pids": pids,
                "run_dir": cfg.run_dir,
                "device": cfg.device,
            },
            "weights": weights,
            "canary": recorded,
            "shm_files": shm_records,
            "extra_files": extra,
            "criu": {
                "binary": criu_info.binary,
                "version": criu_info.version,
                "dump_flags": list(criu.COMMON_FLAGS),
            },
            "mmap": mmap_facts,
            "files": entries,
            "timings": phases,
        }
        backend.finish(ckpt, man, key)
    except Exception as e:
        # The dumped tree's /dev/shm files and CRIU's link-remaps would only leak.
        shm_files.remove(sorted(shm_names | shm_remaps))
        for p in other_remaps:
            with contextlib.suppress(OSError):
                os.unlink(p)
        if isinstance(e, CheckpointError):
            raise
        if isinstance(e, BackendError):
            raise CheckpointError(str(e), serving=False, reason="criu_failed") from e
        reason = os_reason(e) if isinstance(e, OSError) else "internal"
        raise CheckpointError(
            f"saving the checkpoint failed after CRIU stopped vLLM: {e}",
            serving=False,
            reason=reason,
        ) from e
    return man


def gpu_checks(
    cfg: AgentConfig,
    vllm_env: dict[str, str],
    root: str = "/",
    agent_env: Mapping[str, str] | None = None,
) -> gpu_preflight.GpuFacts | None:
    """The GPU preflight for device cuda (None on CPU); CheckpointError, vLLM still serving,
    with every problem found when CRIU's CUDA plugin would not work."""
    if cfg.device != "cuda":
        return None
    pre = gpu_preflight.check(
        cfg.criu_plugins,
        cfg.cuda_checkpoint,
        os.environ if agent_env is None else agent_env,
        vllm_env,
        cfg.tensor_parallel_size,
        root=root,
    )
    if not pre.ok:
        raise CheckpointError(pre.message(), serving=True, reason="unsupported")
    if shutil.which("nvidia-smi") is None:
        raise CheckpointError(
            "nvidia-smi not found: the GPU memory vLLM's sleep leaves (which cuda-checkpoint "
            "copies into host memory) cannot be measured; give the container the 'utility' "
            "driver capability (NVIDIA_DRIVER_CAPABILITIES=compute,utility)",
            serving=True,
            reason="unsupported",
        )
    return pre.facts


def _gpu_memory_left(
    cfg: AgentConfig,
    gpu: gpu_preflight.GpuFacts,
    control: VllmControl,
    weights_dir: Path,
    run: gpu_memory.Runner,
) -> int:
    """Bytes still on the pod's GPUs after the sleep; over the host-copy budget (or not
    measurable) the weights are put back and the checkpoint refused, vLLM serving."""
    limit = cfg.gpu_host_copy_limit_mb * gpu_memory.MIB * max(1, len(gpu.gpu_uuids))
    try:
        left = gpu_memory.used_bytes(gpu.gpu_uuids, run)
    except gpu_memory.Unmeasured as e:
        serving = _undo_release(control, weights_dir)
        raise CheckpointError(
            f"the GPU memory left after sleep cannot be measured: {e}",
            serving=serving,
            reason="gpu_memory_left",
        ) from e
    if left > limit:
        serving = _undo_release(control, weights_dir)
        raise CheckpointError(
            f"vLLM's sleep left {left / 2**30:.2f} GiB on its GPU(s), over the host-copy "
            f"budget of {limit / 2**30:.2f} GiB (--gpu-host-copy-limit-mb "
            f"{cfg.gpu_host_copy_limit_mb} per GPU): cuda-checkpoint would copy it into the "
            "pod's memory; find what holds it (vLLM's sleep level, other allocations) or "
            "raise the budget with the pod's memory",
            serving=serving,
            reason="gpu_memory_left",
        )
    return left


def _release(control: VllmControl, weights_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """Dump and release the weights: (the manifest's `weights` record, phase seconds).

    A vLLM without Rekindle's extension is checkpointed as it is (weights in
    the image), and the record says why. A failed dump leaves the weights in
    place (nothing to undo); a failed release is undone by reloading them.
    """
    weights: dict[str, Any] = {"released": False, "dir": WEIGHTS_SUBDIR}
    phases: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        control.dump_weights(str(weights_dir))
    except VllmCallError as e:
        if not missing_method(e, DUMP_WEIGHTS):
            reason = os_reason(OSError(e.body))
            raise CheckpointError(
                f"dumping the weights failed: {e}",
                reason="release_failed" if reason == "io_error" else reason,
            ) from e
        if control.device == "cuda":
            # cuda-checkpoint would copy every weight and the KV cache to host memory:
            # an OOM kill or an image the size of the GPU's memory.
            raise CheckpointError(
                "Rekindle's worker extension is not loaded in this vLLM, so its weights "
                "cannot be released before the dump; a GPU checkpoint without release is "
                "refused: start vLLM with the extension (--worker-extension auto)",
                reason="release_failed",
            ) from e
        weights["reason"] = "weights RPCs not available in this vLLM: checkpoint without release"
        with contextlib.suppress(OSError):
            shutil.rmtree(weights_dir)
            weights_dir.mkdir(mode=0o700)
        return weights, phases
    phases["dump_weights"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        control.release_weights()
    except VllmCallError as e:
        serving = _undo_release(control, weights_dir)
        raise CheckpointError(
            f"releasing the weights failed: {e}", serving=serving, reason="release_failed"
        ) from e
    phases["release"] = time.monotonic() - t0
    weights["released"] = True
    return weights, phases


def _mark(phases: dict[str, float], name: str, t0: float) -> float:
    now = time.monotonic()
    phases[name] = now - t0
    return now


def _undo_release(control: VllmControl, weights_dir: Path) -> bool:
    """Put the weights back so the server serves again after a failed checkpoint.

    True if the weights are back; otherwise the agent boots vLLM again.
    """
    try:
        control.wake(str(weights_dir))
        return True
    except (VllmCallError, OSError):
        return False
