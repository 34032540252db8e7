"""The restore's long poles, started before the agent's HTTP side exists.

Importing aiohttp and starting the servers takes the agent about a second
(more on a cold page cache); reading the checkpoint's images takes seconds
more when they are not cached. So `rekindle agent` creates an EarlyStart first
thing, which starts the prefetch (and the CRIU feature probe and the
fingerprint of this environment, and CRIU's kernel-feature cache: kdat_cache),
and hands it to the Agent: the restore picks up what is already running.

The prefetch starts only from a manifest that passed manifest_io.read (its
signature with the signing key, its structure, paths and modes), and the
restore then checks that same manifest, not a second read of the file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from rekindle_contract import node_api
from rekindle_contract.manifest import Manifest
from rekindle_store import manifest_io

from rekindle_agent.checkpointing import criu, fingerprint
from rekindle_agent.checkpointing.criu_backend import SOCKET_WAIT_S
from rekindle_agent.config import AgentConfig
from rekindle_agent.restoring import kdat_cache, prefetch
from rekindle_agent.supervision.vllm_launch import vllm_command

log = logging.getLogger("rekindle.early")
T = TypeVar("T")
# "off" keeps CRIU probing the kernel on every run (to compare, or to rule the cache out).
KDAT_CACHE_ENV = "REKINDLE_KDAT_CACHE"
# How long a CRIU run waits for its kdat cache: installing one takes milliseconds,
# making one (first run on a boot) about 0.1 s; past this CRIU just probes.
KDAT_WAIT_S = 3.0


def _in_background(name: str, fn: Callable[..., T], *args: Any) -> Future[T]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    fut = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return fut


class EarlyStart:
    """Prefetchers by checkpoint directory, CRIU probes by binary, the fingerprint; each once."""

    def __init__(self, signing_key: bytes | None = None) -> None:
        self.signing_key = signing_key
        self._lock = threading.Lock()
        self._prefetchers: dict[str, tuple[Manifest, prefetch.Prefetcher]] = {}
        self._probes: dict[str, Future[criu.CriuInfo]] = {}
        self._fingerprint: Future[dict[str, Any]] | None = None
        self._kdat: dict[str, Future[kdat_cache.Outcome]] = {}
        self._kdat_waited: set[str] = set()

    def begin(self, cfg: AgentConfig) -> None:
        """Start prefetching cfg's checkpoint (if it will be restored), probing its CRIU and
        fingerprinting this environment."""
        restoring = cfg.restore_from and cfg.restore_policy != "never"
        if restoring and cfg.prefetch and cfg.node_socket:
            # Through the node agent a restore reads the node's verified copy, never the
            # path (at most a published copy there, which only the node agent reads in).
            _in_background("prefetch", self._start_node_prefetch, Path(cfg.restore_from or ""), cfg)
        elif restoring and cfg.prefetch:
            self._start_prefetch(Path(cfg.restore_from or ""), cfg)
        with self._lock:
            if cfg.criu not in self._probes:
                self._probes[cfg.criu] = _in_background("criu-probe", criu.probe, cfg.criu)
            if cfg.criu not in self._kdat and os.environ.get(KDAT_CACHE_ENV, "") != "off":
                cache_dir = cfg.checkpoint_root or (
                    str(Path(cfg.restore_from).parent) if cfg.restore_from else None
                )
                self._kdat[cfg.criu] = _in_background(
                    "kdat", kdat_cache.prepare, cfg.criu, cache_dir, self.signing_key
                )
            if self._fingerprint is None:
                argv, env = vllm_command(cfg)
                self._fingerprint = _in_background(
                    "fingerprint", fingerprint.collect, cfg.model, argv, cfg.device, env
                )

    def _start_prefetch(self, ckpt: Path, cfg: AgentConfig) -> None:
        try:
            man = manifest_io.read(ckpt, self.signing_key, cfg.run_dir)
        except (manifest_io.ManifestError, OSError) as e:
            log.info("not prefetching %s: %s", ckpt, e)
            return  # the restore reads it again and says why it is unusable
        pre = prefetch.Prefetcher(
            ckpt, man["files"], threads=cfg.prefetch_threads, verify=cfg.verify_checksums
        )
        with self._lock:
            self._prefetchers[str(ckpt)] = (man, pre)

    def _start_node_prefetch(self, ckpt: Path, cfg: AgentConfig) -> None:
        """Warm the node's verified copy of ckpt, if this node holds it, while the agent
        starts: the restore's own `open` finds the same entry (named by its content).
        A checkpoint the node must pull first is left to the restore."""
        deadline = time.monotonic() + SOCKET_WAIT_S
        socket = cfg.node_socket or ""
        while not os.path.exists(socket) and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            _answer, fd = node_api.call(
                socket, "open", cfg.pod_uid or "", {"name": str(ckpt)}, timeout=30
            )
        except (node_api.NodeAgentError, OSError) as e:
            log.info("not prefetching %s early: %s", ckpt, e)
            return
        if fd is None:
            return
        root = Path(f"/proc/{os.getpid()}/fd/{fd}")  # held for the agent's life
        try:
            man = manifest_io.read(root, None, cfg.run_dir)  # verified by the node agent
        except (manifest_io.ManifestError, OSError) as e:
            log.info("not prefetching %s early: %s", ckpt, e)
            os.close(fd)
            return
        # Verified into root-only storage: the prefetcher only warms it.
        pre = prefetch.Prefetcher(root, man["files"], threads=cfg.prefetch_threads, verify="size")
        with self._lock:
            self._prefetchers[str(ckpt)] = (man, pre)

    def take_prefetcher(self, ckpt: Path) -> tuple[Manifest, prefetch.Prefetcher] | None:
        """The manifest and the prefetch already running for ckpt (once), or None."""
        with self._lock:
            return self._prefetchers.pop(str(ckpt), None)

    def criu_info(self, binary: str) -> criu.CriuInfo:
        """What binary can do: from the probe started early, or one started now (cached).

        Callers run CRIU next, so this also waits (briefly) for the kdat cache begin()
        started for binary: CRIU then skips its kernel probe.
        """
        with self._lock:
            fut = self._probes.get(binary)
            if fut is None:
                fut = self._probes[binary] = _in_background("criu-probe", criu.probe, binary)
            kdat = None if binary in self._kdat_waited else self._kdat.get(binary)
            self._kdat_waited.add(binary)
        info = fut.result()
        if kdat is not None:
            self._log_kdat(kdat)
        return info

    def _log_kdat(self, fut: Future[kdat_cache.Outcome]) -> None:
        try:
            out = fut.result(timeout=KDAT_WAIT_S)
        except Exception as e:  # a cache must never stop a restore or a checkpoint
            log.warning("CRIU kdat cache not ready, CRIU probes the kernel: %s", e)
            return
        log.info("CRIU kdat cache %s %s (%s)", out.action, out.path, out.detail)

    def kdat_outcome(self, binary: str) -> kdat_cache.Outcome | None:
        """What the kdat cache step for binary did, once done (None if not started or running)."""
        with self._lock:
            fut = self._kdat.get(binary)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return fut.result()

    def fingerprint(self) -> dict[str, Any] | None:
        """The fingerprint begin() started computing (None if it was not started)."""
        with self._lock:
            fut = self._fingerprint
        return None if fut is None else dict(fut.result())
