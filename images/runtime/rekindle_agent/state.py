"""The agent's state machine and the status document GET /v1/status returns."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rekindle_contract.api import (
    STATES,
    LastCheckpoint,
    Origin,
    RestoreMemoryDoc,
    SecurityDoc,
    State,
    StatusDoc,
)

# Allowed transitions; anything else is a bug in the agent, not a user error.
TRANSITIONS: dict[State, set[State]] = {
    "Booting": {"Ready", "Failed", "Booting", "Restoring"},  # Booting is also the start state
    "Restoring": {"Ready", "Booting", "Failed"},
    "Ready": {"Draining", "Failed", "Booting"},
    "Draining": {"Checkpointing", "Ready", "Failed"},
    "Checkpointing": {"Restoring", "Ready", "Booting", "Failed"},
    "Failed": {"Booting", "Restoring"},
}


class TransitionError(RuntimeError):
    pass


def check_transition(old: State, new: State) -> None:
    if new not in TRANSITIONS.get(old, set()):
        raise TransitionError(f"agent state {old} -> {new} is not allowed")


@dataclass
class Status:
    state: State = "Booting"
    origin: Origin = "none"
    restored_with_mmap: bool = False
    restore_memory: RestoreMemoryDoc | None = None  # the last restore's path and why
    checkpoint: str | None = None  # the checkpoint the running vLLM came from
    message: str = ""
    started_at: float = field(default_factory=time.time)
    # Wall clock of the last transition to Ready: ready_at - started_at is the
    # pod's cold start as the agent saw it (the operator's bench reports it).
    ready_at: float | None = None
    timings: dict[str, dict[str, float]] = field(default_factory=dict)  # boot/restore/checkpoint
    last_fallback: dict[str, Any] | None = None
    last_checkpoint: LastCheckpoint | None = None
    weights_rpc: str = "unknown"  # available | unavailable
    security: SecurityDoc = field(
        default_factory=lambda: SecurityDoc(
            checkpoint_signing="unsigned",
            signing_key_id=None,
            verify="blake3",
            serve_api_key=False,
            checkpoint_mount="none",
            admin_tls=False,
        )
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_state(self, new: State, message: str = "") -> None:
        with self._lock:
            check_transition(self.state, new)
            self.state = new
            self.message = message
            if new == "Ready":
                self.ready_at = time.time()

    def record_fallback(self, reason: str, message: str) -> None:
        with self._lock:
            self.last_fallback = {"reason": reason, "message": message, "at": time.time()}

    def to_json(self, vllm_pid: int | None = None, inflight: int = 0) -> StatusDoc:
        """The status document, with what the caller owns: vLLM's root PID, the proxy's count."""
        with self._lock:
            return {
                "state": self.state,
                "ready": self.state == "Ready",
                "origin": self.origin,
                "restored_with_mmap": self.restored_with_mmap,
                "restore_memory": RestoreMemoryDoc(**self.restore_memory)
                if self.restore_memory
                else None,
                "checkpoint": self.checkpoint,
                "message": self.message,
                "started_at": self.started_at,
                "ready_at": self.ready_at,
                "timings": {k: dict(v) for k, v in self.timings.items()},
                "last_fallback": self.last_fallback,
                "last_checkpoint": self.last_checkpoint,
                "weights_rpc": self.weights_rpc,
                "vllm_pid": vllm_pid,
                "inflight": inflight,
                "states": list(STATES),
                "security": SecurityDoc(**self.security),
                # Filled in by the admin server (it owns vmtouch and the lock).
                "residency": None,
                "resident_lock": None,
            }
