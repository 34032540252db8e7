"""The node's verified checkpoint cache: verify once, restore many times.

Layout under the cache root (root-owned, 0700, on no tenant's volume):

    entries/<entry>/            a checkpoint copied by verified_copy, read-only
    entries/<entry>/.entry.json what was verified: when, on which boot, from where
    pins/<entry>/<holder>       a replica using the entry (a mapped restore maps
                                its files: it must outlive the replica)
    staging/                    copies in progress (removed at start)
    pulls/<entry>/              pulls from an object store in progress (resumed in the
                                same boot; files are checked as they land)

An entry's name is a content address: the SHA-256 of the signed manifest
without its `verified` record and signature, so the same checkpoint published
twice is one entry, and a changed one is another. An entry written before the
machine last booted is not trusted (its pages may never have reached the disk)
and is copied again. The cache keeps to a byte budget by evicting the least
recently used entries that nothing pins.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rekindle_contract.manifest import MANIFEST_NAME, VERIFIED_NAME, Manifest

from rekindle_store import manifest_io, object_copy, page_cache, signing, verified_copy
from rekindle_store.verified_copy import CopyError

ENTRY_RECORD = ".entry.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    return BOOT_ID.read_text().strip()


def entry_name(manifest_bytes: bytes) -> str:
    """The content address of a checkpoint: its manifest minus `verified` and the signature."""
    doc = json.loads(manifest_bytes)
    doc.pop("verified", None)
    return hashlib.sha256(signing.canonical(doc)).hexdigest()[:32]


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint whose every byte was checked, in storage no tenant can write.

    The one object a restore consumes: CRIU, the /dev/shm restore, the mmap
    restore and the weight reload read below `path`, nowhere else.
    """

    entry: str
    path: Path
    manifest: Manifest
    bytes: int
    copied: bool  # False: it was in the cache already (verified before, this boot)
    seconds: float  # spent verifying now (0 when it was cached)


@dataclass(frozen=True)
class EntryReport:
    """What `status` says per checkpoint on this node."""

    entry: str
    source: str
    bytes: int
    verified_at: float
    last_used: float
    resident_pct: float
    pinned_by: list[str]


class NodeCache:
    """Verified checkpoints under one root, within a byte budget."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget = budget_bytes
        self.entries = root / "entries"
        self.pins = root / "pins"
        self.staging = root / "staging"
        self.aliases = root / "names"
        self.copy_only_dir = root / "copy-only"
        self.pulls = root / "pulls"
        self._lock = threading.Lock()  # one copy or eviction at a time
        for d in (root, self.entries, self.pins, self.aliases):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(mode=0o700)
        self._drop_stale_pulls()

    def _drop_stale_pulls(self) -> None:
        """Remove pulls cut before this boot (a node lost mid-pull): their journal no
        longer vouches for bytes that may never have reached the disk, so they would
        start over anyway, and a checkpoint nobody asks for again would hold its bytes
        outside the budget forever. A pull of this boot stays: it resumes."""
        if not self.pulls.is_dir():
            return
        boot = boot_id()
        for stage in self.pulls.iterdir():
            if object_copy.journal_boot(stage) != boot:
                _remove(stage)

    def get(
        self,
        source: Path | int,
        key: bytes | None,
        run_dir: str | None = None,
        threads: int = 4,
        where: str = "",
    ) -> VerifiedCheckpoint:
        """The verified copy of the checkpoint published at source: cached, or copied now.

        source: a path, or a directory descriptor opened without following links
        (where names it). Raises CopyError when the source fails a check or the
        budget cannot hold it.
        """
        where = where or str(source)
        dir_fd = os.dup(source) if isinstance(source, int) else verified_copy.open_dir(source)
        try:
            manifest, raw = verified_copy.read_manifest(dir_fd, where, key, run_dir)
        finally:
            os.close(dir_fd)
        name = entry_name(raw)
        with self._lock:
            cached = self._cached(name, key, run_dir)
            if cached is not None:
                return cached
            need = sum(int(f["size"]) for f in manifest.get("files", []))
            self._make_room(need, name)
            stage = Path(tempfile.mkdtemp(prefix=name + ".", dir=self.staging))
            os.rmdir(stage)
            try:
                result = verified_copy.copy_verified(
                    source, stage, key, run_dir, threads, where=where
                )
                if entry_name(result.manifest_bytes) != name:
                    raise CopyError(
                        "checksum_mismatch", f"{where}: the manifest changed while it was copied"
                    )
                return self._admit(stage, name, where, result)
            except BaseException:
                _remove(stage)
                raise

    def get_from_store(
        self,
        loc: object_copy.StoreLocation,
        key: bytes,
        threads: int = 8,
        on_progress: Callable[[int], None] | None = None,
    ) -> VerifiedCheckpoint:
        """The verified copy of the checkpoint published at loc in an object store:
        cached, or pulled now (parallel ranged reads, each file checked as it lands).

        A pull that fails half-way keeps what it verified under pulls/ (this boot
        only) and the next call for the same checkpoint resumes from there.
        Raises CopyError (store_unreachable, no_checkpoint, checksum_mismatch,
        cache_full, or the manifest's own reasons).
        """
        manifest, raw = object_copy.read_manifest(loc, key, None)
        name = entry_name(raw)
        with self._lock:
            cached = self._cached(name, key, None)
            if cached is not None:
                return cached
            need = sum(int(f["size"]) for f in manifest.get("files", []))
            self._make_room(need, name)
            self.pulls.mkdir(mode=0o700, exist_ok=True)
            stage = self.pulls / name
            try:
                result = object_copy.pull_files(
                    loc, manifest, raw, stage, True, boot_id(), threads, on_progress
                )
            except CopyError as e:
                if e.reason != "store_unreachable":
                    _remove(stage)  # nothing of a bad or missing object is kept
                raise
            try:
                return self._admit(stage, name, str(loc), result)
            except BaseException:
                _remove(stage)
                raise

    def _admit(
        self, stage: Path, name: str, source: str, result: verified_copy.CopyResult
    ) -> VerifiedCheckpoint:
        """Make the checked copy in stage the entry name (the lock is held)."""
        record = {
            "source": source,
            "boot_id": boot_id(),
            "verified_at": time.time(),
            "bytes": result.bytes,
        }
        _write_ro(stage / ENTRY_RECORD, json.dumps(record).encode())
        _seal(stage)
        dest = self.entries / name
        _remove(dest)
        os.rename(stage, dest)
        self._touch(name)
        return VerifiedCheckpoint(
            entry=name,
            path=dest,
            manifest=result.manifest,
            bytes=result.bytes,
            copied=True,
            seconds=result.seconds,
        )

    def new_staging(self) -> Path:
        """A fresh directory (0700) to write a checkpoint into before add_own()."""
        return Path(tempfile.mkdtemp(prefix="own.", dir=self.staging))

    def add_own(self, stage: Path, source: str, key: bytes | None) -> VerifiedCheckpoint:
        """Take in a checkpoint the node agent wrote itself into stage (new_staging()).

        Its manifest lists digests of what was written, taken as it was written:
        nothing else wrote there (a root-only directory), so it enters the cache
        without a second read.
        """
        raw = (stage / MANIFEST_NAME).read_bytes()
        manifest = _parse_own(stage, key, None)
        name = entry_name(raw)
        size = sum(int(f["size"]) for f in manifest.get("files", []))
        with self._lock:
            try:
                self._make_room(size, name)
                record = {
                    "source": source,
                    "boot_id": boot_id(),
                    "verified_at": time.time(),
                    "bytes": size,
                }
                _write_ro(stage / ENTRY_RECORD, json.dumps(record).encode())
                for f in stage.rglob("*"):
                    if f.is_file():
                        os.chmod(f, 0o444)
                _seal(stage)
                dest = self.entries / name
                _remove(dest)
                os.rename(stage, dest)
            except BaseException:
                _remove(stage)
                raise
            self._touch(name)
        return VerifiedCheckpoint(
            entry=name, path=dest, manifest=manifest, bytes=size, copied=False, seconds=0.0
        )

    def lookup(
        self, name: str, key: bytes | None, run_dir: str | None = None
    ) -> VerifiedCheckpoint | None:
        """The cached entry name (None: not here, or from an earlier boot)."""
        if not re.fullmatch(r"[0-9a-f]{32}", name):
            return None
        with self._lock:
            return self._cached(name, key, run_dir)

    def name(self, namespace: str, name: str, entry: str) -> None:
        """Call entry name within namespace (a pod asks for its checkpoints by the name
        its operator gave them; a name in one namespace never reaches another's entry)."""
        d = self.aliases / namespace
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = d / (_name_key(name) + ".tmp")
        tmp.write_text(json.dumps({"name": name, "entry": entry}))
        os.replace(tmp, d / _name_key(name))

    def resolve(self, namespace: str, name: str) -> str | None:
        """The entry namespace calls name (None: no such name, or its entry is gone)."""
        try:
            doc = json.loads((self.aliases / namespace / _name_key(name)).read_text())
        except (OSError, ValueError):
            return None
        entry = str(doc.get("entry", ""))
        return entry if doc.get("name") == name and (self.entries / entry).is_dir() else None

    def mark_verified(self, entry: str, details: dict[str, Any], key: bytes) -> None:
        """Record in the entry's (re-signed) manifest that a restore from it served."""
        path = self.entries / entry
        with self._lock:
            manifest = _parse_own(path, key, None)
            manifest_io.mark_verified(path, manifest, details, key)
            # Readable by the pods the entry's descriptor is handed to (manifest_io writes 0600).
            os.chmod(path / MANIFEST_NAME, 0o444)
            os.chmod(path / VERIFIED_NAME, 0o444)

    def drop(self, entry: str) -> bool:
        """Remove entry unless a replica maps it (pinned); whether it was removed."""
        with self._lock:
            if self.pinned_by(entry) or not (self.entries / entry).is_dir():
                return False
            _remove(self.entries / entry)
            return True

    def set_copy_only(self, entry: str, why: str) -> None:
        """Restores of entry copy its memory from now on (a mapped restore of it failed)."""
        self.copy_only_dir.mkdir(mode=0o700, exist_ok=True)
        (self.copy_only_dir / entry).write_text(why[:1000])

    def copy_only(self, entry: str) -> str | None:
        """Why entry must not be mapped (None: it may be)."""
        try:
            return (self.copy_only_dir / entry).read_text()
        except OSError:
            return None

    def unpin_holder(self, holder: str) -> None:
        """holder is gone (its pod ended): it maps nothing any more."""
        for d in self.pins.iterdir():
            (d / holder).unlink(missing_ok=True)

    def _cached(
        self, name: str, key: bytes | None, run_dir: str | None
    ) -> VerifiedCheckpoint | None:
        path = self.entries / name
        record = self._record(name)
        if record is None:
            return None
        if record.get("boot_id") != boot_id():
            _remove(path)  # written before this boot: pages may be lost, copy again
            return None
        # Our own copy, in a root-only directory: its manifest is parsed, not re-hashed.
        manifest = _parse_own(path, key, run_dir)
        self._touch(name)
        return VerifiedCheckpoint(
            entry=name,
            path=path,
            manifest=manifest,
            bytes=int(record.get("bytes", 0)),
            copied=False,
            seconds=0.0,
        )

    def _record(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.entries / name / ENTRY_RECORD).read_bytes())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _touch(self, name: str) -> None:
        os.utime(self.entries / name / ENTRY_RECORD)

    def _size(self, name: str) -> int:
        record = self._record(name)
        return int(record.get("bytes", 0)) if record else 0

    def names(self) -> list[str]:
        return sorted(p.name for p in self.entries.iterdir() if p.is_dir())

    def resident_plan(self) -> list[tuple[str, int]]:
        """Every entry's files (paths under entries/, sizes) in the order a resident
        budget keeps them: the most recently used entry first (the next replica's
        likeliest restore), and in each its smallest files first (CRIU's images, which
        a restore parses before it maps the memory pages and reloads the weights)."""
        out: list[tuple[str, int]] = []
        for name in sorted(self.names(), key=self._last_used, reverse=True):
            files = []
            for f in (self.entries / name).rglob("*"):
                try:
                    if f.is_file() and not f.is_symlink():
                        files.append((str(f.relative_to(self.entries)), f.stat().st_size))
                except OSError:  # evicted while listed
                    continue
            out += sorted(files, key=lambda f: (f[1], f[0]))
        return out

    def pin(self, name: str, holder: str) -> None:
        """Keep entry name while holder (a replica mapping its files) lives."""
        d = self.pins / name
        d.mkdir(mode=0o700, exist_ok=True)
        (d / holder).touch()

    def unpin(self, name: str, holder: str) -> None:
        (self.pins / name / holder).unlink(missing_ok=True)

    def pinned_by(self, name: str) -> list[str]:
        d = self.pins / name
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def _make_room(self, need: int, keep: str) -> None:
        """Evict least recently used, unpinned entries until need fits the budget."""
        if need > self.budget:
            raise CopyError(
                "cache_full",
                f"the checkpoint needs {need} bytes, the node cache's budget is {self.budget}: "
                "raise the node agent's cache budget",
            )
        used = {n: self._size(n) for n in self.names()}
        total = sum(used.values())
        lru = sorted(used, key=self._last_used)
        for name in lru:
            if total + need <= self.budget:
                return
            if name == keep or self.pinned_by(name):
                continue
            _remove(self.entries / name)
            total -= used[name]
        if total + need > self.budget:
            raise CopyError(
                "cache_full",
                f"the node cache holds {total} bytes of checkpoints in use and its budget is "
                f"{self.budget}: {need} more do not fit; raise the budget or stop replicas",
            )

    def _last_used(self, name: str) -> float:
        try:
            return (self.entries / name / ENTRY_RECORD).stat().st_mtime
        except OSError:
            return 0.0

    def report(self, names: list[str] | None = None) -> list[EntryReport]:
        """Per entry (names: only these; default all): residency measured now."""
        out = []
        for name in self.names() if names is None else names:
            record = self._record(name) or {}
            total = resident = 0
            for f in (self.entries / name).rglob("*"):
                if f.is_file() and not f.is_symlink():
                    r, t = page_cache.mincore_pages(f)
                    resident, total = resident + r, total + t
            out.append(
                EntryReport(
                    entry=name,
                    source=str(record.get("source", "")),
                    bytes=int(record.get("bytes", 0)),
                    verified_at=float(record.get("verified_at", 0.0)),
                    last_used=self._last_used(name),
                    resident_pct=round(100.0 * resident / total, 1) if total else 0.0,
                    pinned_by=self.pinned_by(name),
                )
            )
        return out

    def report_json(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.report(names)]


def _name_key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def _parse_own(path: Path, key: bytes | None, run_dir: str | None) -> Manifest:
    fd = verified_copy.open_dir(path)
    try:
        return verified_copy.read_manifest(fd, str(path), key, run_dir)[0]
    finally:
        os.close(fd)


def _write_ro(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _seal(root: Path) -> None:
    """Directories read-only too: nothing is added to or removed from a verified copy."""
    for d, _subdirs, _files in os.walk(root, topdown=False):
        os.chmod(d, 0o555)


def _remove(path: Path) -> None:
    """Remove a (sealed) tree: directories are made writable first."""
    if not path.exists():
        return
    for d, _subdirs, _files in os.walk(path):
        os.chmod(d, 0o700)
    shutil.rmtree(path, ignore_errors=True)
