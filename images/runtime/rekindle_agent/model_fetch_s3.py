"""`rekindle fetch-model --s3-...`: a model from an S3-compatible store into the node's cache.

The model is every object below a prefix of a bucket (spec.model.s3). Like a
hub model (model_fetch.py) it lands in the cache volume shared by the
replicas of a node, in the layout of rekindle_contract.model_cache:

- the listing (every key, size and ETag) names a version; a version already in
  the cache is used as it is, so a node downloads a model once, and a changed
  or added object makes a new version;
- objects are read with parallel ranged GETs (PART_BYTES each) written in place
  into a `.tmp-*` directory, checked (the size, and the MD5 where the store's
  ETag is one: a single-part upload), and the directory renamed into place
  only when every file is whole: a directory there is complete;
- one fetch per model at a time holds the model's `.lock`; the others wait and
  then find it there;
- when the store cannot be listed, the version the cache last saw is used,
  with a warning.

The keys come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the pod takes
them from a Secret) and are never printed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rekindle_contract.model_cache import S3_REF, s3_dir
from rekindle_store.s3 import Bucket, Credentials, ObjectInfo, S3Error

from rekindle_agent.model_fetch import FetchError, locked, log, point

PART_BYTES = 16 << 20
THREADS = 8
_MD5 = re.compile(r"^[0-9a-f]{32}$")


def credentials_from_env(env: dict[str, str] | None = None) -> Credentials:
    env = dict(os.environ if env is None else env)
    key, secret = env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", "")
    if not key or not secret:
        raise FetchError(
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set: the operator takes them "
            "from spec.model.s3.secretRef (keys accessKeyID and secretAccessKey)"
        )
    return Credentials(key, secret)


def model_files(objects: list[ObjectInfo], prefix: str) -> list[tuple[str, ObjectInfo]]:
    """(path below the model's directory, object) for every file of the listing; a key
    that would leave the directory is refused (the store is not trusted with paths)."""
    out = []
    for o in objects:
        rel = o.key[len(prefix) :]
        if not rel or rel.endswith("/"):
            continue  # the prefix itself, or a "directory" marker
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise FetchError(f"object {o.key!r}: not a file path below {prefix!r}; refused")
        out.append((rel, o))
    if not out:
        raise FetchError(f"no object below {prefix!r}: check spec.model.s3.bucket and .prefix")
    return sorted(out)


def version(files: list[tuple[str, ObjectInfo]]) -> str:
    """The name of one listing: a digest of every path, size and ETag."""
    h = hashlib.sha256()
    for rel, o in files:
        h.update(f"{rel}\0{o.size}\0{o.etag}\n".encode())
    return h.hexdigest()[:24]


def _ranges(files: list[tuple[str, ObjectInfo]]) -> Iterator[tuple[str, ObjectInfo, int, int]]:
    for rel, o in files:
        for start in range(0, o.size, PART_BYTES):
            yield rel, o, start, min(o.size, start + PART_BYTES)


def download(bucket: Bucket, files: list[tuple[str, ObjectInfo]], dest: Path) -> int:
    """Every file into dest with parallel ranged reads, each checked; bytes read."""
    fds: dict[str, int] = {}
    try:
        for rel, o in files:
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            fds[rel] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            os.ftruncate(fds[rel], o.size)

        def part(job: tuple[str, ObjectInfo, int, int]) -> int:
            rel, o, start, end = job
            data = bucket.get(o.key, start, end)
            if len(data) != end - start:
                raise FetchError(f"{o.key}: bytes {start}-{end} came back as {len(data)} bytes")
            os.pwrite(fds[rel], data, start)
            return len(data)

        with ThreadPoolExecutor(THREADS) as pool:
            total = sum(pool.map(part, _ranges(files)))
    finally:
        for fd in fds.values():
            os.close(fd)
    for rel, o in files:
        check(dest / rel, o)
    return total


def check(path: Path, o: ObjectInfo) -> None:
    """The file's size, and its MD5 against the ETag when the ETag is an MD5."""
    size = path.stat().st_size
    if size != o.size:
        raise FetchError(f"{o.key}: {size} bytes written, the store lists {o.size}")
    if not _MD5.match(o.etag):
        return  # a multipart upload's ETag is not a digest of the content
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    if h.hexdigest() != o.etag:
        raise FetchError(f"{o.key}: content does not match the store's ETag (MD5); refused")


def fetch_s3(bucket: Bucket, prefix: str, cache: Path) -> Path:
    """Make cache hold the current listing of prefix; returns the ref path vLLM loads.

    Idempotent and safe in every replica at once (see the module's docstring)."""
    prefix = prefix.rstrip("/") + "/"
    model = cache / s3_dir(bucket.endpoint, bucket.bucket, prefix)
    (model / "snapshots").mkdir(parents=True, exist_ok=True)
    (model / "refs").mkdir(exist_ok=True)
    where = f"{bucket.endpoint}/{bucket.bucket}/{prefix}"
    with locked(model / ".lock"):
        try:
            files = model_files(list(bucket.list_objects(prefix)), prefix)
        except S3Error as e:
            if (model / "refs" / S3_REF).exists():
                log(f"store unreachable or refusing ({e}); using the cached copy of {where}")
                return model / "refs" / S3_REF
            raise FetchError(
                f"cannot list {where} ({e}); check spec.model.s3 and its Secret, and that "
                "the pod reaches the store"
            ) from e
        name = version(files)
        snapshot = model / "snapshots" / name
        if snapshot.is_dir():
            log(f"{where} ({name}) already in the cache")
        else:
            for stale in model.glob(".tmp-*"):  # a fetch that died halfway (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = model / f".tmp-{name}-{os.getpid()}"
            tmp.mkdir()
            start = time.monotonic()
            size = sum(o.size for _, o in files)
            log(f"downloading {where}: {len(files)} files, {size} bytes")
            try:
                download(bucket, files, tmp)
            except (S3Error, OSError, FetchError) as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise FetchError(f"download of {where} failed: {e}") from e
            os.rename(tmp, snapshot)
            seconds = time.monotonic() - start
            log(f"downloaded in {seconds:.1f}s ({size / max(seconds, 1e-9) / 1e6:.0f} MB/s)")
        point(model / "refs" / S3_REF, f"../snapshots/{name}")
    return model / "refs" / S3_REF
