"""The agent's state machine and the status document GET /v1/status returns."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rekindle_contract import api

# Allowed transitions; anything else is a bug in the agent, not a user error.
TRANSITIONS: dict[str, set[str]] = {
    "Booting": {"Ready", "Failed", "Booting", "Restoring"},  # Booting is also the start state
    "Restoring": {"Ready", "Booting", "Failed"},
    "Ready": {"Draining", "Failed", "Booting"},
    "Draining": {"Checkpointing", "Ready", "Failed"},
    "Checkpointing": {"Restoring", "Ready", "Booting", "Failed"},
    "Failed": {"Booting", "Restoring"},
}


class TransitionError(RuntimeError):
    pass


def check_transition(old: str, new: str) -> None:
    if new not in TRANSITIONS.get(old, set()):
        raise TransitionError(f"agent state {old} -> {new} is not allowed")


@dataclass
class Status:
    state: str = "Booting"
    origin: str = "none"  # booted | restored
    restored_with_mmap: bool = False
    checkpoint: str | None = None  # the checkpoint the running vLLM came from
    message: str = ""
    started_at: float = field(default_factory=time.time)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)  # boot/restore/checkpoint
    last_fallback: dict[str, Any] | None = None
    last_checkpoint: dict[str, Any] | None = None
    weights_rpc: str = "unknown"  # available | unavailable (reason)
    vllm_pid: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_state(self, new: str, message: str = "") -> None:
        with self._lock:
            check_transition(self.state, new)
            self.state = new
            self.message = message

    def record_fallback(self, reason: str, message: str) -> None:
        with self._lock:
            self.last_fallback = {"reason": reason, "message": message, "at": time.time()}

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "state": self.state,
                "ready": self.state == "Ready",
                "origin": self.origin,
                "restored_with_mmap": self.restored_with_mmap,
                "checkpoint": self.checkpoint,
                "message": self.message,
                "started_at": self.started_at,
                "timings": {k: dict(v) for k, v in self.timings.items()},
                "last_fallback": self.last_fallback,
                "last_checkpoint": self.last_checkpoint,
                "weights_rpc": self.weights_rpc,
                "vllm_pid": self.vllm_pid,
                "states": list(api.STATES),
            }
