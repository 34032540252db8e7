"""The agent: owns vLLM's process tree and moves it between states.

Booting -> Ready -> Draining -> Checkpointing -> Restoring -> Ready, with
Restoring also at start when a good checkpoint exists, and a normal boot
whenever a restore fails. Blocking work (boot, CRIU, hashing) runs in worker
threads; the HTTP side (server.py) only reads state and counts requests. The
flows themselves (checkpoint.py, restore.py) get only what they use: the
process tree, the vLLM client, CRIU's capabilities and the settings.

Every checkpoint ends in a defined state: Ready with vLLM serving (the same
tree, or a new boot when the old one is gone), the partial directory removed
and the reason in status.last_checkpoint; or, when the watchdog finds it
stuck past --checkpoint-timeout, Failed (terminal: the liveness probe
restarts the container), with CRIU and vLLM's tree killed and the directory
removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rekindle_contract.api import RestoreMemoryDoc, SecurityDoc, State, StatusDoc
from rekindle_contract.manifest import (
    IMAGES_SUBDIR,
    SIGNATURE_ALGORITHM,
    WEIGHTS_SUBDIR,
    Manifest,
)
from rekindle_store import manifest_io, signing

from rekindle_agent.checkpointing import checkpoint, criu, fingerprint, gpu_preflight, space
from rekindle_agent.checkpointing.criu_backend import BackendError, CriuBackend, InPod, NodeAgent
from rekindle_agent.config import AgentConfig
from rekindle_agent.mapped_files import immutable, mmap_policy, mounts
from rekindle_agent.metrics import Metrics
from rekindle_agent.process_tree import proctree, reaper, shm_files
from rekindle_agent.restoring import restore
from rekindle_agent.restoring.early import EarlyStart
from rekindle_agent.restoring.prewarm import Prewarmer
from rekindle_agent.state import Status
from rekindle_agent.supervision.vllm_control import VllmControl
from rekindle_agent.supervision.vllm_launch import VLLM_HOST, vllm_command
from rekindle_agent.supervision.vllm_process import VllmProcess, describe_exit

log = logging.getLogger("rekindle.agent")


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        token: bytes,
        early: EarlyStart | None = None,
        *,
        api_key: bytes | None = None,
        signing_key: bytes | None = None,
        metrics_token: bytes | None = None,
        refused_pointer: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics_token = metrics_token  # reads GET /metrics only (None: no such token)
        # Why the restore pointer was refused (config.refuse_unsigned_pointer): start boots.
        self.refused_pointer = refused_pointer
        self.token = token
        self.api_key = api_key  # the serve port's key (None: no key)
        self.signing_key = signing_key  # signs and checks manifests (None: unsigned)
        self.early = early or EarlyStart(signing_key)
        self.status = Status()
        self.status.security = SecurityDoc(
            checkpoint_signing=SIGNATURE_ALGORITHM if signing_key else "unsigned",
            signing_key_id=signing.key_id(signing_key) if signing_key else None,
            verify=cfg.verify_checksums,
            serve_api_key=api_key is not None,
            checkpoint_mount="none",
            admin_tls=bool(cfg.admin_tls_cert and cfg.admin_tls_key),
        )
        if signing_key is None:
            log.warning(
                "no --signing-key-file: checkpoints are written and restored unsigned "
                "(anyone who can write the checkpoint volume decides what is restored)"
            )
        self.backend: CriuBackend = (
            NodeAgent(cfg.node_socket, cfg.pod_uid or "", cfg.node_publish, cfg.node_store)
            if cfg.node_socket
            else InPod(cfg.criu)
        )
        self.prewarmer = Prewarmer(self.backend)
        if not self.backend.agent_signs:
            # The node agent signs with its own key and verifies into its cache; the
            # agent reads the verified copy through the descriptor the node agent gives.
            self.status.security["checkpoint_signing"] = "node agent"
            self.status.security["checkpoint_mount"] = "node agent's verified cache (read-only)"
        self.metrics = Metrics()
        self.metrics.set_state("Booting")
        self.reaper = reaper.Reaper()
        with contextlib.suppress(OSError):
            reaper.become_subreaper()
        # Where the GPU checks read this pod's allocation: the kubelet's record when the
        # node agent can give it, else the environment (NVIDIA_VISIBLE_DEVICES).
        self.gpu_env: dict[str, str] = dict(os.environ)
        argv, env = vllm_command(cfg)
        if cfg.device == "cuda":
            self.gpu_env = gpu_preflight.with_allocation(os.environ, self.backend.gpu_allocation())
            # A privileged pod sees every GPU: pin vLLM to the allocated one by UUID.
            env = gpu_preflight.pin_visible_devices(env, self.gpu_env)
            self._warn_gpu(env)
        self.vllm = VllmProcess(
            argv,
            env,
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
        # The watchdog: (deadline, what, checkpoint dir) of the checkpoint running now.
        self._guard: tuple[float, str, Path | None] | None = None
        self._guard_lock = threading.Lock()
        self.terminal = False  # the watchdog gave up: Failed until the container restarts
        self.flow_aborted = threading.Event()

    def _warn_gpu(self, vllm_env: dict[str, str]) -> None:
        """At start, say what would stop a GPU checkpoint (each one is refused until fixed)."""
        cfg = self.cfg
        pre = gpu_preflight.check(
            cfg.criu_plugins, cfg.cuda_checkpoint, self.gpu_env, vllm_env, cfg.tensor_parallel_size
        )
        if not pre.ok:
            log.warning("%s: checkpoints and restores are refused until fixed", pre.message())

    # -- helpers used by the flows -------------------------------------------------
    def criu_info(self) -> criu.CriuInfo:
        return self.early.criu_info(self.cfg.criu)

    def fingerprint(self) -> dict[str, Any]:
        if self._fingerprint is None:
            fp = self.early.fingerprint()
            if fp is None or fp.get("vllm_argv") != fingerprint.normalize_argv(self.vllm.argv):
                fp = fingerprint.collect(
                    self.cfg.model, self.vllm.argv, self.cfg.device, self.vllm.env
                )
            if self.cfg.device == "cuda":
                fp = {
                    **fp,
                    **fingerprint.cuda_facts(
                        self.cfg.criu_plugins, self.cfg.cuda_checkpoint, self.gpu_env
                    ),
                }
            self._fingerprint = fp
        return dict(self._fingerprint)

    def set_state(self, new: State, message: str = "") -> None:
        if self.terminal and new != "Failed":
            log.warning("state %s ignored: the watchdog ended this agent (%s)", new, message)
            return
        if self.status.state != new:
            self.status.set_state(new, message)
        else:
            self.status.message = message
        self.metrics.set_state(new)
        log.info("state %s %s", new, message)

    def status_doc(self, inflight: int = 0) -> StatusDoc:
        return self.status.to_json(vllm_pid=self.vllm.root_pid, inflight=inflight)

    def mmap_decision(self, man: Manifest, ckpt: Path) -> mmap_policy.Decision:
        """Map the images or copy them, for this checkpoint on this node (mmap_policy)."""
        mode = self.cfg.mmap_restore
        info = self.criu_info()
        if mode == "on" and not info.mmap_restore:
            raise restore.RestoreError(
                "criu_restore_failed",
                f"--mmap-restore on, but {info.binary} has no "
                f"{criu.MMAP_RESTORE_FLAG}; use the patched CRIU or --mmap-restore auto",
            )
        return mmap_policy.decide(
            mode,
            info.mmap_restore,
            man.get("mmap"),
            ckpt / IMAGES_SUBDIR,
            criu_has_heap_option=info.mmap_restore_heap,
        )

    # -- flows ---------------------------------------------------------------------
    def boot(self) -> None:
        """Start vLLM normally and wait until it serves."""
        cfg = self.cfg
        if self.stopping:
            raise RuntimeError("agent is stopping; not booting vLLM")
        if self.terminal:
            raise RuntimeError("the watchdog ended this agent; not booting vLLM")
        self.unguard()  # a boot is bounded by --boot-timeout, not the checkpoint's watchdog
        self.set_state("Booting", "starting vLLM")
        t0 = time.monotonic()
        os.makedirs(os.path.join(cfg.run_dir, "tmp"), mode=0o700, exist_ok=True)
        if os.getpid() == 1 and cfg.ns_last_pid > 0:
            self.backend.reserve_pids(cfg.ns_last_pid)
        try:
            self.vllm.spawn()  # refuses a vLLM port someone else listens on
        except RuntimeError as e:
            self.set_state("Failed", f"vLLM not started: {e}")
            raise
        if self.stopping:  # shutdown raced with the spawn
            self.vllm.kill(remove_shm=True)
            raise RuntimeError("agent is stopping")
        try:
            health = self.control.wait_health(cfg.boot_timeout, alive=self.vllm.alive)
            self.vllm.check_own_listener()  # the answer came from our tree, not another vLLM
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
        self.status.restore_memory = None
        self.set_state("Ready", "booted")

    def restore_or_fallback(
        self,
        ckpt: Path,
        *,
        require_verified: bool,
        copy_why: str = "",
        boot_on_failure: bool = True,
        then_ready: bool = True,
    ) -> bool:
        """Restore; on any failure record why and boot normally (or fail). True if restored.

        copy_why forces the copying restore and says why; otherwise mmap_decision decides.
        then_ready=False leaves a restored agent Restoring: the caller still has to record
        what the restore proved before anyone may take Ready to mean it is done (an
        operator restarted in between reads the status and would otherwise find Ready with
        no finished checkpoint recorded, and fail a good one).
        """
        self.set_state("Restoring", f"restoring from {ckpt}")

        readable = ckpt

        def choose(man: Manifest) -> mmap_policy.Decision:
            if copy_why:
                return mmap_policy.Decision(False, copy_why)
            return self.mmap_decision(man, readable)

        try:
            readable = self.backend.readable(ckpt)
            # Through the node agent the early prefetch read the same verified entry through
            # a descriptor of its own (readable is the restore's).
            early = self.early.take_prefetcher(ckpt)
            phases, memory = restore.restore(
                readable,
                self.vllm,
                self.control,
                self.criu_info(),
                self.cfg,
                fp=self.fingerprint,
                prefetcher=early[1] if early else None,
                manifest=early[0] if early else None,
                require_verified=require_verified,
                choose_mmap=choose,
                key=self.signing_key if self.backend.agent_signs else None,
                backend=self.backend,
                name=ckpt,
                agent_env=self.gpu_env,
            )
        except Exception as e:  # a bug must not crash-loop the pod either
            if isinstance(e, BackendError):
                e = restore.RestoreError(e.reason, str(e))
            self._fell_back(ckpt, e)
            if self.terminal:
                return False
            if boot_on_failure:
                self.boot()
            else:
                self.set_state("Failed", f"restore from {ckpt} failed: {e}")
            return False
        if self.backend.pulled is not None:  # verified from shared storage first
            phases = {"pull": self.backend.pulled, **phases}
        self.status.timings["restore"] = phases
        log.info("restore phases (s): %s", {k: round(v, 3) for k, v in phases.items()})
        self.metrics.observe_phases(self.metrics.restore_phase_seconds, phases)
        self.metrics.ready_seconds.labels("restored").set(time.monotonic() - self.t_start)
        self.status.origin = "restored"
        self.status.checkpoint = str(ckpt)
        self.status.restored_with_mmap = memory.use
        self.status.restore_memory = RestoreMemoryDoc(path=memory.path, why=memory.why)
        log.info("restored memory by %s: %s", memory.path, memory.why)
        if then_ready:
            self.set_state("Ready", f"restored from {ckpt}")
        else:
            self.set_state("Restoring", f"restored from {ckpt}; recording what it proved")
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
                if self.refused_pointer and cfg.restore_policy != "never":
                    self._refuse_pointer(self.refused_pointer, required)
                elif cfg.restore_from and cfg.restore_policy != "never":
                    if self.backend.privileged:
                        self._mount_read_only(Path(cfg.restore_from))
                    self.restore_or_fallback(
                        Path(cfg.restore_from), require_verified=True, boot_on_failure=not required
                    )
                elif required:
                    self.set_state("Failed", "--restore-policy require, but no --restore-from")
                else:
                    self.boot()
            except Exception as e:
                if self.status.state != "Failed":
                    self.set_state("Failed", f"start failed: {e}")

    def _refuse_pointer(self, why: str, required: bool) -> None:
        log.warning("not restoring: %s", why)
        self.status.record_fallback("pointer_refused", why)
        self.metrics.fallbacks.labels("pointer_refused").inc()
        if required:
            self.set_state("Failed", f"--restore-policy require, but {why}")
        else:
            self.boot()

    def _mount_read_only(self, ckpt: Path) -> None:
        """The checkpoint this pod restores from becomes read-only inside the pod (mounts)."""
        if os.getpid() != 1:
            why = "read-write: the agent is not its container's first process"
        elif not ckpt.is_dir():
            why = f"read-write: {ckpt} is not a directory"
        else:
            try:
                mounts.bind_read_only(ckpt)
                why = "read-only"
            except OSError as e:
                log.warning("cannot make %s read-only in this pod: %s", ckpt, e)
                why = f"read-write: {e}"
        self.status.security["checkpoint_mount"] = why

    # -- checkpoint and its watchdog -------------------------------------------------
    def guard(self, what: str, ckpt: Path | None) -> None:
        """Arm the watchdog for a checkpoint starting now (--checkpoint-timeout)."""
        with self._guard_lock:
            self._guard = (time.monotonic() + self.cfg.checkpoint_timeout, what, ckpt)

    def unguard(self) -> None:
        with self._guard_lock:
            self._guard = None

    def check_watchdog(self, now: float | None = None) -> bool:
        """Fire if the armed checkpoint is past its deadline; True if it fired."""
        with self._guard_lock:
            guard = self._guard
            if guard is None or (now if now is not None else time.monotonic()) < guard[0]:
                return False
            self._guard = None
        _deadline, what, ckpt = guard
        state = self.status.state
        message = (
            f"{what} was stuck in {state} for more than --checkpoint-timeout "
            f"{self.cfg.checkpoint_timeout:g}s; CRIU and vLLM were killed and the agent "
            "gave up (the liveness probe restarts the container)"
        )
        log.error("watchdog: %s", message)
        self.terminal = True  # from here the stuck flow changes nothing
        self.set_state("Failed", message)
        self.metrics.checkpoints.labels("failed").inc()
        self.reaper.kill_running()
        with contextlib.suppress(Exception):
            self.vllm.kill(remove_shm=True)
        removed = self._remove_partial(ckpt)
        if ckpt is not None:
            self.status.last_checkpoint = {
                "dir": str(ckpt),
                "ok": False,
                "reason": "watchdog",
                "error": message + removed,
            }
        self.flow_aborted.set()  # all recorded: the waiting request may answer
        return True

    def _remove_partial(self, ckpt: Path | None) -> str:
        """Remove a failed checkpoint's directory; a note for the status if that failed."""
        if ckpt is None or not os.path.lexists(ckpt):
            return ""
        if os.path.realpath(ckpt) != str(ckpt):  # never follow a symlink out of the root
            return f"; {ckpt} was not removed: it now resolves to {os.path.realpath(ckpt)}"
        try:
            immutable.remove_tree(ckpt)  # clears an immutable flag (weights, pages) first
        except OSError as e:
            log.warning("could not remove the partial checkpoint %s: %s", ckpt, e)
            return f"; the partial checkpoint {ckpt} could not be removed: {e}"
        return ""

    def _checkpoint_failed(self, ckpt: Path, err: checkpoint.CheckpointError) -> None:
        """Record why, remove what was written, and serve again (the same tree, or a new boot)."""
        if self.terminal:
            return  # the watchdog already ended it
        self.metrics.checkpoints.labels("failed").inc()
        error = str(err) + self._remove_partial(ckpt)
        self.status.last_checkpoint = {
            "dir": str(ckpt),
            "ok": False,
            "reason": err.reason,
            "error": error,
        }
        log.warning("checkpoint to %s failed (%s): %s", ckpt, err.reason, err)
        if self.status.state == "Failed":
            return  # vLLM could not be booted again: the liveness probe restarts the pod
        if err.serving and self.vllm.alive() and self._still_serves():
            self.set_state("Ready", f"checkpoint failed ({err.reason}), still serving: {err}")
            return
        self.vllm.kill(remove_shm=True)
        try:
            self.boot()
        except Exception as e:  # boot() already made the agent Failed
            log.error("booting vLLM after the failed checkpoint failed: %s", e)

    def _still_serves(self) -> bool:
        """vLLM answers a one-token completion (its engine survived what failed)."""
        try:
            self.control.wait_health(10, alive=self.vllm.alive)
            self.control.complete_one(self.cfg.served_name)
        except Exception as e:
            log.warning("vLLM does not serve after the failed checkpoint: %s", e)
            return False
        return True

    def space_problem(self, target: Path) -> str | None:
        """Why a checkpoint into target would not fit (checked before draining), or None.

        Through the node agent the dump goes to its cache, which keeps a budget
        of its own and evicts within it: nothing to check here.
        """
        if not self.backend.privileged:
            return None
        root = self.vllm.root_pid
        pids = proctree.tree(root) if root is not None and proctree.alive(root) else []
        shm = 0
        for name in shm_files.tree_shm_files(pids):
            with contextlib.suppress(OSError):
                shm += os.stat(os.path.join(shm_files.SHM, name)).st_blocks * 512
        on_device = space.weight_file_bytes(self.cfg.model) if self.cfg.device == "cuda" else 0
        needed = space.needed_bytes(space.anonymous_bytes(pids), shm, on_device)
        return space.problem(target, needed, space.free_bytes(target))

    def run_checkpoint(self, ckpt: Path) -> Manifest:
        """Called with the proxy drained (state Checkpointing). Dump, then prove by restoring.

        Raises CheckpointError (whatever went wrong), after the agent is back
        in a defined state: see _checkpoint_failed.
        """
        try:
            man = self._dump(ckpt)
        except Exception as e:
            err = (
                e
                if isinstance(e, checkpoint.CheckpointError)
                else checkpoint.CheckpointError(f"unexpected: {e!r}", serving=False)
            )
            if not isinstance(e, checkpoint.CheckpointError):
                log.exception("checkpoint to %s failed", ckpt)
            self._checkpoint_failed(ckpt, err)
            raise err from e
        self.metrics.observe_phases(self.metrics.checkpoint_phase_seconds, man["timings"])
        # Prove it: restore with the copying (stock) restore, so this pod's process
        # does not depend on the image files and can be checkpointed again.
        try:
            restored = self.restore_or_fallback(
                ckpt,
                require_verified=False,
                copy_why="proving a new checkpoint: a copied tree can be checkpointed again",
                then_ready=False,
            )
        except Exception as e:  # the fallback boot failed too: the agent is Failed
            err = checkpoint.CheckpointError(
                f"dumped, but restoring it failed, and so did booting vLLM again: {e}",
                serving=False,
                reason="verify_restore_failed",
            )
            self._checkpoint_failed(ckpt, err)
            raise err from e
        if not restored:
            fb = self.status.last_fallback or {}
            err = checkpoint.CheckpointError(
                f"dumped, but restoring it failed ({fb.get('reason')}): "
                f"{fb.get('message')}; vLLM was booted again",
                serving=True,
                reason="verify_restore_failed",
            )
            self._checkpoint_failed(ckpt, err)
            raise err
        try:
            self.backend.mark_verified(
                ckpt,
                man,
                {"restore_seconds": self.status.timings["restore"]},
                self.signing_key,
            )
        except (OSError, BackendError) as e:
            err = checkpoint.CheckpointError(
                f"recording the proof failed: {e}", reason=checkpoint.os_reason(e)
            )
            self._checkpoint_failed(ckpt, err)
            raise err from e
        if self.backend.privileged:
            protection = self._protect(ckpt, man)
            weights_protection = self._protect_weights(ckpt, man)
        else:
            protection = weights_protection = "node agent's cache: root-owned, sealed"
        self.metrics.checkpoints.labels("ok").inc()
        self.status.timings["checkpoint"] = dict(man["timings"])
        self.status.last_checkpoint = {
            "dir": str(ckpt),
            "ok": True,
            "timings": man["timings"],
            "images_protection": protection,
            "weights_protection": weights_protection,
        }
        if self.backend.published is not None:
            self.status.last_checkpoint["published"] = self.backend.published
        self.set_state("Ready", f"restored from {ckpt}")  # only now: the proof is recorded
        return man

    @staticmethod
    def _protect(ckpt: Path, man: Manifest) -> str:
        """Proven: every file 0400, the pages images immutable where the file system can."""
        not_read_only = manifest_io.make_read_only(ckpt, man["files"])
        if not_read_only:
            log.warning("could not make %s read-only: %s", ckpt, "; ".join(not_read_only[:5]))
        not_immutable = immutable.protect_pages(ckpt / IMAGES_SUBDIR)
        if not not_immutable:
            return "immutable"
        log.warning("pages images of %s not immutable: %s", ckpt, "; ".join(not_immutable[:3]))
        return f"read-only: {not_immutable[0]}"

    @staticmethod
    def _protect_weights(ckpt: Path, man: Manifest) -> str:
        """Proven: the weight dump immutable too, where the file system can.

        A reload maps the dump only when its data file carries the flag
        (weights_map.map_choice), so "read-only: ..." here means later restores from
        this checkpoint copy the weights instead of mapping them.
        """
        if not man["weights"].get("released"):
            return "none: no weight dump"
        failed = immutable.protect_weights(ckpt / WEIGHTS_SUBDIR)
        if not failed:
            return "immutable"
        log.warning("weight dump of %s not immutable: %s", ckpt, "; ".join(failed[:3]))
        return f"read-only: {failed[0]} (restores copy the weights, none maps them)"

    def _dump(self, ckpt: Path) -> Manifest:
        try:
            info = self.criu_info()
        except OSError as e:
            raise checkpoint.CheckpointError(str(e), reason="criu_failed") from e
        man = checkpoint.checkpoint(
            ckpt,
            self.vllm,
            self.control,
            info,
            self.cfg,
            self.fingerprint(),
            self.signing_key,
            backend=self.backend,
            agent_env=self.gpu_env,
        )
        self.status.weights_rpc = "available" if man["weights"]["released"] else "unavailable"
        return man

    def watch(self) -> None:
        """A vLLM that dies while Ready makes the agent Failed (liveness fails, pod restarts)."""
        while not self.stopping:
            time.sleep(0.5)
            self.check_watchdog()
            if (
                self.status.state == "Ready"
                and not self.flow_lock.locked()
                and not self.vllm.alive()
            ):
                code = self.vllm.exit_code(timeout=2)
                how = describe_exit(code)
                if code == -signal.SIGBUS and self.status.restored_with_mmap:
                    self._mapped_restore_failed()
                self.set_state("Failed", f"vLLM exited unexpectedly{how}; see {self.vllm.log_path}")

    def _mapped_restore_failed(self) -> None:
        """A tree restored with mapped memory died of SIGBUS: the one hazard of a mapped
        restore (a range grown, by mremap(), past a mapped run). Restores of that
        checkpoint copy from now on (the node agent keeps that), so the restarted
        container comes back, copied."""
        ckpt = self.status.checkpoint
        if not ckpt:
            return
        try:
            self.backend.mapped_failed(Path(ckpt), "vLLM exited (killed by SIGBUS)")
            log.warning("vLLM died of SIGBUS after a mapped restore from %s: restores copy", ckpt)
        except BackendError as e:
            log.warning("could not have restores of %s copy: %s", ckpt, e)

    def shutdown(self) -> None:
        self.stopping = True
        self.vllm.kill(remove_shm=True)
        self.reaper.stop()


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        # `[agent]` beside vLLM's `[vllm]` lines (vllm_process) in `kubectl logs`.
        format="[agent] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
