"""The agent: owns vLLM's process tree and moves it between states.

Booting -> Ready -> Draining -> Checkpointing -> Restoring -> Ready, with
Restoring also at start when a good checkpoint exists, and a normal boot
whenever a restore fails. Blocking work (boot, CRIU, hashing) runs in worker
threads; the HTTP side (server.py) only reads state and counts requests.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rekindle_agent import (
    api,
    checkpoint,
    criu,
    early,
    fingerprint,
    manifest,
    proctree,
    reaper,
    restore,
    seccomp,
    shm,
)
from rekindle_agent.config import AgentConfig, ConfigError, normalize_checkpoint
from rekindle_agent.metrics import Metrics
from rekindle_agent.state import Status
from rekindle_agent.vllm_control import wait_health
from rekindle_agent.vllm_launch import WORKER_EXTENSION, VllmConfig, vllm_command, vllm_env

log = logging.getLogger("rekindle.agent")
PACKAGE_PARENT = str(Path(__file__).resolve().parents[1])


def read_token(path: str) -> bytes:
    try:
        token = Path(path).read_bytes().strip()
    except FileNotFoundError as e:
        raise ConfigError(
            f"token file {path} not found: mount the agent's Secret there or pass --token-file"
        ) from e
    if len(token) < 16:
        raise ConfigError(f"token in {path} is shorter than 16 bytes; use a random token")
    return token


def token_ok(expected: bytes, header: str | None) -> bool:
    """Constant-time check of an 'Authorization: Bearer <token>' header."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), expected)


def resolve_worker_extension(value: str | None) -> str | None:
    if value != "auto":
        return value
    import importlib.util

    mod = WORKER_EXTENSION.rsplit(".", 1)[0]
    try:
        return WORKER_EXTENSION if importlib.util.find_spec(mod) is not None else None
    except ModuleNotFoundError:
        return None


def set_ns_last_pid(floor: int) -> None:
    """Push this PID namespace's next PIDs up to floor.

    As PID 1 of a pod, the agent's own helpers (threads, criu, prefetch) take
    low PIDs; vLLM's tree gets PIDs above floor, and a restore in a new pod
    recreates those PIDs without colliding with the new agent's helpers.
    """
    path = "/proc/sys/kernel/ns_last_pid"
    with contextlib.suppress(OSError, ValueError):
        if int(Path(path).read_text()) < floor:
            Path(path).write_text(str(floor))


class Agent:
    def __init__(self, cfg: AgentConfig, token: bytes) -> None:
        self.cfg = cfg
        self.token = token
        self.status = Status()
        self.metrics = Metrics()
        self.metrics.set_state("Booting")
        self.reaper = reaper.Reaper()
        with contextlib.suppress(OSError):
            reaper.become_subreaper()
        self.vllm_cfg = VllmConfig(
            model=cfg.model,
            served_name=cfg.served_name,
            host="127.0.0.1",
            port=cfg.vllm_port,
            device=cfg.device,
            max_model_len=cfg.max_model_len,
            worker_extension=resolve_worker_extension(cfg.worker_extension),
            extra_args=tuple(cfg.vllm_args),
        )
        self.vllm_argv = vllm_command(self.vllm_cfg)
        self.vllm_url = f"http://127.0.0.1:{cfg.vllm_port}"
        self.vllm_log = os.path.join(cfg.run_dir, "vllm.log")
        self.root_pid: int | None = None
        self.flow_lock = threading.Lock()  # one of boot/restore/checkpoint at a time
        self._criu: criu.CriuInfo | None = None
        self._fingerprint: dict[str, Any] | None = None
        self.t_start = time.monotonic()
        self.stopping = False

    # -- helpers used by the flows -------------------------------------------------
    def criu_info(self) -> criu.CriuInfo:
        if self._criu is None:
            self._criu = early.probe(self.cfg.criu)
        return self._criu

    def fingerprint(self) -> dict[str, Any]:
        if self._fingerprint is None:
            self._fingerprint = fingerprint.collect(self.cfg.model, self.vllm_argv, self.cfg.device)
        return dict(self._fingerprint)

    def set_state(self, new: str, message: str = "") -> None:
        if self.status.state != new:
            self.status.set_state(new, message)
        else:
            self.status.message = message
        self.metrics.set_state(new)
        log.info("state %s %s", new, message)

    def adopt(self, pid: int) -> None:
        self.root_pid = pid
        self.status.vllm_pid = pid

    def dumped(self, pids: list[int]) -> None:
        """CRIU killed the tree after a successful dump: wait until it is fully gone."""
        with contextlib.suppress(TimeoutError):
            proctree.kill_tree(pids, timeout=10)
        self.root_pid = None
        self.status.vllm_pid = None

    def vllm_alive(self) -> bool:
        return self.root_pid is not None and proctree.alive(self.root_pid)

    def kill_vllm(self, remove_shm: bool = False) -> None:
        """Kill the whole tree (SIGKILL); optionally delete the /dev/shm files it used."""
        if self.root_pid is None:
            return
        pids = proctree.tree(self.root_pid)
        names = shm.tree_shm_files(pids) if remove_shm else set()
        with contextlib.suppress(TimeoutError):
            proctree.kill_tree(pids)
        if remove_shm:
            shm.remove(sorted(names))
        self.root_pid = None
        self.status.vllm_pid = None

    def mmap_for_restore(self) -> bool:
        mode = self.cfg.mmap_restore
        if mode == "off":
            return False
        supported = self.criu_info().mmap_restore
        if mode == "on" and not supported:
            raise restore.RestoreError(
                "criu_restore_failed",
                f"--mmap-restore on, but {self.criu_info().binary} has no "
                f"{criu.MMAP_RESTORE_FLAG}; use the patched CRIU or --mmap-restore auto",
            )
        return supported

    # -- flows ---------------------------------------------------------------------
    def boot(self) -> None:
        """Start vLLM normally and wait until it serves."""
        cfg = self.cfg
        if self.stopping:
            raise RuntimeError("agent is stopping; not booting vLLM")
        self.set_state("Booting", "starting vLLM")
        t0 = time.monotonic()
        os.makedirs(os.path.join(cfg.run_dir, "tmp"), mode=0o700, exist_ok=True)
        if os.getpid() == 1 and cfg.ns_last_pid > 0:
            set_ns_last_pid(cfg.ns_last_pid)
        argv = seccomp.wrap(self.vllm_argv) if cfg.seccomp_io_uring else list(self.vllm_argv)
        env = vllm_env(self.vllm_cfg)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p
        )
        # Sockets and temp files of the tree live at the same path in every pod.
        env["TMPDIR"] = os.path.join(cfg.run_dir, "tmp")
        env["UV_USE_IO_URING"] = "0"
        fd = os.open(self.vllm_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            pid = self.reaper.spawn(argv, env=env, stdout=fd, stderr=fd)
        finally:
            os.close(fd)
        self.adopt(pid)
        if self.stopping:  # shutdown raced with the spawn
            self.kill_vllm(remove_shm=True)
            raise RuntimeError("agent is stopping")
        try:
            health = wait_health(self.vllm_url, cfg.boot_timeout, alive=self.vllm_alive)
        except (TimeoutError, RuntimeError) as e:
            self.kill_vllm(remove_shm=True)
            self.set_state("Failed", f"vLLM did not boot: {e}; see {self.vllm_log}")
            raise
        total = time.monotonic() - t0
        self.status.timings["boot"] = {"health": health, "total": total}
        self.metrics.boot_seconds.observe(total)
        self.metrics.ready_seconds.labels("booted").set(time.monotonic() - self.t_start)
        self.status.origin = "booted"
        self.status.checkpoint = None
        self.status.restored_with_mmap = False
        self.set_state("Ready", "booted")

    def restore_or_fallback(
        self, ckpt: Path, *, require_verified: bool, mmap: bool | None = None
    ) -> bool:
        """Restore; on any failure record why and boot normally. True if restored."""
        self.set_state("Restoring", f"restoring from {ckpt}")
        try:
            use_mmap = self.mmap_for_restore() if mmap is None else mmap
            phases = restore.restore(self, ckpt, require_verified=require_verified, mmap=use_mmap)
        except restore.RestoreError as e:
            log.warning("restore from %s failed (%s): %s", ckpt, e.reason, e.message)
            self.status.record_fallback(e.reason, e.message)
            self.metrics.fallbacks.labels(e.reason).inc()
            self.boot()
            return False
        except Exception as e:  # a bug must not crash-loop the pod either
            log.exception("restore from %s failed", ckpt)
            self.status.record_fallback("criu_restore_failed", f"unexpected: {e!r}")
            self.metrics.fallbacks.labels("criu_restore_failed").inc()
            self.kill_vllm()
            self.boot()
            return False
        self.status.timings["restore"] = phases
        log.info("restore phases (s): %s", {k: round(v, 3) for k, v in phases.items()})
        self.metrics.observe_phases(self.metrics.restore_phase_seconds, phases)
        self.metrics.ready_seconds.labels("restored").set(time.monotonic() - self.t_start)
        self.status.origin = "restored"
        self.status.checkpoint = str(ckpt)
        self.status.restored_with_mmap = use_mmap
        self.set_state("Ready", f"restored from {ckpt}")
        return True

    def start(self) -> None:
        """Container start: restore if a checkpoint is configured and usable, else boot."""
        with self.flow_lock:
            ckpt = normalize_checkpoint(self.cfg.checkpoint)
            if self.cfg.clear_shm and os.getpid() == 1:
                removed = shm.clear_stale()
                if removed:
                    log.info("removed stale /dev/shm files: %s", removed)
            try:
                if ckpt and self.cfg.restore_policy != "never":
                    self.restore_or_fallback(Path(ckpt), require_verified=True)
                else:
                    self.boot()
            except Exception as e:
                if self.status.state != "Failed":
                    self.set_state("Failed", f"start failed: {e}")

    def run_checkpoint(self, ckpt: Path) -> api.Manifest:
        """Called with the proxy drained (state Checkpointing). Dump, then prove by restoring."""
        try:
            man = checkpoint.checkpoint(self, ckpt)
        except checkpoint.CheckpointError as e:
            self.metrics.checkpoints.labels("failed").inc()
            self.status.last_checkpoint = {"dir": str(ckpt), "ok": False, "error": str(e)}
            # Half a checkpoint is of no use (no manifest); the same dir may be retried.
            shutil.rmtree(ckpt, ignore_errors=True)
            if e.serving and self.vllm_alive():
                self.set_state("Ready", f"checkpoint failed, still serving: {e}")
            else:
                self.kill_vllm()
                self.boot()
            raise
        self.metrics.observe_phases(self.metrics.checkpoint_phase_seconds, man["timings"])
        # Prove it: restore with the copying (stock) restore, so this pod's process
        # does not depend on the image files and can be checkpointed again.
        restored = self.restore_or_fallback(ckpt, require_verified=False, mmap=False)
        if not restored:
            self.metrics.checkpoints.labels("failed").inc()
            reason = self.status.last_fallback or {}
            self.status.last_checkpoint = {
                "dir": str(ckpt),
                "ok": False,
                "error": f"verification restore failed: {reason}",
            }
            raise checkpoint.CheckpointError(
                f"dumped, but restoring it failed ({reason.get('reason')}): "
                f"{reason.get('message')}; vLLM was booted again"
            )
        manifest.mark_verified(ckpt, man, {"restore_seconds": self.status.timings["restore"]})
        self.metrics.checkpoints.labels("ok").inc()
        self.status.timings["checkpoint"] = dict(man["timings"])
        self.status.last_checkpoint = {"dir": str(ckpt), "ok": True, "timings": man["timings"]}
        return man

    def watch(self) -> None:
        """A vLLM that dies while Ready makes the agent Failed (liveness fails, pod restarts)."""
        while not self.stopping:
            time.sleep(1.0)
            if (
                self.status.state == "Ready"
                and not self.flow_lock.locked()
                and not self.vllm_alive()
            ):
                self.set_state("Failed", f"vLLM exited unexpectedly; see {self.vllm_log}")

    def shutdown(self) -> None:
        self.stopping = True
        self.kill_vllm(remove_shm=True)
        self.reaper.stop()


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def install_signal_exit(loop_stop: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: loop_stop())
