"""Checkpoints through a real S3-compatible server: published once, pulled into a node
cache with parallel ranged reads, every byte checked as it lands, resumed after the
store went away. The server is SeaweedFS (tests/store/seaweedfs.py); the node caches
are real directories, as the node agent keeps them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
import zstandard
from rekindle_contract.manifest import MANIFEST_FORMAT, MANIFEST_NAME, Manifest
from rekindle_dev.seaweedfs import ACCESS_KEY, SECRET_KEY, SeaweedFS
from rekindle_store import manifest_io, node_cache, object_copy
from rekindle_store.node_cache import NodeCache, VerifiedCheckpoint
from rekindle_store.object_copy import PART_BYTES, StoreLocation
from rekindle_store.s3 import Bucket, Credentials
from rekindle_store.verified_copy import CopyError

pytestmark = pytest.mark.store

KEY = b"k" * 32
# Five parts: random data (stored raw), two of zeroes (a hole: the pull writes neither),
# a repeated pattern (compressed), a random tail.
PAGES_SIZE = 4 * PART_BYTES + 12345
ZERO_SPAN = (PART_BYTES, 3 * PART_BYTES)
PATTERN_PART = 3


def _pages() -> bytes:
    data = bytearray(os.urandom(PAGES_SIZE))
    data[ZERO_SPAN[0] : ZERO_SPAN[1]] = bytes(ZERO_SPAN[1] - ZERO_SPAN[0])
    start = PATTERN_PART * PART_BYTES
    data[start : start + PART_BYTES] = os.urandom(4096) * (PART_BYTES // 4096)
    return bytes(data)


def _checkpoint(root: Path, pages: bytes, key: bytes = KEY) -> Path:
    """A signed checkpoint directory, as a node agent publishes one."""
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(pages)
    (root / "images" / "core-1.img").write_bytes(b"core")
    (root / "images" / "empty.img").write_bytes(b"")
    (root / "shm").mkdir()
    (root / "shm" / "psm_1").write_bytes(b"shm contents")
    files = manifest_io.checksum_files(root, manifest_io.list_files(root), threads=2)
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "fingerprint": {},
        "criu": {},
        "vllm": {"root_pid": 123},
        "identity": {"namespace": "team-a", "name": "/checkpoints/first-1a2b"},
        "files": files,
    }
    manifest_io.write(root, cast(Manifest, doc), key)
    return root


def _published(
    tmp_path: Path, bucket: Bucket, pages: bytes, encoding: str = "frames"
) -> tuple[VerifiedCheckpoint, StoreLocation]:
    """A checkpoint verified into node A's cache and published from there."""
    node_a = NodeCache(tmp_path / "node-a", budget_bytes=1 << 30)
    entry = node_a.get(_checkpoint(tmp_path / "made", pages), KEY)
    loc = StoreLocation.of(bucket, "rekindle", "team-a", "/checkpoints/first-1a2b")
    sent = object_copy.publish(entry.path, loc, threads=4, encoding=encoding)
    assert (sent.files, sent.bytes) == (4, entry.bytes)
    return entry, loc


def _node_b(tmp_path: Path) -> NodeCache:
    return NodeCache(tmp_path / "node-b", budget_bytes=1 << 30)


def test_a_published_checkpoint_is_pulled_whole_and_checked_into_a_new_node(
    tmp_path: Path, bucket: Bucket
) -> None:
    pages = _pages()
    entry, loc = _published(tmp_path, bucket, pages)
    # Each part a frame of its own: random parts raw, the pattern compressed, zeroes
    # and the empty file not stored at all; the layout says which is which.
    frames = "rekindle/team-a/first-1a2b/frames/"
    stored = {o.key: o.size for o in bucket.list_objects("rekindle/")}
    assert sorted(stored) == [
        f"{frames}images/core-1.img/000000",
        f"{frames}images/pages-1.img/000000",
        f"{frames}images/pages-1.img/000003",
        f"{frames}images/pages-1.img/000004",
        f"{frames}shm/psm_1/000000",
        "rekindle/team-a/first-1a2b/layout.json",
        "rekindle/team-a/first-1a2b/manifest.json",
    ]
    packed = stored[f"{frames}images/pages-1.img/000003"]
    assert packed < PART_BYTES // 100
    layout = object_copy.read_layout(loc, entry.manifest).frames
    assert layout == {
        "images/core-1.img": [4],
        "images/empty.img": [],
        "images/pages-1.img": [PART_BYTES, 0, 0, packed, 12345],
        "shm/psm_1": [12],
    }

    node_b = _node_b(tmp_path)
    ranges: list[int] = []
    got = node_b.get_from_store(loc, KEY, 4, ranges.append)
    assert got.copied is True and got.entry == entry.entry
    # Every part was checked on its own: the big file in 5, the rest 1 each.
    assert sum(ranges) == entry.bytes and max(ranges) == PART_BYTES
    assert len(ranges) == 5 + 2  # (core and psm_1; the empty file has no part)
    pulled = got.path / "images" / "pages-1.img"
    assert pulled.read_bytes() == pages
    # The two parts of zeroes were never written: they are a hole.
    assert pulled.stat().st_blocks * 512 <= PAGES_SIZE - (ZERO_SPAN[1] - ZERO_SPAN[0]) + (1 << 20)
    assert (got.path / "images" / "empty.img").read_bytes() == b""
    assert (got.path / MANIFEST_NAME).read_bytes() == (entry.path / MANIFEST_NAME).read_bytes()
    assert not list(node_b.pulls.iterdir())
    # Cached now: the next replica on node B reads nothing from the store.
    again: list[int] = []
    assert node_b.get_from_store(loc, KEY, 4, again.append).copied is False and not again


def test_a_checkpoint_published_plain_is_one_object_per_file_read_by_ranges(
    tmp_path: Path, bucket: Bucket
) -> None:
    """The format before frames (and encoding "plain"): no layout, each file one object."""
    pages = _pages()
    entry, loc = _published(tmp_path, bucket, pages, encoding="plain")
    assert sorted(o.key for o in bucket.list_objects("rekindle/")) == [
        "rekindle/team-a/first-1a2b/data/images/core-1.img",
        "rekindle/team-a/first-1a2b/data/images/empty.img",
        "rekindle/team-a/first-1a2b/data/images/pages-1.img",
        "rekindle/team-a/first-1a2b/data/shm/psm_1",
        "rekindle/team-a/first-1a2b/manifest.json",
    ]
    node_b = _node_b(tmp_path)
    ranges: list[int] = []
    got = node_b.get_from_store(loc, KEY, 4, ranges.append)
    assert (got.path / "images" / "pages-1.img").read_bytes() == pages
    assert sum(ranges) == entry.bytes and len(ranges) == 5 + 2
    # A truncated object: refused by its length, before any digest.
    node_b.drop(got.entry)
    bucket.put(loc.data_key("images/pages-1.img"), pages[: PART_BYTES + 5])
    with pytest.raises(CopyError, match="shorter than the layout or the manifest says"):
        node_b.get_from_store(loc, KEY, 4)
    assert node_b.names() == []


def test_a_changed_object_is_refused_and_nothing_of_it_is_kept(
    tmp_path: Path, bucket: Bucket
) -> None:
    pages = _pages()
    _entry, loc = _published(tmp_path, bucket, pages)
    node_b = _node_b(tmp_path)
    tail = loc.frame_key("images/pages-1.img", 4)
    packed = loc.frame_key("images/pages-1.img", PATTERN_PART)

    def refused(match: str) -> None:
        with pytest.raises(CopyError, match=match) as e:
            node_b.get_from_store(loc, KEY, 4)
        assert e.value.reason == "checksum_mismatch"
        assert node_b.names() == [] and not list(node_b.pulls.iterdir())

    # Whoever holds the store's credentials rewrites one byte of a raw frame,
    evil = bytearray(pages[4 * PART_BYTES :])
    evil[-7] ^= 0xFF
    bucket.put(tail, bytes(evil))
    refused(r"images/pages-1\.img: blake3 digest does not match")
    bucket.put(tail, pages[4 * PART_BYTES :])
    # or replaces a compressed frame by garbage,
    original, layout_doc = bucket.get(packed), bucket.get(loc.layout_key)
    bucket.put(packed, os.urandom(len(original)))
    refused(r"000003: not a zstd frame of ours")
    # or by a frame of its own that decodes to a whole part, with a layout to match,
    other = zstandard.ZstdCompressor().compress(bytes(PART_BYTES - 1) + b"x")
    _set_frame_length(bucket, loc, PATTERN_PART, len(other))
    bucket.put(packed, other)
    refused(r"images/pages-1\.img: blake3 digest does not match")
    bucket.put(packed, original)
    bucket.put(loc.layout_key, layout_doc)
    # or truncates a frame,
    bucket.put(tail, pages[4 * PART_BYTES : 4 * PART_BYTES + 5])
    refused(r"000004: 5 bytes where 12345 were expected")
    bucket.put(tail, pages[4 * PART_BYTES :])
    # or makes the layout lie (a part of data said to be zeroes).
    _set_frame_length(bucket, loc, 0, 0)
    refused(r"images/pages-1\.img: blake3 digest does not match")


def _set_frame_length(bucket: Bucket, loc: StoreLocation, part: int, length: int) -> None:
    layout = json.loads(bucket.get(loc.layout_key))
    layout["frames"]["images/pages-1.img"][part] = length
    bucket.put(loc.layout_key, json.dumps(layout).encode())


def test_a_checkpoint_signed_by_another_fleet_is_refused_before_any_data(
    tmp_path: Path, bucket: Bucket
) -> None:
    _entry, loc = _published(tmp_path, bucket, b"small pages")
    node_b = _node_b(tmp_path)
    ranges: list[int] = []
    with pytest.raises(CopyError, match="signed with another key") as e:
        node_b.get_from_store(loc, b"x" * 32, 4, ranges.append)
    assert e.value.reason == "signature_invalid" and ranges == []


def test_a_checkpoint_is_published_once_and_deleted_manifest_first(
    tmp_path: Path, bucket: Bucket
) -> None:
    entry, loc = _published(tmp_path, bucket, b"small pages")
    with pytest.raises(CopyError, match="published there already") as e:
        object_copy.publish(entry.path, loc)
    assert e.value.reason == "exists"
    assert object_copy.delete(loc) == 5
    assert list(bucket.list_objects(loc.prefix)) == []
    with pytest.raises(CopyError, match="not in the object store") as gone:
        _node_b(tmp_path).get_from_store(loc, KEY)
    assert gone.value.reason == "no_checkpoint"


def test_a_pull_cut_when_the_store_goes_away_resumes_where_it_stopped(
    tmp_path: Path, bucket: Bucket, seaweedfs: SeaweedFS
) -> None:
    pages = _pages()
    entry, loc = _published(tmp_path, bucket, pages)
    node_b = _node_b(tmp_path)
    first: list[int] = []

    def cut(n: int) -> None:
        first.append(n)
        if len(first) == 2:  # two ranges of the big file are in and checked
            seaweedfs.stop()

    try:
        with pytest.raises(CopyError, match="the object store did not answer") as e:
            node_b.get_from_store(loc, KEY, 1, cut)
        assert e.value.reason == "store_unreachable"
    finally:
        seaweedfs.start()
    assert node_b.names() == []
    (staged,) = node_b.pulls.iterdir()  # what was checked stays for the next try
    assert (staged / object_copy.JOURNAL).is_file()

    second: list[int] = []
    got = node_b.get_from_store(loc, KEY, 4, second.append)
    assert (got.path / "images" / "pages-1.img").read_bytes() == pages
    # The resumed pull fetched only what the first had not checked.
    assert sum(first) + sum(second) == entry.bytes, (first, second)
    assert sum(first) >= 2 * PART_BYTES
    assert not list(node_b.pulls.iterdir())


# The node agent's pull in a process of its own, which dies (SIGKILL, as a node lost
# or an agent OOM-killed) once two ranges are in and checked.
_DYING_PULL = """
import json, os, signal, sys
from pathlib import Path
from rekindle_store import object_copy
from rekindle_store.node_cache import NodeCache
from rekindle_store.s3 import Bucket, Credentials
a = json.loads(sys.argv[1])
bucket = Bucket(a["endpoint"], a["bucket"], Credentials(a["access"], a["secret"]), timeout=10)
loc = object_copy.StoreLocation.of(bucket, "rekindle", "team-a", "/checkpoints/first-1a2b")
done = []
def die(n):
    done.append(n)
    if len(done) == 2:
        print(sum(done), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
NodeCache(Path(a["root"]), 1 << 30).get_from_store(loc, a["key"].encode(), 1, die)
"""


def test_a_node_lost_mid_pull_resumes_in_the_same_boot_and_starts_over_after_a_reboot(
    tmp_path: Path, bucket: Bucket, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = _pages()
    entry, loc = _published(tmp_path, bucket, pages)
    args = {
        "endpoint": seaweedfs.endpoint,
        "bucket": bucket.bucket,
        "access": ACCESS_KEY,
        "secret": SECRET_KEY,
        "root": str(tmp_path / "node-b"),
        "key": KEY.decode(),
    }
    died = subprocess.run(
        [sys.executable, "-c", _DYING_PULL, json.dumps(args)],
        stdout=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
    )
    assert died.returncode == -signal.SIGKILL, died
    checked = int(died.stdout)

    # The node agent back in the same boot: nothing half-pulled is a cache entry, and
    # the next pull fetches only what the dead one had not checked.
    node_b = _node_b(tmp_path)
    assert node_b.names() == []
    (staged,) = node_b.pulls.iterdir()
    assert (staged / object_copy.JOURNAL).is_file()
    rest: list[int] = []
    got = node_b.get_from_store(loc, KEY, 4, rest.append)
    assert (got.path / "images" / "pages-1.img").read_bytes() == pages
    assert checked >= 2 * PART_BYTES and checked + sum(rest) == entry.bytes, (checked, rest)

    # Cut again, then the node reboots: its unsynced bytes are not trusted, the cut
    # pull is removed when the node agent starts, and the next pull reads everything.
    node_b.drop(got.entry)
    died = subprocess.run(
        [sys.executable, "-c", _DYING_PULL, json.dumps(args)], timeout=120, check=False
    )
    assert died.returncode == -signal.SIGKILL
    assert list(node_b.pulls.iterdir())
    monkeypatch.setattr(node_cache, "boot_id", lambda: "another-boot")
    after_reboot = _node_b(tmp_path)
    assert not list(after_reboot.pulls.iterdir())
    everything: list[int] = []
    after_reboot.get_from_store(loc, KEY, 4, everything.append)
    assert sum(everything) == entry.bytes


def test_an_unreachable_store_says_so(tmp_path: Path) -> None:
    dead = Bucket(f"http://127.0.0.1:{_closed_port()}", "b", Credentials("a", "b"), timeout=2)
    loc = StoreLocation.of(dead, "rekindle", "team-a", f"/checkpoints/{uuid.uuid4().hex}")
    with pytest.raises(CopyError, match="did not answer") as e:
        _node_b(tmp_path).get_from_store(loc, KEY)
    assert e.value.reason == "store_unreachable"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
