"""Restore flow: checkpoint directory -> a serving vLLM, or a reason why not.

Order matters for speed: prefetching (and hashing) every file starts first and
runs while the cheap checks, the /dev/shm files and CRIU itself proceed. Order
matters for safety too: the manifest is authenticated and its paths checked
before anything is read by name, the images CRIU parses are checked before
CRIU runs, the restored tree stays stopped until everything else it uses
(memory pages, /dev/shm files) is checked as well, and the weight dump is
checked before the reload reads it (its hashing overlaps resume and health). Any
failure kills whatever was restored and raises RestoreError with a reason code
(rekindle_contract.api.FALLBACK_REASONS), which the agent turns into a normal boot
(or, with --restore-policy require, into Failed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rekindle_contract.gpu_map import device_map
from rekindle_contract.manifest import (
    SHM_SUBDIR,
    VERIFIED_NAME,
    WEIGHTS_SUBDIR,
    FileEntry,
    Manifest,
)
from rekindle_store import manifest_io

from rekindle_agent.checkpointing import criu, fingerprint, gpu_preflight
from rekindle_agent.checkpointing.criu_backend import (
    BackendError,
    CriuBackend,
    InPod,
    RestoreOptions,
)
from rekindle_agent.config import AgentConfig
from rekindle_agent.mapped_files import mmap_policy, weights_map
from rekindle_agent.process_tree import proctree, shm_files
from rekindle_agent.restoring import cuda_resume, prefetch
from rekindle_agent.supervision import canary
from rekindle_agent.supervision.vllm_control import VllmCallError, VllmControl
from rekindle_agent.supervision.vllm_process import VllmProcess

log = logging.getLogger("rekindle.restore")
HEALTH_TIMEOUT_S = 60.0  # a restored server answers at once; this only bounds a hung one


def checked_before_criu(device: str, files: list[FileEntry]) -> set[str]:
    """The checkpoint files a restore checks before CRIU runs.

    On CPU, the images CRIU parses: the tree is then restored stopped and waits
    for the rest of what it uses. On GPU, all the tree uses, because CRIU 4.2.1's
    CUDA plugin cannot leave it stopped (it runs as soon as CRIU is done). Never
    the weight dump: only the reload reads it, once the tree is healthy, and it
    waits for that check then, so on both the check overlaps CRIU and the wake.
    """
    if device == "cuda":
        return prefetch.tree_paths(files)
    return prefetch.critical_paths(files)


class RestoreError(RuntimeError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def restore_extra_files(ckpt: Path, records: list[dict[str, Any]], run_dir: str) -> None:
    """Files outside /dev/shm the tree holds open (vLLM's log, link-remap files).

    Their paths were validated (below run_dir, manifest_io.validate_paths);
    here the real directory is checked too, so a symlink on the way cannot
    lead outside run_dir, and the file is created anew (O_EXCL|O_NOFOLLOW).
    """
    run_real = os.path.realpath(run_dir)
    for rec in records:
        dst = str(rec["path"])
        parent = os.path.dirname(dst)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        real_parent = os.path.realpath(parent)
        if real_parent != run_real and not manifest_io.below(real_parent, run_real):
            raise OSError(f"{dst}: its directory resolves to {real_parent}, outside {run_real}")
        dst = os.path.join(real_parent, os.path.basename(dst))
        try:
            st = os.lstat(dst)
            # A growing log may already be there (same pod): keep it if not shorter.
            if stat.S_ISREG(st.st_mode) and st.st_size >= int(rec["size"]) and not rec.get("exact"):
                continue
            os.unlink(dst)
        except FileNotFoundError:
            pass
        shm_files.copy_sparse(
            str(ckpt / str(rec["saved"])),
            dst,
            mode=manifest_io.safe_mode(rec.get("mode", 0o600)),
            exclusive=True,
        )


def wait_pids_free(pids: list[int], timeout: float = 10.0) -> None:
    """CRIU recreates the dumped PIDs: each must be unused (the old tree fully reaped)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise RestoreError(
                "criu_restore_failed",
                f"PIDs {busy[:10]} of the checkpointed tree are in use here; restore into a "
                "fresh PID namespace (a new pod) or stop those processes",
            )
        time.sleep(0.02)


def resume(pids: list[int]) -> None:
    """Let a tree CRIU restored stopped (--leave-stopped) run."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _checked(pre: prefetch.Prefetcher, deadline: float, paths: set[str] | None = None) -> float:
    """Wait for the content check (of paths, or all); its seconds. RestoreError if bad."""
    try:
        result = pre.result(timeout=max(0.0, deadline - time.monotonic()), paths=paths)
    except TimeoutError as e:
        raise RestoreError(
            "prefetch_timeout",
            "reading and checking the checkpoint's files took longer than --prefetch-timeout",
        ) from e
    if result.bad:
        raise RestoreError("checksum_mismatch", "; ".join(result.bad[:5]))
    return result.seconds


def restore(
    ckpt: Path,
    vllm: VllmProcess,
    control: VllmControl,
    criu_info: criu.CriuInfo,
    cfg: AgentConfig,
    *,
    fp: Callable[[], dict[str, Any]],
    prefetcher: prefetch.Prefetcher | None,
    require_verified: bool,
    choose_mmap: Callable[[Manifest], mmap_policy.Decision],
    key: bytes | None = None,
    manifest: Manifest | None = None,
    backend: CriuBackend | None = None,
    name: Path | None = None,
    agent_env: Mapping[str, str] | None = None,
) -> tuple[dict[str, float], mmap_policy.Decision]:
    """Run the whole restore; returns phase seconds and how memory came back. Raises RestoreError.

    Nothing of the checkpoint is used before it is checked: the manifest's
    signature (with key), structure, paths and modes (manifest_io.read), the
    fingerprint, the listing and sizes; then the content of every image CRIU
    parses; CRIU restores the tree stopped, and it runs only once the rest it
    uses (memory pages, the /dev/shm and other files) has been checked too; the
    weight dump, which only the reload reads, is checked before the reload.

    fp() is the fingerprint of this environment (compared with the
    checkpoint's); prefetcher is one already reading ckpt (started early, with
    manifest, the manifest it was started from), or None to start one here
    when cfg.prefetch says so. ckpt is where the checkpoint is read (the backend's
    readable()); name is what it is called (the operator's path), when they differ.
    agent_env is where this pod's GPU allocation is read (gpu_preflight.with_allocation;
    os.environ when None).
    """
    backend = backend or InPod(criu_info.binary)
    agent_env = os.environ if agent_env is None else agent_env
    t_start = time.monotonic()
    deadline = t_start + cfg.prefetch_timeout
    phases: dict[str, float] = {}

    def mark(name: str, t0: float) -> float:
        now = time.monotonic()
        phases[name] = now - t0
        return now

    # Content the node agent verified into its root-only cache is not hashed again here:
    # the prefetcher only warms it, and the reload does not check the weights again.
    verify = "size" if backend.verified_content else cfg.verify_checksums
    pre = prefetcher
    restored_root: int | None = None
    created_shm: list[str] = []
    created_files: list[str] = []
    try:
        if manifest is None or pre is None:
            # The prefetcher and the restore must check the same manifest.
            if pre is not None:
                pre.cancel()
                pre = None
            try:
                man = manifest_io.read(ckpt, key, cfg.run_dir)
            except manifest_io.ManifestError as e:
                raise RestoreError(e.reason, str(e)) from e
        else:
            man = manifest
        files = man["files"]
        if pre is None and cfg.prefetch:
            pre = prefetch.Prefetcher(ckpt, files, threads=cfg.prefetch_threads, verify=verify)
        t = time.monotonic()
        if require_verified and not manifest_io.is_verified(ckpt, man):
            raise RestoreError(
                "not_verified",
                f"{ckpt} was never proven by a restore (no '{VERIFIED_NAME}' record); "
                "checkpoint again",
            )
        problems = fingerprint.mismatches(man["fingerprint"], fp())
        if problems:
            raise RestoreError("fingerprint_mismatch", "; ".join(problems))
        gpu_map = ""
        if cfg.device == "cuda":
            # Onto this pod's GPUs, rank by rank, or not at all (a count that differs).
            try:
                gpu_map = device_map(
                    man["fingerprint"].get("gpu_uuid"),
                    gpu_preflight.allocated_devices(agent_env),
                )
            except ValueError as e:
                raise RestoreError("fingerprint_mismatch", str(e)) from e
        try:
            manifest_io.check_files(ckpt, files)
        except manifest_io.ManifestError as e:
            raise RestoreError(e.reason, str(e)) from e
        decision = choose_mmap(man)
        t = mark("validate", t)
        if pre is None and verify != "size":
            # Without the overlap everything is checked up front (and cached as it reads).
            _checked(
                prefetch.Prefetcher(ckpt, files, threads=cfg.prefetch_threads, verify=verify),
                deadline,
            )
            t = mark("checksums", t)
        elif pre is not None:
            _checked(pre, deadline, checked_before_criu(cfg.device, files))
            t = mark("verify_tree" if cfg.device == "cuda" else "verify_critical", t)

        dumped = man["vllm"]
        try:
            os.makedirs(cfg.run_dir, mode=0o700, exist_ok=True)
            os.makedirs(os.path.join(cfg.run_dir, "tmp"), mode=0o700, exist_ok=True)
            created_files = [str(r["path"]) for r in man.get("extra_files", []) if r.get("exact")]
            restore_extra_files(ckpt, man.get("extra_files", []), cfg.run_dir)
            created_shm = [str(r["name"]) for r in man.get("shm_files", [])]
            shm_files.recreate(man.get("shm_files", []), ckpt / SHM_SUBDIR)
        except (OSError, ValueError) as e:
            raise RestoreError("shm_restore_failed", f"recreating files: {e}") from e
        t = mark("shm", t)

        wait_pids_free(list(dumped.get("pids", [dumped["root_pid"]])))
        env_argv = None
        cuda_cc: str | None = None
        if cfg.device == "cuda":
            # The same preflight as a GPU checkpoint: CRIU's CUDA plugin would turn
            # itself off silently and the restored tree would have no GPU state.
            gpu = gpu_preflight.check(
                cfg.criu_plugins,
                cfg.cuda_checkpoint,
                agent_env,
                vllm.env,
                cfg.tensor_parallel_size,
            )
            if not gpu.ok:
                raise RestoreError("criu_restore_failed", gpu.message())
            cuda_cc = gpu.facts.cuda_checkpoint
            path = os.environ.get("PATH")
            env_argv = lambda a: gpu_preflight.criu_env_argv(a, cuda_cc, path, gpu_map)  # noqa: E731
        opts = RestoreOptions(
            mmap=decision.use,
            mmap_heap=decision.heap,
            # CRIU 4.2.1's CUDA plugin hangs in its late resume hook when the tasks
            # are left stopped (tests/criu/test_cuda_plugin.py): on GPU the tree runs
            # at once, and every file was checked above instead.
            stopped=cfg.device != "cuda",
            plugins=cfg.criu_plugins,
            timeout=cfg.restore_timeout,
        )
        try:
            restored_root = backend.restore(
                vllm.reaper, name or ckpt, ckpt, cfg.run_dir, opts, env_argv
            )
        except BackendError as e:
            raise RestoreError("criu_restore_failed", str(e)) from e
        if decision.use and backend.copied:
            decision = mmap_policy.Decision(False, backend.copied)
        vllm.adopt(restored_root)
        t = mark("criu_restore", t)
        if cuda_cc is not None and not backend.resumes_cuda:
            failed = cuda_resume.not_resumed(
                cuda_resume.states(cuda_cc, proctree.tree(restored_root))
            )
            if failed:
                raise RestoreError(
                    "criu_restore_failed",
                    f"CUDA did not resume in the restored tree ({'; '.join(failed)}); "
                    "CRIU's restore log names cuda-checkpoint's error",
                )
            t = mark("cuda_state", t)

        if pre is not None and cfg.device != "cuda":
            # The memory pages and files the tree uses: it is still stopped. The
            # weight dump is checked meanwhile and gates the reload (below).
            _checked(pre, deadline, prefetch.tree_paths(files))
            t = mark("prefetch_wait", t)
        resume(proctree.tree(restored_root))
        log.info("restored tree %d: every file checked, resumed", restored_root)
        t = mark("resume", t)

        try:
            control.wait_health(HEALTH_TIMEOUT_S, alive=vllm.alive)
        except (TimeoutError, RuntimeError) as e:
            raise RestoreError("wake_failed", f"restored vLLM not healthy: {e}") from e
        t = mark("health", t)

        if pre is not None:
            # Nothing reads the weight dump before the reload does.
            phases["prefetch_total"] = _checked(pre, deadline)
            t = mark("weights_check_wait", t)
        if man.get("weights", {}).get("released"):
            try:
                # Content was checked above (prefetch or up front) unless only sizes were.
                woke = control.wake(
                    str(ckpt / WEIGHTS_SUBDIR),
                    verify=verify == "size" and not backend.verified_content,
                    # The restored tree kept the environment it was dumped with: the
                    # off switch of this pod's environment is passed on explicitly.
                    map_weights=not weights_map.switched_off(),
                )
            except VllmCallError as e:
                raise RestoreError("wake_failed", str(e)) from e
            t = mark("reload_weights", t)
            # Parts of reload_weights (not phases of their own): reading or mapping the
            # dump, and on CPU repacking the GEMM weights after it.
            for part in ("read", "repack"):
                if f"reload_{part}" in woke:
                    phases[f"reload_weights.{part}"] = woke[f"reload_{part}"]
        try:
            control.complete_one(cfg.served_name)
        except VllmCallError as e:
            raise RestoreError("verify_failed", f"one-token completion failed: {e}") from e
        t = mark("first_token", t)
        if man.get("canary"):  # checkpoints made before the canary have none
            try:
                differ = canary.check(control, cfg.served_name, man["canary"])
            except VllmCallError as e:
                raise RestoreError("verify_failed", f"the canary completion failed: {e}") from e
            if differ:
                raise RestoreError(
                    "canary_mismatch",
                    "the restored vLLM answers the canary prompts differently from the one "
                    f"checkpointed: {'; '.join(differ)}",
                )
            mark("canary", t)
        phases["total"] = time.monotonic() - t_start
        return phases, decision
    except BaseException:
        if pre is not None:
            pre.cancel()
        if restored_root is not None:
            vllm.kill()
        shm_files.remove(created_shm)
        for path in created_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
