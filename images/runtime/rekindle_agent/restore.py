"""Restore flow: checkpoint directory -> a serving vLLM, or a reason why not.

Order matters for speed: prefetching (and hashing) every file starts first and
runs while the cheap checks, the /dev/shm files and CRIU itself proceed; the
result is awaited only before the restored server is declared good. Any
failure kills whatever was restored and raises RestoreError with a reason code
(rekindle_contract.api.FALLBACK_REASONS), which the agent turns into a normal boot
(or, with --restore-policy require, into Failed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rekindle_contract.manifest import IMAGES_SUBDIR, SHM_SUBDIR, VERIFIED_NAME, WEIGHTS_SUBDIR

from rekindle_agent import criu, fingerprint, manifest_io, prefetch, shm_files
from rekindle_agent.config import AgentConfig
from rekindle_agent.vllm_control import VllmCallError, VllmControl
from rekindle_agent.vllm_process import VllmProcess

HEALTH_TIMEOUT_S = 60.0  # a restored server answers at once; this only bounds a hung one


class RestoreError(RuntimeError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def restore_extra_files(ckpt: Path, records: list[dict[str, Any]]) -> None:
    """Files outside /dev/shm the tree holds open (vLLM's log, link-remap files)."""
    for rec in records:
        dst = str(rec["path"])
        os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
        try:
            # A growing log may already be there (same pod): keep it if not shorter.
            if os.path.getsize(dst) >= int(rec["size"]) and not rec.get("exact"):
                continue
        except FileNotFoundError:
            pass
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        shutil.copyfile(ckpt / str(rec["saved"]), dst)
        os.chmod(dst, int(rec.get("mode", 0o600)))


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
    mmap: bool,
) -> dict[str, float]:
    """Run the whole restore; returns phase seconds. Raises RestoreError.

    fp() is the fingerprint of this environment (compared with the
    checkpoint's); prefetcher is one already reading ckpt (started early), or
    None to start one here when cfg.prefetch says so.
    """
    t_start = time.monotonic()
    phases: dict[str, float] = {}

    def mark(name: str, t0: float) -> float:
        now = time.monotonic()
        phases[name] = now - t0
        return now

    try:
        man = manifest_io.read(ckpt)
    except manifest_io.ManifestError as e:
        raise RestoreError(e.reason, str(e)) from e
    files = man["files"]
    verify = cfg.verify_checksums
    pre = prefetcher
    if pre is None and cfg.prefetch:
        pre = prefetch.Prefetcher(ckpt, files, threads=cfg.prefetch_threads, verify=verify)
    restored_root: int | None = None
    created_shm: list[str] = []
    try:
        t = time.monotonic()
        if require_verified and not manifest_io.is_verified(ckpt):
            raise RestoreError(
                "not_verified",
                f"{ckpt} was never proven by a restore (no '{VERIFIED_NAME}' file); "
                "checkpoint again",
            )
        problems = fingerprint.mismatches(man["fingerprint"], fp())
        if problems:
            raise RestoreError("fingerprint_mismatch", "; ".join(problems))
        try:
            manifest_io.check_sizes(ckpt, files)
        except manifest_io.ManifestError as e:
            raise RestoreError(e.reason, str(e)) from e
        t = mark("validate", t)
        if pre is None and verify != "size":
            # Without the overlap the check runs up front (and warms the cache as it reads).
            bad = (
                prefetch.Prefetcher(ckpt, files, threads=cfg.prefetch_threads, verify=verify)
                .result()
                .bad
            )
            if bad:
                raise RestoreError("checksum_mismatch", "; ".join(bad[:5]))
            t = mark("checksums", t)

        dumped = man["vllm"]
        try:
            os.makedirs(dumped["run_dir"], mode=0o700, exist_ok=True)
            os.makedirs(os.path.join(dumped["run_dir"], "tmp"), mode=0o700, exist_ok=True)
            restore_extra_files(ckpt, man.get("extra_files", []))
            created_shm = [str(r["name"]) for r in man.get("shm_files", [])]
            shm_files.recreate(man.get("shm_files", []), ckpt / SHM_SUBDIR)
        except OSError as e:
            raise RestoreError("shm_restore_failed", f"recreating files: {e}") from e
        t = mark("shm", t)

        wait_pids_free(list(dumped.get("pids", [dumped["root_pid"]])))
        pidfile = os.path.join(dumped["run_dir"], "restore.pid")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)
        # Never into the checkpoint: it is shared by every pod restoring from it.
        log = os.path.join(dumped["run_dir"], "restore.log")
        argv = criu.restore_argv(
            criu_info.binary,
            str(ckpt / IMAGES_SUBDIR),
            log,
            pidfile,
            mmap=mmap,
            plugins=cfg.criu_plugins,
        )
        res = vllm.reaper.run(argv, timeout=cfg.restore_timeout)
        if res.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError):
                tail = criu.log_tail(Path(log).read_text(errors="replace"))
            raise RestoreError(
                "criu_restore_failed",
                f"criu restore exited {res.returncode}: {res.output[-500:]}{tail}",
            )
        restored_root = int(Path(pidfile).read_text().strip())
        vllm.adopt(restored_root)
        t = mark("criu_restore", t)

        try:
            control.wait_health(HEALTH_TIMEOUT_S, alive=vllm.alive)
        except (TimeoutError, RuntimeError) as e:
            raise RestoreError("wake_failed", f"restored vLLM not healthy: {e}") from e
        t = mark("health", t)

        if pre is not None:
            result = pre.result()
            phases["prefetch_total"] = result.seconds
            if result.bad:
                raise RestoreError("checksum_mismatch", "; ".join(result.bad[:5]))
            t = mark("prefetch_wait", t)

        if man.get("weights", {}).get("released"):
            try:
                # Content was checked above (prefetch or up front) unless only sizes were.
                control.wake(str(ckpt / WEIGHTS_SUBDIR), verify=verify == "size")
            except VllmCallError as e:
                raise RestoreError("wake_failed", str(e)) from e
            t = mark("reload_weights", t)
        try:
            control.complete_one(cfg.served_name)
        except VllmCallError as e:
            raise RestoreError("verify_failed", f"one-token completion failed: {e}") from e
        mark("first_token", t)
        phases["total"] = time.monotonic() - t_start
        return phases
    except BaseException:
        if pre is not None:
            pre.cancel()
        if restored_root is not None:
            vllm.kill()
        shm_files.remove(created_shm)
        raise
