"""The node's resident budget: its most recently used checkpoints kept in memory.

A replica restores several times faster from files in the page cache than from
the disk, and the node agent knows which checkpoints its node will restore next:
the ones it used last. One `vmtouch -l` child (rekindle_store.resident_lock)
locks them, most recently used first, within --resident-budget-gib; whenever
the cache changes (a checkpoint made, pulled, restored from or evicted) the lock
follows within a poll. Locked pages are charged to the node agent's memory
cgroup and cannot be reclaimed: a memory limit on the node agent must leave room
for the budget.
"""

from __future__ import annotations

import logging
import threading

from rekindle_store.node_cache import NodeCache
from rekindle_store.resident_lock import ResidentLock, within_budget

log = logging.getLogger("rekindle.node.resident")

POLL_S = 2.0


class NodeResidency:
    """Keeps cache's most recently used files locked within budget_bytes."""

    def __init__(self, cache: NodeCache, budget_bytes: int, binary: str | None = None) -> None:
        self.cache = cache
        self.lock = ResidentLock(budget_bytes, binary=binary)
        if self.lock.binary is None:
            log.warning("keep resident: vmtouch is not installed, nothing is kept")

    def follow_once(self) -> bool:
        """Lock what the budget holds now, if that changed; whether it relocked."""
        plan = self.cache.resident_plan()
        chosen, _ = within_budget(plan, self.lock.budget)
        if self.lock.binary is None or chosen == self.lock.files:
            return False  # a vmtouch that died keeps its files and says why (lock.why)
        log.info(
            "keep resident: %d file(s) of %d checkpoint(s), budget %d bytes",
            len(chosen),
            len({c.split("/", 1)[0] for c in chosen}),
            self.lock.budget,
        )
        self.lock.lock(str(self.cache.entries), plan, wait=0)
        return True

    def run(self, stop: threading.Event, every: float = POLL_S) -> None:
        """follow_once() every few seconds until stop is set; then unlock."""
        while not stop.is_set():
            try:
                self.follow_once()
            except Exception:  # a cache hint never takes the node agent down
                log.exception("keep resident: locking failed")
            stop.wait(every)
        self.lock.release()

    def kept(self) -> set[str]:
        """The entries with files locked now."""
        if self.lock.proc is None or self.lock.proc.poll() is not None:
            return set()
        return {f.split("/", 1)[0] for f in self.lock.files}
