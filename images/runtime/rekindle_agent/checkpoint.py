"""Checkpoint flow: a drained, serving vLLM -> a checkpoint directory with a manifest.

The agent has already stopped new requests and drained in-flight ones. Here:
release the weights (dumped once into the checkpoint), refuse io_uring, dump
the tree with CRIU, save the /dev/shm files and other files it holds open,
checksum everything and write the manifest. If anything fails before CRIU
kills the tree, vLLM is put back as it was (weights reloaded) and keeps serving.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rekindle_contract.manifest import (
    FILES_SUBDIR,
    IMAGES_SUBDIR,
    MANIFEST_FORMAT,
    SHM_SUBDIR,
    WEIGHTS_SUBDIR,
    Manifest,
)

from rekindle_agent import (
    __version__,
    criu,
    fingerprint,
    io_uring,
    manifest_io,
    proctree,
    shm_files,
)
from rekindle_agent.config import AgentConfig
from rekindle_agent.vllm_control import VllmCallError, VllmControl, missing_method
from rekindle_agent.vllm_process import VllmProcess

DUMP_LOG = "dump.log"  # CRIU's log, kept beside the images (not checksummed)


class CheckpointError(RuntimeError):
    """The checkpoint failed; .serving says whether vLLM still runs (it should)."""

    def __init__(self, message: str, serving: bool = True) -> None:
        super().__init__(message)
        self.serving = serving


def check_target(directory: str, root: str | None) -> Path:
    """The requested directory: absolute, below root if one is set, new or empty."""
    if not directory or not os.path.isabs(directory):
        raise ValueError(f"'dir' must be an absolute path, got {directory!r}")
    path = Path(os.path.normpath(directory))
    if root:
        r = Path(os.path.normpath(root))
        if path == r or r not in path.parents:
            raise ValueError(f"'dir' {path} must be below the checkpoint root {r}")
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


def save_extra(ckpt: Path, paths: list[str], exact: bool) -> list[dict[str, Any]]:
    dest = ckpt / FILES_SUBDIR
    dest.mkdir(mode=0o700, exist_ok=True)
    out = []
    for i, src in enumerate(sorted(paths)):
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
                "mode": st.st_mode & 0o7777,
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
) -> Manifest:
    """Dump the running vLLM into ckpt; returns the manifest (not yet verified).

    fp is the fingerprint of what runs (fingerprint.collect), recorded so a
    restore can refuse an environment that differs.
    """
    root = vllm.root_pid
    if root is None or not proctree.alive(root):
        raise CheckpointError("vLLM is not running", serving=False)
    phases: dict[str, float] = {}
    t = t_start = time.monotonic()
    ckpt.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(ckpt, 0o700)  # images hold process memory: secrets, prompts, keys
    images = ckpt / IMAGES_SUBDIR
    images.mkdir(mode=0o700)
    weights_dir = ckpt / WEIGHTS_SUBDIR
    weights_dir.mkdir(mode=0o700)

    weights, release_phases = _release(control, weights_dir)
    phases.update(release_phases)
    t = _mark(phases, "release_total", t)

    pids = proctree.tree(root)
    found = io_uring.find(pids)
    if found:
        if weights["released"]:
            _undo_release(control, weights_dir)
        raise CheckpointError(io_uring.error_message(found))
    shm_names = shm_files.tree_shm_files(pids)
    remap_dirs = {shm_files.SHM, *deleted_file_dirs(pids)}
    before = link_remaps(remap_dirs)
    t = _mark(phases, "inspect", t)

    log = str(ckpt / DUMP_LOG)
    res = vllm.reaper.run(
        criu.dump_argv(criu_info.binary, root, str(images), log, plugins=cfg.criu_plugins),
        timeout=600,
    )
    t = _mark(phases, "criu_dump", t)
    if res.returncode != 0:
        tail = ""
        with contextlib.suppress(OSError):
            tail = criu.log_tail(Path(log).read_text(errors="replace"))
        serving = proctree.alive(root)
        if serving and weights["released"]:
            _undo_release(control, weights_dir)
        raise CheckpointError(f"criu dump exited {res.returncode}:\n{tail}", serving=serving)
    vllm.dumped(pids)

    remaps = link_remaps(remap_dirs) - before
    shm_remaps = {os.path.basename(p) for p in remaps if os.path.dirname(p) == shm_files.SHM}
    shm_records = shm_files.save(shm_names | shm_remaps, ckpt / SHM_SUBDIR)
    extra = save_extra(ckpt, [vllm.log_path], exact=False)
    extra += save_extra(
        ckpt, sorted(p for p in remaps if os.path.dirname(p) != shm_files.SHM), exact=True
    )
    t = _mark(phases, "save_files", t)

    rel = [r for r in manifest_io.list_files(ckpt) if r != DUMP_LOG]
    entries = manifest_io.checksum_files(ckpt, rel, threads=max(2, cfg.prefetch_threads // 2))
    t = _mark(phases, "checksums", t)
    phases["total"] = t - t_start

    man: Manifest = {
        "format": MANIFEST_FORMAT,
        "created_at": time.time(),
        "agent_version": __version__,
        "fingerprint": fp,
        "environment": fingerprint.environment(criu_info.version),
        "vllm": {
            "argv": vllm.argv,
            "port": cfg.vllm_port,
            "served_name": cfg.served_name,
            "root_pid": root,
            "pids": pids,
            "run_dir": cfg.run_dir,
            "device": cfg.device,
        },
        "weights": weights,
        "shm_files": shm_records,
        "extra_files": extra,
        "criu": {
            "binary": criu_info.binary,
            "version": criu_info.version,
            "dump_flags": list(criu.COMMON_FLAGS),
        },
        "files": entries,
        "timings": phases,
    }
    manifest_io.write(ckpt, man)
    return man


def _release(control: VllmControl, weights_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """Dump and release the weights: (the manifest's `weights` record, phase seconds).

    A vLLM without Rekindle's extension is checkpointed as it is (weights in
    the image), and the record says why.
    """
    weights: dict[str, Any] = {"released": False, "dir": WEIGHTS_SUBDIR}
    phases: dict[str, float] = {}
    try:
        phases = control.release(str(weights_dir))
        weights["released"] = True
    except VllmCallError as e:
        if not missing_method(e):
            _undo_release(control, weights_dir)
            raise CheckpointError(f"releasing the weights failed: {e}") from e
        weights["reason"] = "weights RPCs not available in this vLLM: checkpoint without release"
        with contextlib.suppress(OSError):
            shutil.rmtree(weights_dir)
            weights_dir.mkdir(mode=0o700)
    return weights, phases


def _mark(phases: dict[str, float], name: str, t0: float) -> float:
    now = time.monotonic()
    phases[name] = now - t0
    return now


def _undo_release(control: VllmControl, weights_dir: Path) -> None:
    """Put the weights back so the server serves again after a failed checkpoint."""
    with contextlib.suppress(VllmCallError):
        control.wake(str(weights_dir))
