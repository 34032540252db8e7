"""Pre-warming: this node's verified cache gets a new checkpoint before a replica needs it.

The operator asks one serving replica per node (POST /v1/prewarm) once a checkpoint
of its service is in use; the replica's agent has its node agent pull it (from the
object store or the shared claim, every byte checked), in the background, retrying
while the store cannot be reached, so the next replica on this node restores from
the node's cache instead of waiting for a pull. Serving is not touched: a pull is
the node agent's work, and one runs at a time here.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rekindle_agent.checkpointing.criu_backend import BackendError, CriuBackend

log = logging.getLogger("rekindle.prewarm")

# A store that cannot be reached is retried (a node lost or restarted, a store being
# replaced); anything else (refused, bad bytes, no such checkpoint) ends the attempt.
RETRY_REASONS = ("store_unreachable", "unreachable")


@dataclass
class PrewarmState:
    """What the last pre-warm did (logged, and the route's answer)."""

    checkpoint: str = ""
    state: str = ""  # running | done | failed
    detail: dict[str, Any] = field(default_factory=dict)


class Prewarmer:
    def __init__(
        self,
        backend: CriuBackend,
        retry_s: float = 5.0,
        give_up_s: float = 600.0,
    ) -> None:
        self.backend = backend
        self.retry_s = retry_s
        self.give_up_s = give_up_s
        self.last = PrewarmState()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def supported(self, ckpt: Path) -> bool:
        return self.backend.can_prewarm(ckpt)

    def request(self, ckpt: Path) -> tuple[bool, PrewarmState]:
        """Start pre-warming ckpt unless it is running already; (started, the state)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False, self.last
            self.last = PrewarmState(str(ckpt), "running")
            self._thread = threading.Thread(
                target=self._run, args=(ckpt,), name="prewarm", daemon=True
            )
            self._thread.start()
            return True, self.last

    def wait(self, timeout: float) -> None:
        """Until the running pre-warm (if any) has finished (for tests and shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self, ckpt: Path) -> None:
        deadline = time.monotonic() + self.give_up_s
        while True:
            try:
                answer = self.backend.prewarm(ckpt)
            except BackendError as e:
                retry = e.reason in RETRY_REASONS and time.monotonic() < deadline
                if retry:
                    log.info("pre-warming %s: %s; trying again in %gs", ckpt, e, self.retry_s)
                    time.sleep(self.retry_s)
                    continue
                log.warning("pre-warming %s failed: %s", ckpt, e)
                self.last = PrewarmState(str(ckpt), "failed", {"reason": e.reason, "error": str(e)})
                return
            except Exception as e:  # a bug must not end the agent: say so
                log.exception("pre-warming %s failed", ckpt)
                self.last = PrewarmState(str(ckpt), "failed", {"error": repr(e)})
                return
            detail: dict[str, Any] = {
                k: answer[k] for k in ("bytes", "seconds", "copied") if k in answer
            }
            log.info("pre-warmed %s into this node's cache: %s", ckpt, detail)
            self.last = PrewarmState(str(ckpt), "done", detail)
            return
