"""The restore's long poles, started before the agent's HTTP side exists.

Importing aiohttp and starting the servers takes the agent about a second
(more on a cold page cache); reading the checkpoint's images takes seconds
more when they are not cached. So prefetching (and the CRIU feature probe)
starts first thing in `rekindle agent`, and the restore picks up what is
already running.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rekindle_agent import criu, manifest, prefetch
from rekindle_agent.config import AgentConfig, normalize_checkpoint

_lock = threading.Lock()
_prefetchers: dict[str, prefetch.Prefetcher] = {}
_probes: dict[str, Future[criu.CriuInfo]] = {}


def begin(cfg: AgentConfig) -> None:
    ckpt = normalize_checkpoint(cfg.checkpoint)
    if ckpt and cfg.restore_policy != "never" and cfg.prefetch:
        try:
            man = manifest.read(Path(ckpt))
        except (manifest.ManifestError, OSError):
            man = None  # the restore will read it again and say why it is unusable
        if man is not None:
            with _lock:
                _prefetchers[str(Path(ckpt))] = prefetch.Prefetcher(
                    Path(ckpt),
                    man["files"],
                    threads=cfg.prefetch_threads,
                    verify=cfg.verify_checksums,
                )
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="criu-probe")
    with _lock:
        _probes[cfg.criu] = pool.submit(criu.probe, cfg.criu)
    pool.shutdown(wait=False)


def take_prefetcher(ckpt: Path) -> prefetch.Prefetcher | None:
    """The prefetch already running for ckpt (once), or None."""
    with _lock:
        return _prefetchers.pop(str(ckpt), None)


def probe(binary: str) -> criu.CriuInfo:
    with _lock:
        fut = _probes.get(binary)
    return fut.result() if fut is not None else criu.probe(binary)
