"""Copy a published checkpoint into private storage, checking every byte on the way.

A published checkpoint (a PVC, a node path, later an object store) is written
by others: whoever can mount it can swap a file, or a directory for a symlink,
between a check and a use. So nothing is checked in place and used later.
One pass reads each file once through a descriptor opened without following
links, hashes the bytes it read and writes those same bytes into a staging
directory that only root can reach; a file whose digest or size differs fails
the whole copy. What the staging directory then holds is what was hashed,
whatever happens to the source afterwards, and a restore reads only that.

The manifest is read the same way (one descriptor, bounded, parsed from the
bytes read: manifest_io.parse), and the copy holds exactly the files it lists:
an unlisted file in the source is never copied, so it cannot be used.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from rekindle_contract.manifest import MANIFEST_NAME, VERIFIED_NAME, FileEntry, Manifest

from rekindle_store import digests, manifest_io

CHUNK = 8 << 20
# Opening a FIFO or a device must not block or touch hardware: refuse before reading.
# How the store opens what it reads and writes: never through a link (a path
# component replaced by a symlink fails with ELOOP), never kept across exec.
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class CopyError(ValueError):
    """The checkpoint cannot be used; reason is a short machine-readable word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class CopyResult:
    manifest: Manifest
    manifest_bytes: bytes  # exactly what was parsed and is now in the copy
    files: int
    bytes: int
    seconds: float


def open_dir(path: Path) -> int:
    """A descriptor of the directory path, refusing a symlink as its last component."""
    try:
        return os.open(path, OPEN_DIR)
    except OSError as e:
        raise CopyError(
            "no_checkpoint", f"{path}: {e.strerror or e} (a directory, not a link)"
        ) from e


def open_below(dir_fd: int, rel: str, where: str) -> int:
    """Open the regular file rel below dir_fd, following no link on the way."""
    parts = rel.split("/")
    fds: list[int] = []
    try:
        cur = dir_fd
        for part in parts[:-1]:
            cur = os.open(part, OPEN_DIR, dir_fd=cur)
            fds.append(cur)
        fd = os.open(parts[-1], _OPEN_FILE, dir_fd=cur)
    except OSError as e:
        raise CopyError(
            "checksum_mismatch", f"{where}/{rel}: {e.strerror or e} (links are not followed)"
        ) from e
    finally:
        for f in fds:
            os.close(f)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CopyError("checksum_mismatch", f"{where}/{rel}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_manifest(
    dir_fd: int, where: str, key: bytes | None, run_dir: str | None
) -> tuple[Manifest, bytes]:
    """The manifest, read once through dir_fd (bounded before parsing) and checked."""
    try:
        fd = open_below(dir_fd, MANIFEST_NAME, where)
    except CopyError as e:
        raise CopyError("no_checkpoint", e.message) from e
    try:
        raw = os.read(fd, manifest_io.MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return manifest_io.parse(raw, f"{where}/{MANIFEST_NAME}", key, run_dir), raw
    except manifest_io.ManifestError as e:
        raise CopyError(e.reason, str(e)) from e


def expected_digest(entry: FileEntry, signed: bool) -> tuple[str, str]:
    """(algorithm, hex digest) to check entry with: blake3 where recorded and installed,
    else sha256; crc32 (forgeable) only for an unsigned checkpoint."""
    order = ["blake3", "sha256"] if digests.have_blake3() else ["sha256"]
    if not signed:
        order.append("crc32")
    for algo in order:
        value = entry.get(algo)
        if isinstance(value, str) and value:
            return algo, value
    raise CopyError("manifest_invalid", f"{entry['path']}: no usable digest in the manifest")


def copy_file(src_dir: int, entry: FileEntry, dst_root: Path, where: str, signed: bool) -> int:
    """Copy one listed file into dst_root, hashing what is read; raise on any difference."""
    rel = entry["path"]
    algo, want = expected_digest(entry, signed)
    hasher = digests.new(algo, threads=4 if entry["size"] >= (256 << 20) else 1)
    dst = dst_root / rel
    dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    src = open_below(src_dir, rel, where)
    try:
        out = os.open(dst, CREATE_NEW, 0o600)
        try:
            copied = _copy_hashed(src, out, hasher.update)
        finally:
            os.close(out)
    finally:
        os.close(src)
    if copied != entry["size"]:
        raise CopyError(
            "checksum_mismatch", f"{where}/{rel}: {copied} bytes, the manifest says {entry['size']}"
        )
    if hasher.hexdigest() != want:
        raise CopyError("checksum_mismatch", f"{where}/{rel}: {algo} digest does not match")
    os.chmod(dst, 0o444)
    return copied


def _copy_hashed(src: int, out: int, update: Callable[[memoryview], object]) -> int:
    """Copy src to out, feeding every byte of src to update in order; returns src's size.

    Holes stay holes (SEEK_DATA/SEEK_HOLE): a /dev/shm file of hundreds of MiB
    that is mostly unwritten costs its data, not its size, on disk and in the
    later copy back to /dev/shm. The digest covers the holes as the zeroes they
    read as. Data that appears at the end after the size was taken is read too
    (and so fails the size check).
    """
    size = os.fstat(src).st_size
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    pos = 0
    while True:
        start = _next_data(src, pos, size)
        if start > pos:
            _hash_zeroes(start - pos, update)
        if start >= size:
            pos = size
            break
        try:
            end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        except OSError:
            end = size
        os.lseek(src, start, os.SEEK_SET)
        os.lseek(out, start, os.SEEK_SET)
        off = start
        while off < end:
            n = os.readv(src, [view[: min(CHUNK, end - off)]])
            if n == 0:
                break
            chunk = view[:n]
            update(chunk)
            written = 0
            while written < n:
                written += os.write(out, chunk[written:])
            off += n
        pos = off
        if off < end:  # the file shrank under us
            break
    # Anything beyond the size taken at the start (a writer appended): count it.
    os.lseek(src, pos, os.SEEK_SET)
    os.lseek(out, pos, os.SEEK_SET)
    while n := os.readv(src, [buf]):
        update(view[:n])
        os.write(out, view[:n])
        pos += n
    os.ftruncate(out, pos)  # trailing holes
    return pos


def copy_sparse(src: int, out: int) -> int:
    """Copy src to out keeping holes, hashing nothing (a copy of bytes already checked)."""
    return _copy_hashed(src, out, _ignore)


def _ignore(_chunk: memoryview) -> None:
    return None


def _next_data(fd: int, pos: int, size: int) -> int:
    """The offset of the next data at or after pos (size: none, only a hole is left)."""
    if pos >= size:
        return size
    try:
        return min(os.lseek(fd, pos, os.SEEK_DATA), size)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return size
        return pos  # no SEEK_DATA on this file system: read it all


_ZEROES = memoryview(bytes(CHUNK))


def _hash_zeroes(n: int, update: Callable[[memoryview], object]) -> None:
    while n > 0:
        k = min(n, CHUNK)
        update(_ZEROES[:k])
        n -= k


def copy_verified(
    source: Path | int,
    staging: Path,
    key: bytes | None,
    run_dir: str | None = None,
    threads: int = 4,
    where: str = "",
) -> CopyResult:
    """Copy the checkpoint at source into staging (created, must not exist), checked.

    source: a path, or a directory descriptor opened without following links
    (open_dir_below: a pod's volume seen from outside the pod); where names it
    in errors. Raises CopyError (staging is then left for the caller to
    remove). With a key the manifest must be signed by it; every listed file
    must match its size and digest as it is read. The copy's files are
    read-only, its manifest is the exact bytes that were checked.
    """
    t0 = time.monotonic()
    where = where or str(source)
    dir_fd = os.dup(source) if isinstance(source, int) else open_dir(source)
    try:
        manifest, raw = read_manifest(dir_fd, where, key, run_dir)
        staging.mkdir(mode=0o700)
        entries = sorted(manifest.get("files", []), key=lambda e: -e["size"])
        signed = key is not None
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="verify") as pool:
            sizes = list(pool.map(lambda e: copy_file(dir_fd, e, staging, where, signed), entries))
    finally:
        os.close(dir_fd)
    _write_new(staging / MANIFEST_NAME, raw)
    if key is not None and isinstance(manifest.get("verified"), dict):
        # The proof marker a restore looks for, from the manifest's signed record (the
        # source's marker file is not signed, so it is never copied).
        record = json.dumps(manifest["verified"], sort_keys=True) + "\n"
        _write_new(staging / VERIFIED_NAME, record.encode())
    return CopyResult(
        manifest=manifest,
        manifest_bytes=raw,
        files=len(sizes),
        bytes=sum(sizes),
        seconds=time.monotonic() - t0,
    )


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def open_dir_below(root_fd: int, path: str, where: str) -> int:
    """A descriptor of directory path (absolute or relative) below root_fd, every component
    opened without following links: a pod's path read from outside the pod."""
    cur = os.dup(root_fd)
    try:
        for part in [p for p in path.split("/") if p]:
            if part in (".", ".."):
                raise CopyError("bad_request", f"{where}{path}: '.' and '..' are not allowed")
            nxt = os.open(part, OPEN_DIR, dir_fd=cur)
            os.close(cur)
            cur = nxt
    except OSError as e:
        os.close(cur)
        raise CopyError(
            "bad_request", f"{where}{path}: {e.strerror or e} (links are not followed)"
        ) from e
    return cur


def take_tree(src_dir: int, dst: Path, where: str) -> list[FileEntry]:
    """Copy every regular file below src_dir into dst (created), digests recorded as read.

    For files a pod wrote for its own checkpoint (the weight dump, /dev/shm copies):
    the copy is what the manifest describes, whatever the pod does afterwards.
    Links, devices and FIFOs are refused.
    """
    out: list[FileEntry] = []

    def walk(fd: int, rel: str) -> None:
        for name in sorted(os.listdir(fd)):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            child = f"{rel}/{name}" if rel else name
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, OPEN_DIR, dir_fd=fd)
                try:
                    (dst / child).mkdir(mode=0o700, parents=True, exist_ok=True)
                    walk(sub, child)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                out.append(_take_file(fd, name, child, dst, where))
            else:
                raise CopyError("bad_request", f"{where}/{child}: not a regular file or directory")

    dst.mkdir(mode=0o700, parents=True, exist_ok=True)
    walk(src_dir, "")
    return out


def _take_file(dir_fd: int, name: str, rel: str, dst: Path, where: str) -> FileEntry:
    src = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            raise CopyError("bad_request", f"{where}/{rel}: not a regular file")
        os.set_blocking(src, True)
        hashers = digests.RecordHashers()
        out = os.open(dst / rel, CREATE_NEW, 0o600)
        try:
            size = _copy_hashed(src, out, hashers.update)
        finally:
            os.close(out)
    finally:
        os.close(src)
    entry: dict[str, object] = {"path": rel, "size": size, **hashers.hexdigests()}
    return cast(FileEntry, entry)
