"""The restore's long poles, started before the agent's HTTP side exists.

Importing aiohttp and starting the servers takes the agent about a second
(more on a cold page cache); reading the checkpoint's images takes seconds
more when they are not cached. So `rekindle agent` creates an EarlyStart first
thing, which starts the prefetch (and the CRIU feature probe), and hands it to
the Agent: the restore picks up what is already running.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rekindle_agent import criu, manifest_io, prefetch
from rekindle_agent.config import AgentConfig


def _probe_in_background(binary: str) -> Future[criu.CriuInfo]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="criu-probe")
    fut = pool.submit(criu.probe, binary)
    pool.shutdown(wait=False)
    return fut


class EarlyStart:
    """Prefetchers by checkpoint directory and CRIU probes by binary, each used once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prefetchers: dict[str, prefetch.Prefetcher] = {}
        self._probes: dict[str, Future[criu.CriuInfo]] = {}

    def begin(self, cfg: AgentConfig) -> None:
        """Start prefetching cfg's checkpoint (if it will be restored) and probing its CRIU."""
        if cfg.checkpoint and cfg.restore_policy != "never" and cfg.prefetch:
            self._start_prefetch(Path(cfg.checkpoint), cfg)
        with self._lock:
            if cfg.criu not in self._probes:
                self._probes[cfg.criu] = _probe_in_background(cfg.criu)

    def _start_prefetch(self, ckpt: Path, cfg: AgentConfig) -> None:
        try:
            man = manifest_io.read(ckpt)
        except (manifest_io.ManifestError, OSError):
            return  # the restore reads it again and says why it is unusable
        pre = prefetch.Prefetcher(
            ckpt, man["files"], threads=cfg.prefetch_threads, verify=cfg.verify_checksums
        )
        with self._lock:
            self._prefetchers[str(ckpt)] = pre

    def take_prefetcher(self, ckpt: Path) -> prefetch.Prefetcher | None:
        """The prefetch already running for ckpt (once), or None."""
        with self._lock:
            return self._prefetchers.pop(str(ckpt), None)

    def criu_info(self, binary: str) -> criu.CriuInfo:
        """What binary can do: from the probe started early, or one started now (cached)."""
        with self._lock:
            fut = self._probes.get(binary)
            if fut is None:
                fut = self._probes[binary] = _probe_in_background(binary)
        return fut.result()
