"""Checkpoints in an S3-compatible object store: published once, pulled verified.

One published checkpoint under the store's prefix:

    PREFIX/NAMESPACE/NAME/data/PATH       each file its manifest lists
    PREFIX/NAMESPACE/NAME/manifest.json   written last: the checkpoint exists once it does

The store is a transport, never trusted: whoever holds its credentials can
change any object. A pull therefore reads the manifest first (bounded, checked
against the fleet's signing key), then every listed file with parallel ranged
GETs; each range is received straight into the staging file's mapping (a
root-only staging directory; socket to page cache, no copy in between) and
hashed in file order as soon as the ranges before it are in, so a file is
verified the moment its last byte lands and nothing unverified ever leaves
staging. An interrupted pull (the node agent restarted, the store went away)
resumes: a journal records how far each file was verified; on the next pull of
the same checkpoint in the same boot the verified prefix is re-hashed from the
local disk (cheap next to the network) and the rest fetched.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rekindle_contract.manifest import MANIFEST_NAME, VERIFIED_NAME, FileEntry, Manifest

from rekindle_store import digests, manifest_io
from rekindle_store.s3 import Bucket, S3Error
from rekindle_store.verified_copy import CREATE_NEW, CopyError, CopyResult, expected_digest

PART_BYTES = 16 << 20  # one ranged GET, one part of a multipart upload
JOURNAL = ".pull.json"
DATA = "data"
DONE = -1  # a journal's mark for a file fetched whole and checked
_OPEN_STAGED = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_ZERO_PART = bytes(PART_BYTES)


@dataclass(frozen=True)
class StoreLocation:
    """Where one checkpoint lives in a bucket."""

    bucket: Bucket
    prefix: str  # PREFIX/NAMESPACE/NAME/, ends with /

    @staticmethod
    def of(bucket: Bucket, root: str, namespace: str, name: str) -> StoreLocation:
        """The location of checkpoint name (its directory's last component) of namespace."""
        base = name.rstrip("/").rsplit("/", 1)[-1]
        for part, what in ((namespace, "namespace"), (base, "checkpoint name")):
            if not part or part in (".", "..") or "/" in part:
                raise CopyError("bad_request", f"{part!r}: not a usable {what}")
        root = root.strip("/")
        return StoreLocation(bucket, f"{root + '/' if root else ''}{namespace}/{base}/")

    @property
    def manifest_key(self) -> str:
        return self.prefix + MANIFEST_NAME

    def data_key(self, rel: str) -> str:
        return f"{self.prefix}{DATA}/{rel}"

    def __str__(self) -> str:
        return f"{self.bucket.endpoint}/{self.bucket.bucket}/{self.prefix}"


@dataclass(frozen=True)
class Published:
    files: int
    bytes: int
    seconds: float


def _store_error(e: S3Error, where: str) -> CopyError:
    if e.unreachable:
        return CopyError("store_unreachable", f"{where}: the object store did not answer: {e}")
    if e.status == 404:
        return CopyError("no_checkpoint", f"{where}: not in the object store ({e.code})")
    return CopyError("store_error", f"{where}: {e}")


# -- publish -------------------------------------------------------------------------


def publish(entry: Path, loc: StoreLocation, threads: int = 8) -> Published:
    """Upload the verified checkpoint directory entry to loc, its manifest last.

    Small files go up whole, large ones as multipart uploads; every PUT (a file
    or a part) runs on one pool of threads. Refused (CopyError "exists") when
    loc holds a checkpoint already: one is published once, so a pull never
    mixes two.
    """
    t0 = time.monotonic()
    raw = (entry / MANIFEST_NAME).read_bytes()
    files: list[FileEntry] = json.loads(raw).get("files", [])
    uploads: dict[str, str] = {}  # key -> multipart upload id
    try:
        if loc.bucket.head(loc.manifest_key) is not None:
            raise CopyError("exists", f"{loc}: a checkpoint is published there already")
        jobs: list[tuple[str, Path, int, int]] = []  # (key, file, part number or 0, offset)
        for f in files:
            key, path = loc.data_key(f["path"]), entry / f["path"]
            if f["size"] <= PART_BYTES:
                jobs.append((key, path, 0, 0))
                continue
            uploads[key] = loc.bucket.start_upload(key)
            jobs += [(key, path, n, off) for n, off in _parts(f["size"])]
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="publish") as pool:
            etags = list(pool.map(lambda job: _put(loc.bucket, uploads, *job), jobs))
        parts: dict[str, list[str]] = {key: [] for key in uploads}
        for (key, _path, n, _off), etag in zip(jobs, etags, strict=True):
            if n:
                parts[key].append(etag)  # jobs hold each file's parts in order
        for key, upload in uploads.items():
            loc.bucket.finish_upload(key, upload, parts[key])
        uploads.clear()
        loc.bucket.put(loc.manifest_key, raw)
    except S3Error as e:
        raise _store_error(e, str(loc)) from e
    finally:
        for key, upload in uploads.items():  # left unfinished: free the server's parts
            with contextlib.suppress(S3Error):
                loc.bucket.abort_upload(key, upload)
    size = sum(f["size"] for f in files)
    return Published(files=len(files), bytes=size, seconds=time.monotonic() - t0)


def _parts(size: int) -> Iterator[tuple[int, int]]:
    yield from enumerate(range(0, size, PART_BYTES), start=1)


def _put(bucket: Bucket, uploads: dict[str, str], key: str, path: Path, n: int, off: int) -> str:
    """PUT one file whole (n 0) or part n of it, read from offset off; its ETag."""
    with open(path, "rb") as fh:
        fh.seek(off)
        body = fh.read(PART_BYTES if n else -1)
    return bucket.put_part(key, uploads[key], n, body) if n else bucket.put(key, body)


def delete(loc: StoreLocation) -> int:
    """Remove a published checkpoint (its manifest first: a pull never sees half of one);
    the number of objects removed."""
    try:
        keys = [o.key for o in loc.bucket.list_objects(loc.prefix)]
        keys.sort(key=lambda k: k != loc.manifest_key)
        for k in keys:
            loc.bucket.delete(k)
    except S3Error as e:
        raise _store_error(e, str(loc)) from e
    return len(keys)


# -- pull ----------------------------------------------------------------------------


def read_manifest(
    loc: StoreLocation, key: bytes | None, run_dir: str | None
) -> tuple[Manifest, bytes]:
    """The published manifest, read bounded and checked (signature, paths)."""
    try:
        raw = loc.bucket.get(loc.manifest_key, limit=manifest_io.MAX_MANIFEST_BYTES)
    except S3Error as e:
        raise _store_error(e, str(loc)) from e
    try:
        return manifest_io.parse(raw, f"{loc}{MANIFEST_NAME}", key, run_dir), raw
    except manifest_io.ManifestError as e:
        raise CopyError(e.reason, str(e)) from e


@dataclass
class _FileState:
    entry: FileEntry
    fd: int
    hasher: digests.Hasher
    algo: str
    want: str
    verified: int  # bytes hashed so far, in order
    mapped: mmap.mmap | None = None  # the staging file, shared and writable, while fetched
    view: memoryview | None = None  # of mapped: ranges are received into slices of it

    def map(self) -> memoryview:
        """The file's bytes, writable in place (mapped on first use)."""
        if self.view is None:
            self.mapped = mmap.mmap(self.fd, self.entry["size"], mmap.MAP_SHARED)
            self.view = memoryview(self.mapped)
        return self.view

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
        if self.mapped is not None:
            self.mapped.close()
        os.close(self.fd)


def journal_boot(stage: Path) -> str | None:
    """The boot a pull's journal was written in (None: no journal)."""
    try:
        doc = json.loads((stage / JOURNAL).read_text())
    except (OSError, ValueError):
        return None
    return str(doc.get("boot_id")) if isinstance(doc, dict) else None


class _Journal:
    """How far each file of a pull was verified, on the local disk beside the files."""

    def __init__(self, stage: Path, boot: str) -> None:
        self.path = stage / JOURNAL
        self.boot = boot
        self.done: dict[str, int] = {}
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            doc = {}
        if isinstance(doc, dict) and doc.get("boot_id") == boot:
            self.done = {str(k): int(v) for k, v in dict(doc.get("verified", {})).items()}

    def record(self, rel: str, verified: int) -> None:
        self.done[rel] = verified
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"boot_id": self.boot, "verified": self.done}))
        os.replace(tmp, self.path)


def pull_files(
    loc: StoreLocation,
    manifest: Manifest,
    raw: bytes,
    stage: Path,
    signed: bool,
    boot: str,
    threads: int = 8,
    on_progress: Callable[[int], None] | None = None,
) -> CopyResult:
    """Fetch every file manifest lists into stage (kept between attempts: a pull
    resumes), verified as it arrives; then the manifest (the exact bytes checked)
    and, for a proven checkpoint, its proof marker from the signed record.

    Raises CopyError: store_unreachable (try again later: the journal keeps
    what was verified), no_checkpoint (an object is missing), checksum_mismatch
    (the store's bytes are not what was signed; that file's progress is dropped).
    """
    t0 = time.monotonic()
    stage.mkdir(mode=0o700, exist_ok=True)
    journal = _Journal(stage, boot)
    entries = sorted(manifest.get("files", []), key=lambda e: -e["size"])
    states: dict[str, _FileState] = {}
    try:
        for f in entries:
            states[f["path"]] = _open_state(stage, f, journal, signed)
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="pull") as pool:
            window: deque[tuple[_FileState, int, Future[int]]] = deque()
            for st, start, end in _ranges(states.values()):
                st.map()
                window.append((st, start, pool.submit(_fetch, loc, st, start, end)))
                if len(window) > threads * 2:
                    _consume(window.popleft(), journal, loc, on_progress)
            while window:
                _consume(window.popleft(), journal, loc, on_progress)
        for st in states.values():
            _finish_file(st, loc, journal)
    except S3Error as e:
        raise _store_error(e, str(loc)) from e
    finally:
        for st in states.values():
            st.close()
    _write_once(stage / MANIFEST_NAME, raw)
    if signed and isinstance(manifest.get("verified"), dict):
        record = json.dumps(manifest["verified"], sort_keys=True) + "\n"
        _write_once(stage / VERIFIED_NAME, record.encode())
    (stage / JOURNAL).unlink(missing_ok=True)
    return CopyResult(
        manifest=manifest,
        manifest_bytes=raw,
        files=len(entries),
        bytes=sum(e["size"] for e in entries),
        seconds=time.monotonic() - t0,
    )


def _open_state(stage: Path, f: FileEntry, journal: _Journal, signed: bool) -> _FileState:
    algo, want = expected_digest(f, signed)
    rel = f["path"]
    path = stage / rel
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    hasher = digests.new(algo)
    size = f["size"]
    progress = journal.done.get(rel, 0)
    if progress and path.is_file() and not path.is_symlink():
        fd = os.open(path, _OPEN_STAGED)
        if progress == DONE and os.fstat(fd).st_size == size:
            return _FileState(f, fd, hasher, algo, want, size)  # checked in this boot
        verified = _rehash(fd, max(0, min(progress, size)), hasher)
        os.ftruncate(fd, verified)  # drop whatever was written past the checked prefix
    else:
        path.unlink(missing_ok=True)
        fd = os.open(path, _OPEN_STAGED | os.O_CREAT | os.O_EXCL, 0o600)
        verified = 0
    journal.done[rel] = verified
    os.ftruncate(fd, size)  # the whole length, so it can be mapped and received into
    return _FileState(f, fd, hasher, algo, want, verified)


def _rehash(fd: int, upto: int, hasher: digests.Hasher) -> int:
    """Feed the first upto bytes of our own staging file to hasher (a resumed pull)."""
    off = 0
    while off < upto:
        chunk = os.pread(fd, min(PART_BYTES, upto - off), off)
        if not chunk:
            break
        hasher.update(chunk)
        off += len(chunk)
    return off


def _ranges(states: Iterable[_FileState]) -> Iterator[tuple[_FileState, int, int]]:
    for st in states:
        size = st.entry["size"]
        for start in range(st.verified, size, PART_BYTES):
            yield st, start, min(start + PART_BYTES, size)


def _fetch(loc: StoreLocation, st: _FileState, start: int, end: int) -> int:
    """Receive bytes [start, end) of st's object into its mapping; how many came."""
    view = st.map()[start:end]
    try:
        got = loc.bucket.get_into(loc.data_key(st.entry["path"]), start, view)
    finally:
        view.release()
    if got != end - start:
        raise CopyError(
            "checksum_mismatch",
            f"{loc}{DATA}/{st.entry['path']}: {got} bytes at {start}, "
            f"{end - start} expected (the object is shorter than the manifest says)",
        )
    return got


def _consume(
    item: tuple[_FileState, int, Future[int]],
    journal: _Journal,
    loc: StoreLocation,
    on_progress: Callable[[int], None] | None,
) -> None:
    st, start, fut = item
    got = fut.result()
    if start != st.verified:  # ranges are consumed in order: never happens
        raise CopyError("checksum_mismatch", f"{st.entry['path']}: range {start} out of order")
    view = st.map()[start : start + got]
    try:
        st.hasher.update(view)  # the bytes as they are in the file now: what runs
        if _all_zero(view):  # a hole again (checkpoint pages can hold long runs of zeroes)
            assert st.mapped is not None
            with contextlib.suppress(OSError):  # a filesystem that cannot punch holes
                st.mapped.madvise(mmap.MADV_REMOVE, start, got)
    finally:
        view.release()
    st.verified += got
    if st.verified == st.entry["size"]:
        _finish_file(st, loc, journal)
    else:
        journal.record(st.entry["path"], st.verified)
    if on_progress is not None:
        on_progress(got)


def _all_zero(view: memoryview) -> bool:
    """Whether a received range is all zeroes: its first page first (data almost always
    differs there), then the whole, compared as bytes (a memoryview compares per item)."""
    head = min(len(view), 4096)
    if view[:head].tobytes() != _ZERO_PART[:head]:
        return False
    return view.tobytes() == _ZERO_PART[: len(view)]


def _finish_file(st: _FileState, loc: StoreLocation, journal: _Journal) -> None:
    rel = st.entry["path"]
    if journal.done.get(rel) == DONE or st.verified != st.entry["size"]:
        return
    if st.hasher.hexdigest() != st.want:
        journal.record(rel, 0)
        raise CopyError(
            "checksum_mismatch", f"{loc}{DATA}/{rel}: {st.algo} digest does not match the manifest"
        )
    os.fchmod(st.fd, 0o444)
    journal.record(rel, DONE)


def _write_once(path: Path, data: bytes) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, CREATE_NEW, 0o444)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
