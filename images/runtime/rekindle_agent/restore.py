"""Restore flow: checkpoint directory -> a serving vLLM, or a reason why not.

Order matters for speed: prefetching (and hashing) every file starts first and
runs while the cheap checks, the /dev/shm files and CRIU itself proceed; the
result is awaited only before the restored server is declared good. Any
failure kills whatever was restored and raises RestoreError with a reason code
(api.FALLBACK_REASONS), which the agent turns into a normal boot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rekindle_agent import api, criu, early, fingerprint, manifest, prefetch, proctree, shm
from rekindle_agent.vllm_control import VllmCallError, VllmControl, wait_health

if TYPE_CHECKING:
    from rekindle_agent.agent import Agent


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


def restore(agent: Agent, ckpt: Path, *, require_verified: bool, mmap: bool) -> dict[str, float]:
    """Run the whole restore; returns phase seconds. Raises RestoreError."""
    cfg = agent.cfg
    t_start = time.monotonic()
    phases: dict[str, float] = {}

    def mark(name: str, t0: float) -> float:
        now = time.monotonic()
        phases[name] = now - t0
        return now

    try:
        man = manifest.read(ckpt)
    except manifest.ManifestError as e:
        raise RestoreError(e.reason, str(e)) from e
    files = man["files"]
    verify = cfg.verify_checksums
    pre: prefetch.Prefetcher | None = None
    if cfg.prefetch:
        pre = early.take_prefetcher(ckpt) or prefetch.Prefetcher(
            ckpt, files, threads=cfg.prefetch_threads, verify=verify
        )
    restored_root: int | None = None
    created_shm: list[str] = []
    try:
        t = time.monotonic()
        if require_verified and not manifest.is_verified(ckpt):
            raise RestoreError(
                "not_verified",
                f"{ckpt} was never proven by a restore (no '{api.VERIFIED_NAME}' file); "
                "checkpoint again",
            )
        problems = fingerprint.mismatches(man["fingerprint"], agent.fingerprint())
        if problems:
            raise RestoreError("fingerprint_mismatch", "; ".join(problems))
        try:
            manifest.check_sizes(ckpt, files)
        except manifest.ManifestError as e:
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

        vllm = man["vllm"]
        try:
            os.makedirs(vllm["run_dir"], mode=0o700, exist_ok=True)
            os.makedirs(os.path.join(vllm["run_dir"], "tmp"), mode=0o700, exist_ok=True)
            restore_extra_files(ckpt, man.get("extra_files", []))
            created_shm = [str(r["name"]) for r in man.get("shm_files", [])]
            shm.recreate(man.get("shm_files", []), ckpt / api.SHM_SUBDIR)
        except OSError as e:
            raise RestoreError("shm_restore_failed", f"recreating files: {e}") from e
        t = mark("shm", t)

        wait_pids_free(list(vllm.get("pids", [vllm["root_pid"]])))
        pidfile = os.path.join(vllm["run_dir"], "restore.pid")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)
        # Never into the checkpoint: it is shared by every pod restoring from it.
        log = os.path.join(vllm["run_dir"], "restore.log")
        argv = criu.restore_argv(
            agent.criu_info().binary,
            str(ckpt / api.IMAGES_SUBDIR),
            log,
            pidfile,
            mmap=mmap,
            plugins=cfg.criu_plugins,
        )
        res = agent.reaper.run(argv, timeout=cfg.restore_timeout)
        if res.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError):
                tail = criu.log_tail(Path(log).read_text(errors="replace"))
            raise RestoreError(
                "criu_restore_failed",
                f"criu restore exited {res.returncode}: {res.output[-500:]}{tail}",
            )
        restored_root = int(Path(pidfile).read_text().strip())
        agent.adopt(restored_root)
        t = mark("criu_restore", t)

        url = agent.vllm_url
        try:
            wait_health(url, 60, alive=lambda: proctree.alive(restored_root or 0))
        except (TimeoutError, RuntimeError) as e:
            raise RestoreError("wake_failed", f"restored vLLM not healthy: {e}") from e
        t = mark("health", t)

        if pre is not None:
            result = pre.result()
            phases["prefetch_total"] = result.seconds
            if result.bad:
                raise RestoreError("checksum_mismatch", "; ".join(result.bad[:5]))
            t = mark("prefetch_wait", t)

        control = VllmControl(url, cfg.device)
        if man.get("weights", {}).get("released"):
            try:
                # Content was checked above (prefetch or up front) unless only sizes were.
                control.wake(str(ckpt / api.WEIGHTS_SUBDIR), verify=verify == "size")
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
            agent.kill_vllm()
        shm.remove(created_shm)
        raise
