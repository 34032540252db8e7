"""Checkpoints in an S3-compatible object store: published once, pulled verified.

One published checkpoint under the store's prefix:

    PREFIX/NAMESPACE/NAME/frames/PATH/N   part N (PART_BYTES each) of each file its manifest
                                          lists, as a frame (frames.py: compressed, raw, or
                                          not stored at all for a part of zeroes)
    PREFIX/NAMESPACE/NAME/layout.json     each file's frame lengths: what to fetch, how to decode
    PREFIX/NAMESPACE/NAME/manifest.json   written last: the checkpoint exists once it does

A checkpoint published with encoding "plain" (and every one published before
frames) has no layout: each file is one object, PREFIX/NAMESPACE/NAME/data/PATH.

The store is a transport, never trusted: whoever holds its credentials can
change any object. A pull therefore reads the manifest first (bounded, checked
against the fleet's signing key), then every listed file with parallel GETs, one
per part (a frame, or a range of a plain object); each is received or decoded
straight into the staging file's mapping (a root-only staging directory; no copy
in between) and hashed in file order as soon as the ranges before it are in, so a file is
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

from rekindle_store import digests, frames, manifest_io
from rekindle_store.s3 import Bucket, S3Error
from rekindle_store.verified_copy import CREATE_NEW, CopyError, CopyResult, expected_digest

PART_BYTES = 16 << 20  # one frame, one ranged GET, one part of a multipart upload
JOURNAL = ".pull.json"
DATA = "data"
FRAMES = "frames"
LAYOUT_NAME = "layout.json"
LAYOUT_FORMAT = "rekindle-store-layout/1"
MAX_LAYOUT_BYTES = 8 << 20
ENCODINGS = ("frames", "plain")
DONE = -1  # a journal's mark for a file fetched whole and checked
_OPEN_STAGED = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


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

    @property
    def layout_key(self) -> str:
        return self.prefix + LAYOUT_NAME

    def data_key(self, rel: str) -> str:
        """File rel as one object (a checkpoint published plain)."""
        return f"{self.prefix}{DATA}/{rel}"

    def frame_key(self, rel: str, index: int) -> str:
        """Part index (from 0) of file rel."""
        return f"{self.prefix}{FRAMES}/{rel}/{index:06d}"

    def url(self, key: str) -> str:
        """key as people read it in an error: endpoint/bucket/key."""
        return f"{self.bucket.endpoint}/{self.bucket.bucket}/{key}"

    def __str__(self) -> str:
        return self.url(self.prefix)


@dataclass(frozen=True)
class Published:
    files: int
    bytes: int  # the checkpoint's
    stored: int  # what the store holds for them (frames: compressed, zeroes left out)
    seconds: float


@dataclass(frozen=True)
class Layout:
    """How each file of a published checkpoint is stored: its frames' lengths, in order
    (None for a checkpoint published plain). Read from the store: never trusted, only
    followed (a wrong length makes a frame decode wrong, and the digest refuses it)."""

    frames: dict[str, list[int]] | None

    def to_json(self) -> bytes:
        return json.dumps(
            {"format": LAYOUT_FORMAT, "part_bytes": PART_BYTES, "frames": self.frames}
        ).encode()


def _store_error(e: S3Error, where: str) -> CopyError:
    if e.unreachable:
        return CopyError("store_unreachable", f"{where}: the object store did not answer: {e}")
    if e.status == 404:
        return CopyError("no_checkpoint", f"{where}: not in the object store ({e.code})")
    return CopyError("store_error", f"{where}: {e}")


# -- publish -------------------------------------------------------------------------


def publish(
    entry: Path, loc: StoreLocation, threads: int = 8, encoding: str = "frames"
) -> Published:
    """Upload the verified checkpoint directory entry to loc, its manifest last.

    encoding "frames" (the default): every part of every file is encoded (frames.py)
    and PUT as an object of its own, then the layout; "plain": each file one object
    (large ones as multipart uploads), as checkpoints were published before frames.
    Every PUT runs on one pool of threads. Refused (CopyError "exists") when loc holds
    a checkpoint already: one is published once, so a pull never mixes two.
    """
    if encoding not in ENCODINGS:
        raise CopyError(
            "bad_request", f"{encoding!r}: not a store encoding ({', '.join(ENCODINGS)})"
        )
    t0 = time.monotonic()
    raw = (entry / MANIFEST_NAME).read_bytes()
    files: list[FileEntry] = json.loads(raw).get("files", [])
    try:
        if loc.bucket.head(loc.manifest_key) is not None:
            raise CopyError("exists", f"{loc}: a checkpoint is published there already")
        if encoding == "frames":
            stored = _put_frames(entry, loc, files, threads)
        else:
            stored = _put_plain(entry, loc, files, threads)
        loc.bucket.put(loc.manifest_key, raw)
    except S3Error as e:
        raise _store_error(e, str(loc)) from e
    size = sum(f["size"] for f in files)
    return Published(len(files), size, stored, time.monotonic() - t0)


def _put_frames(entry: Path, loc: StoreLocation, files: list[FileEntry], threads: int) -> int:
    """Encode and PUT every part of every file, then the layout; the bytes stored."""
    jobs = [(f["path"], n) for f in files for n in range(_part_count(f["size"]))]

    def one(job: tuple[str, int]) -> int:
        rel, n = job
        with open(entry / rel, "rb") as fh:
            fh.seek(n * PART_BYTES)
            frame = frames.encode(memoryview(fh.read(PART_BYTES)))
        if frame:
            loc.bucket.put(loc.frame_key(rel, n), frame)
        return len(frame)

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="publish") as pool:
        lengths = list(pool.map(one, jobs))
    layout: dict[str, list[int]] = {f["path"]: [] for f in files}
    for (rel, _n), length in zip(jobs, lengths, strict=True):
        layout[rel].append(length)  # jobs hold each file's parts in order
    loc.bucket.put(loc.layout_key, Layout(layout).to_json())
    return sum(lengths)


def _part_count(size: int) -> int:
    return -(-size // PART_BYTES)


def _put_plain(entry: Path, loc: StoreLocation, files: list[FileEntry], threads: int) -> int:
    """PUT each file as one object (multipart when large); the bytes stored."""
    uploads: dict[str, str] = {}  # key -> multipart upload id
    try:
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
    finally:
        for key, upload in uploads.items():  # left unfinished: free the server's parts
            with contextlib.suppress(S3Error):
                loc.bucket.abort_upload(key, upload)
    return sum(f["size"] for f in files)


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


def read_layout(loc: StoreLocation, manifest: Manifest) -> Layout:
    """How loc's files are stored (no layout object: published plain), checked to
    describe exactly the files manifest lists, with lengths a part can have."""
    try:
        raw = loc.bucket.get(loc.layout_key, limit=MAX_LAYOUT_BYTES)
    except S3Error as e:
        if e.status == 404:
            return Layout(None)
        raise _store_error(e, str(loc)) from e
    where = f"{loc}{LAYOUT_NAME}"
    try:
        doc = json.loads(raw)
        lengths = {str(k): [int(n) for n in v] for k, v in dict(doc["frames"]).items()}
        fmt, part = doc["format"], doc["part_bytes"]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CopyError("store_error", f"{where}: not a layout: {e}") from e
    if fmt != LAYOUT_FORMAT or part != PART_BYTES:
        raise CopyError("store_error", f"{where}: format {fmt!r}, parts of {part}: not ours")
    for f in manifest.get("files", []):
        got, size = lengths.get(f["path"]), f["size"]
        want = [min(PART_BYTES, size - off) for off in range(0, size, PART_BYTES)]
        if (
            got is None
            or len(got) != len(want)
            or any(not 0 <= n <= w for n, w in zip(got, want, strict=True))
        ):
            raise CopyError("store_error", f"{where}: {f['path']}: frames do not fit its size")
    return Layout(lengths)


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
    """How far each file of a pull was verified, on the local disk beside the files.

    Rewritten in place after every part (a pwrite of the whole record, padded with
    spaces to the longest one yet, which JSON ignores): a rename over the old one
    costs a forced writeback each time on ext4 (7 ms here, 1.8 s of a 2 GB pull).
    A record torn by a crash fails to parse and the pull starts over: safe, since
    the journal only ever shortens what a pull trusts."""

    def __init__(self, stage: Path, boot: str) -> None:
        self.path = stage / JOURNAL
        self.boot = boot
        self.done: dict[str, int] = {}
        self.fd = -1
        self.length = 0
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            doc = {}
        if isinstance(doc, dict) and doc.get("boot_id") == boot:
            self.done = {str(k): int(v) for k, v in dict(doc.get("verified", {})).items()}

    def record(self, rel: str, verified: int) -> None:
        self.done[rel] = verified
        data = json.dumps({"boot_id": self.boot, "verified": self.done}).encode()
        if self.fd < 0:
            self.path.unlink(missing_ok=True)
            self.fd = os.open(self.path, _OPEN_STAGED | os.O_CREAT | os.O_EXCL, 0o600)
        self.length = max(self.length, len(data))
        os.pwrite(self.fd, data.ljust(self.length), 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
    layout = read_layout(loc, manifest)
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
                window.append((st, start, pool.submit(_fetch, loc, layout, st, start, end)))
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
        journal.close()
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


def _fetch(loc: StoreLocation, layout: Layout, st: _FileState, start: int, end: int) -> int:
    """Receive bytes [start, end) of st's file into its mapping; how many came."""
    rel = st.entry["path"]
    view = st.map()[start:end]
    try:
        if layout.frames is None:
            key, length = loc.data_key(rel), end - start
            got = loc.bucket.get_into(key, start, view)
        else:
            key, length = (
                loc.frame_key(rel, start // PART_BYTES),
                layout.frames[rel][start // PART_BYTES],
            )
            got = _fetch_frame(loc, key, length, view)
    finally:
        view.release()
    if got != length:
        raise CopyError(
            "checksum_mismatch",
            f"{loc.url(key)}: {got} bytes where {length} were expected "
            "(the object is shorter than the layout or the manifest says)",
        )
    return end - start


def _fetch_frame(loc: StoreLocation, key: str, length: int, out: memoryview) -> int:
    """Fetch key, a frame of length bytes, and decode it into out; the frame's bytes
    that came (a raw frame is received straight into out, zeroes not at all)."""
    if length == 0:  # zeroes: out is a hole already
        return 0
    if length == len(out):
        return loc.bucket.get_into(key, 0, out)
    frame = bytearray(length)
    got = loc.bucket.get_into(key, 0, memoryview(frame))
    if got == length:
        try:
            frames.decode_into(memoryview(frame), out)
        except frames.FrameError as e:
            raise CopyError("checksum_mismatch", f"{loc.url(key)}: {e}") from e
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
        if frames.is_zero(view):  # a hole again (checkpoint pages can hold long runs of zeroes)
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


def _finish_file(st: _FileState, loc: StoreLocation, journal: _Journal) -> None:
    rel = st.entry["path"]
    if journal.done.get(rel) == DONE or st.verified != st.entry["size"]:
        return
    if st.hasher.hexdigest() != st.want:
        journal.record(rel, 0)
        raise CopyError(
            "checksum_mismatch", f"{loc}{rel}: {st.algo} digest does not match the manifest"
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
