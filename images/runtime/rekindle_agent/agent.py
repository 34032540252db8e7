"""The agent: owns vLLM's process tree and moves it between states.

Booting -> Ready -> Draining -> Checkpointing -> Restoring -> Ready, with
Restoring also at start when a good checkpoint exists, and a normal boot
whenever a restore fails. Blocking work (boot, CRIU, hashing) runs in worker
threads; the HTTP side (server.py) only reads state and counts requests. The
flows themselves (checkpoint.py, restore.py) get only what they use: the
process tree, the vLLM client, CRIU's capabilities and the settings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rekindle_contract.api import State, StatusDoc
from rekindle_contract.manifest import Manifest
from rekindle_contract.vllm_argv import vllm_argv

from rekindle_agent import checkpoint, criu, fingerprint, manifest_io, reaper, restore, shm_files
from rekindle_agent.config import AgentConfig
from rekindle_agent.early import EarlyStart
from rekindle_agent.metrics import Metrics
from rekindle_agent.state import Status
from rekindle_agent.vllm_control import VllmControl
from rekindle_agent.vllm_launch import VLLM_HOST, vllm_env, vllm_options
from rekindle_agent.vllm_process import VllmProcess

log = logging.getLogger("rekindle.agent")
NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def set_ns_last_pid(floor: int) -> None:
    """Push this PID namespace's next PIDs up to floor.

    As PID 1 of a pod, the agent's own helpers (threads, criu, prefetch) take
    low PIDs; vLLM's tree gets PIDs above floor, and a restore in a new pod
    recreates those PIDs without colliding with the new agent's helpers.
    """
    with contextlib.suppress(OSError, ValueError):
        if int(Path(NS_LAST_PID).read_text()) < floor:
            Path(NS_LAST_PID).write_text(str(floor))


class Agent:
    def __init__(self, cfg: AgentConfig, token: bytes, early: EarlyStart | None = None) -> None:
        self.cfg = cfg
        self.token = token
        self.early = early or EarlyStart()
        self.status = Status()
        self.metrics = Metrics()
        self.metrics.set_state("Booting")
        self.reaper = reaper.Reaper()
        with contextlib.suppress(OSError):
            reaper.become_subreaper()
        self.vllm = VllmProcess(
            vllm_argv(vllm_options(cfg)),
            vllm_env(cfg.device, run_dir=cfg.run_dir),
            os.path.join(cfg.run_dir, "vllm.log"),
            self.reaper,
            seccomp_io_uring=cfg.seccomp_io_uring,
        )
        self.vllm_url = f"http://{VLLM_HOST}:{cfg.vllm_port}"
        self.control = VllmControl(self.vllm_url, cfg.device)
        self.flow_lock = threading.Lock()  # one boot/restore/checkpoint at a time
        self._fingerprint: dict[str, Any] | None = None
        self.t_start = time.monotonic()
        self.stopping = False

    # -- helpers used by the flows -------------------------------------------------
    def criu_info(self) -> criu.CriuInfo:
        return self.early.criu_info(self.cfg.criu)

    def fingerprint(self) -> dict[str, Any]:
        if self._fingerprint is None:
            self._fingerprint = fingerprint.collect(self.cfg.model, self.vllm.argv, self.cfg.device)
        return dict(self._fingerprint)

    def set_state(self, new: State, message: str = "") -> None:
        if self.status.state != new:
            self.status.set_state(new, message)
        else:
            self.status.message = message
        self.metrics.set_state(new)
        log.info("state %s %s", new, message)

    def status_doc(self, inflight: int = 0) -> StatusDoc:
        return self.status.to_json(vllm_pid=self.vllm.root_pid, inflight=inflight)

    def mmap_for_restore(self) -> bool:
        mode = self.cfg.mmap_restore
        if mode == "off":
            return False
        info = self.criu_info()
        if mode == "on" and not info.mmap_restore:
            raise restore.RestoreError(
                "criu_restore_failed",
                f"--mmap-restore on, but {info.binary} has no "
                f"{criu.MMAP_RESTORE_FLAG}; use the patched CRIU or --mmap-restore auto",
            )
        return info.mmap_restore

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
        self.vllm.spawn()
        if self.stopping:  # shutdown raced with the spawn
            self.vllm.kill(remove_shm=True)
            raise RuntimeError("agent is stopping")
        try:
            health = self.control.wait_health(cfg.boot_timeout, alive=self.vllm.alive)
        except (TimeoutError, RuntimeError) as e:
            self.vllm.kill(remove_shm=True)
            self.set_state("Failed", f"vLLM did not boot: {e}; see {self.vllm.log_path}")
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
        self,
        ckpt: Path,
        *,
        require_verified: bool,
        mmap: bool | None = None,
        boot_on_failure: bool = True,
    ) -> bool:
        """Restore; on any failure record why and boot normally (or fail). True if restored."""
        self.set_state("Restoring", f"restoring from {ckpt}")
        try:
            use_mmap = self.mmap_for_restore() if mmap is None else mmap
            phases = restore.restore(
                ckpt,
                self.vllm,
                self.control,
                self.criu_info(),
                self.cfg,
                fp=self.fingerprint,
                prefetcher=self.early.take_prefetcher(ckpt),
                require_verified=require_verified,
                mmap=use_mmap,
            )
        except Exception as e:  # a bug must not crash-loop the pod either
            self._fell_back(ckpt, e)
            if boot_on_failure:
                self.boot()
            else:
                self.set_state("Failed", f"restore from {ckpt} failed: {e}")
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

    def _fell_back(self, ckpt: Path, e: Exception) -> None:
        """Record why a restore failed; whatever it left running is killed."""
        if isinstance(e, restore.RestoreError):
            log.warning("restore from %s failed (%s): %s", ckpt, e.reason, e.message)
            reason, message = e.reason, e.message
        else:
            log.exception("restore from %s failed", ckpt)
            reason, message = "criu_restore_failed", f"unexpected: {e!r}"
            self.vllm.kill()
        self.status.record_fallback(reason, message)
        self.metrics.fallbacks.labels(reason).inc()

    def start(self) -> None:
        """Container start: restore if a checkpoint is configured and usable, else boot."""
        cfg = self.cfg
        with self.flow_lock:
            if cfg.clear_shm and os.getpid() == 1:
                removed = shm_files.clear_stale()
                if removed:
                    log.info("removed stale /dev/shm files: %s", removed)
            required = cfg.restore_policy == "require"
            try:
                if cfg.checkpoint and cfg.restore_policy != "never":
                    self.restore_or_fallback(
                        Path(cfg.checkpoint), require_verified=True, boot_on_failure=not required
                    )
                elif required:
                    self.set_state("Failed", "--restore-policy require, but no --checkpoint")
                else:
                    self.boot()
            except Exception as e:
                if self.status.state != "Failed":
                    self.set_state("Failed", f"start failed: {e}")

    def run_checkpoint(self, ckpt: Path) -> Manifest:
        """Called with the proxy drained (state Checkpointing). Dump, then prove by restoring."""
        try:
            man = self._dump(ckpt)
        except checkpoint.CheckpointError as e:
            self.metrics.checkpoints.labels("failed").inc()
            self.status.last_checkpoint = {"dir": str(ckpt), "ok": False, "error": str(e)}
            # Half a checkpoint is of no use (no manifest); the same dir may be retried.
            shutil.rmtree(ckpt, ignore_errors=True)
            if e.serving and self.vllm.alive():
                self.set_state("Ready", f"checkpoint failed, still serving: {e}")
            else:
                self.vllm.kill()
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
        manifest_io.mark_verified(ckpt, man, {"restore_seconds": self.status.timings["restore"]})
        self.metrics.checkpoints.labels("ok").inc()
        self.status.timings["checkpoint"] = dict(man["timings"])
        self.status.last_checkpoint = {"dir": str(ckpt), "ok": True, "timings": man["timings"]}
        return man

    def _dump(self, ckpt: Path) -> Manifest:
        try:
            info = self.criu_info()
        except OSError as e:
            raise checkpoint.CheckpointError(str(e)) from e
        man = checkpoint.checkpoint(
            ckpt, self.vllm, self.control, info, self.cfg, self.fingerprint()
        )
        self.status.weights_rpc = "available" if man["weights"]["released"] else "unavailable"
        return man

    def watch(self) -> None:
        """A vLLM that dies while Ready makes the agent Failed (liveness fails, pod restarts)."""
        while not self.stopping:
            time.sleep(1.0)
            if (
                self.status.state == "Ready"
                and not self.flow_lock.locked()
                and not self.vllm.alive()
            ):
                self.set_state("Failed", f"vLLM exited unexpectedly; see {self.vllm.log_path}")

    def shutdown(self) -> None:
        self.stopping = True
        self.vllm.kill(remove_shm=True)
        self.reaper.stop()


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
