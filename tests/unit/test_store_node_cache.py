"""The node cache's verified copy: only checked bytes reach it, whatever the source does.

Real files and directories throughout (the copy is plain file I/O); the one
thing these tests cannot show, that no tenant pod mounts the cache, is the
node agent's deployment's property (tests/cluster).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, cast

import pytest
from rekindle_contract.manifest import MANIFEST_FORMAT, MANIFEST_NAME, Manifest
from rekindle_store import manifest_io, node_cache, published, verified_copy
from rekindle_store.node_cache import NodeCache
from rekindle_store.verified_copy import CopyError

KEY = b"k" * 32
PAGES = bytes(range(256)) * 4096  # 1 MiB


def publish(root: Path, pages: bytes = PAGES, key: bytes | None = KEY) -> Path:
    """A signed checkpoint directory as an in-pod agent publishes one."""
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(pages)
    (root / "images" / "core-1.img").write_bytes(b"core")
    (root / "shm").mkdir()
    (root / "shm" / "psm_1").write_bytes(b"shm contents")
    files = manifest_io.checksum_files(root, manifest_io.list_files(root), threads=2)
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "fingerprint": {},
        "criu": {},
        "vllm": {"root_pid": 123},
        "files": files,
    }
    manifest_io.write(root, cast(Manifest, doc), key)
    return root


@pytest.fixture
def cache(tmp_path: Path) -> NodeCache:
    return NodeCache(tmp_path / "cache", budget_bytes=8 << 20)


def test_the_copy_holds_exactly_the_checked_files(tmp_path: Path, cache: NodeCache) -> None:
    src = publish(tmp_path / "pub")
    (src / "images" / "unlisted.img").write_bytes(b"not in the manifest")
    v = cache.get(src, KEY)
    assert v.copied is True
    assert v.bytes == len(PAGES) + len(b"core") + len(b"shm contents")
    got = sorted(str(p.relative_to(v.path)) for p in v.path.rglob("*") if p.is_file())
    assert got == [
        node_cache.ENTRY_RECORD,
        "images/core-1.img",
        "images/pages-1.img",
        MANIFEST_NAME,
        "shm/psm_1",
    ]
    assert (v.path / "images" / "pages-1.img").read_bytes() == PAGES
    assert (v.path / MANIFEST_NAME).read_bytes() == (src / MANIFEST_NAME).read_bytes()
    assert stat.S_IMODE((v.path / "images" / "pages-1.img").stat().st_mode) == 0o444
    assert stat.S_IMODE((v.path / "images").stat().st_mode) == 0o555
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700


def test_a_file_swapped_after_the_check_never_reaches_a_restore(
    tmp_path: Path, cache: NodeCache
) -> None:
    """The attack the private copy exists for: change the published bytes after the
    node agent verified them. The copy keeps what was checked."""
    src = publish(tmp_path / "pub")
    v = cache.get(src, KEY)
    evil = b"\xcc" * len(PAGES)
    (src / "images" / "pages-1.img").write_bytes(evil)
    again = cache.get(src, KEY)
    assert again.copied is False
    assert again.path == v.path
    assert (again.path / "images" / "pages-1.img").read_bytes() == PAGES


def test_a_file_changed_before_the_copy_is_refused(tmp_path: Path, cache: NodeCache) -> None:
    src = publish(tmp_path / "pub")
    (src / "images" / "pages-1.img").write_bytes(b"\xcc" * len(PAGES))
    with pytest.raises(CopyError, match=r"pages-1.img: blake3 digest does not match") as e:
        cache.get(src, KEY)
    assert e.value.reason == "checksum_mismatch"
    assert cache.names() == []
    assert list(cache.staging.iterdir()) == []


def test_a_symlinked_directory_is_refused(tmp_path: Path, cache: NodeCache) -> None:
    """images/ replaced by a link to a directory holding the same names: a check by
    path would follow it; the copy opens every component without following links."""
    src = publish(tmp_path / "pub")
    other = tmp_path / "elsewhere"
    os.rename(src / "images", other)
    (src / "images").symlink_to(other)
    with pytest.raises(CopyError, match=r"images/.*links are not followed") as e:
        cache.get(src, KEY)
    assert e.value.reason == "checksum_mismatch"
    assert cache.names() == []


def test_a_symlinked_file_and_a_fifo_are_refused(tmp_path: Path, cache: NodeCache) -> None:
    src = publish(tmp_path / "pub")
    core = src / "images" / "core-1.img"
    (tmp_path / "core").write_bytes(core.read_bytes())
    core.unlink()
    core.symlink_to(tmp_path / "core")
    with pytest.raises(CopyError, match=r"core-1.img: .*links are not followed"):
        cache.get(src, KEY)
    core.unlink()
    os.mkfifo(core)  # opening a FIFO for reading would block forever
    with pytest.raises(CopyError, match=r"core-1.img: not a regular file"):
        cache.get(src, KEY)


def test_the_checkpoint_directory_itself_may_not_be_a_link(
    tmp_path: Path, cache: NodeCache
) -> None:
    src = publish(tmp_path / "pub")
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(CopyError, match=r"a directory, not a link") as e:
        cache.get(link, KEY)
    assert e.value.reason == "no_checkpoint"


def test_unsigned_or_foreign_checkpoints_are_refused(tmp_path: Path, cache: NodeCache) -> None:
    unsigned = publish(tmp_path / "unsigned", key=None)
    with pytest.raises(CopyError, match="unsigned") as e:
        cache.get(unsigned, KEY)
    assert e.value.reason == "signature_invalid"
    foreign = publish(tmp_path / "foreign", key=b"x" * 32)
    with pytest.raises(CopyError, match="signed with another key"):
        cache.get(foreign, KEY)


def test_a_huge_or_deeply_nested_manifest_is_refused_before_parsing(
    tmp_path: Path, cache: NodeCache
) -> None:
    src = publish(tmp_path / "pub")
    man = src / MANIFEST_NAME
    man.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(CopyError, match="RecursionError") as e:
        cache.get(src, KEY)
    assert e.value.reason == "manifest_invalid"
    man.write_bytes(b" " * (manifest_io.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(CopyError, match="larger than 16777216 bytes"):
        cache.get(src, KEY)


def test_a_truncated_file_is_refused(tmp_path: Path, cache: NodeCache) -> None:
    src = publish(tmp_path / "pub")
    (src / "images" / "pages-1.img").write_bytes(PAGES[:-4096])
    with pytest.raises(CopyError, match=r"pages-1.img: 1044480 bytes, the manifest says 1048576"):
        cache.get(src, KEY)


def test_republishing_the_same_checkpoint_is_one_entry(tmp_path: Path, cache: NodeCache) -> None:
    """The entry is named by the manifest's content, not its path: a second copy of
    the same checkpoint, or the same one marked verified later, is found in the cache."""
    a = cache.get(publish(tmp_path / "a"), KEY)
    b_src = publish(tmp_path / "b")
    man = manifest_io.read(b_src, KEY)
    manifest_io.mark_verified(b_src, man, {"restore_seconds": 1.0}, KEY)
    b = cache.get(b_src, KEY)
    assert (b.entry, b.copied) == (a.entry, False)
    c = cache.get(publish(tmp_path / "c", pages=PAGES[::-1]), KEY)
    assert c.entry != a.entry and c.copied is True


def test_an_entry_from_an_earlier_boot_is_copied_again(
    tmp_path: Path, cache: NodeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = publish(tmp_path / "pub")
    first = cache.get(src, KEY)
    monkeypatch.setattr(node_cache, "boot_id", lambda: "another-boot")
    again = cache.get(src, KEY)
    assert (again.entry, again.copied) == (first.entry, True)


def test_the_budget_evicts_least_recently_used_unpinned_entries(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "cache", budget_bytes=int(2.5 * len(PAGES)))
    a = cache.get(publish(tmp_path / "a", pages=b"a" * len(PAGES)), KEY)
    b = cache.get(publish(tmp_path / "b", pages=b"b" * len(PAGES)), KEY)
    cache.pin(a.entry, "pod-uid-1")
    os.utime(cache.entries / a.entry / node_cache.ENTRY_RECORD, (1, 1))  # a: least recent
    c = cache.get(publish(tmp_path / "c", pages=b"c" * len(PAGES)), KEY)
    assert sorted(cache.names()) == sorted([a.entry, c.entry])  # b evicted, a pinned
    assert b.entry not in cache.names()
    cache.pin(c.entry, "pod-uid-2")
    with pytest.raises(CopyError, match="do not fit") as e:
        cache.get(publish(tmp_path / "d", pages=b"d" * len(PAGES)), KEY)
    assert e.value.reason == "cache_full"
    assert sorted(cache.names()) == sorted([a.entry, c.entry])


def test_a_checkpoint_larger_than_the_budget_says_what_to_change(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "cache", budget_bytes=1000)
    with pytest.raises(CopyError, match="raise the node agent's cache budget"):
        cache.get(publish(tmp_path / "pub"), KEY)


def test_report_gives_residency_and_holders(tmp_path: Path, cache: NodeCache) -> None:
    v = cache.get(publish(tmp_path / "pub"), KEY)
    cache.pin(v.entry, "pod-uid-1")
    (r,) = cache.report()
    assert (r.entry, r.bytes, r.pinned_by) == (v.entry, v.bytes, ["pod-uid-1"])
    assert r.source == str(tmp_path / "pub")
    assert 0.0 <= r.resident_pct <= 100.0
    # Just written through the page cache: the copy is resident.
    assert r.resident_pct > 50.0
    cache.unpin(v.entry, "pod-uid-1")
    assert cache.report()[0].pinned_by == []


def test_copy_verified_refuses_an_existing_staging_directory(tmp_path: Path) -> None:
    src = publish(tmp_path / "pub")
    (tmp_path / "stage").mkdir()
    with pytest.raises(FileExistsError):
        verified_copy.copy_verified(src, tmp_path / "stage", KEY)


def test_holes_stay_holes_and_the_digest_covers_them(tmp_path: Path) -> None:
    """A /dev/shm copy is mostly unwritten: the verified copy keeps its holes (its
    disk use and the copy back to /dev/shm cost its data only), and the digest
    is that of the whole file, holes read as zeroes."""
    src = publish(tmp_path / "pub")
    sparse = src / "shm" / "psm_big"
    with sparse.open("wb") as f:
        f.seek(8 << 20)
        f.write(b"middle")
        f.truncate(32 << 20)
    files = manifest_io.checksum_files(src, manifest_io.list_files(src), threads=2)
    man = manifest_io.read(src, KEY)
    man["files"] = files
    manifest_io.write(src, man, KEY)
    v = NodeCache(tmp_path / "cache", budget_bytes=64 << 20).get(src, KEY)
    copy = v.path / "shm" / "psm_big"
    assert copy.read_bytes() == sparse.read_bytes()
    assert copy.stat().st_size == 32 << 20
    assert copy.stat().st_blocks * 512 < 1 << 20  # holes kept: far less than 32 MiB on disk


def test_a_checkpoint_marked_copy_only_says_why(tmp_path: Path, cache: NodeCache) -> None:
    v = cache.get(publish(tmp_path / "pub"), KEY)
    assert cache.copy_only(v.entry) is None
    cache.set_copy_only(v.entry, "a replica died after a mapped restore: SIGBUS")
    assert cache.copy_only(v.entry) == "a replica died after a mapped restore: SIGBUS"
    again = NodeCache(cache.root, budget_bytes=cache.budget)  # a restarted node agent
    assert again.copy_only(v.entry) == "a replica died after a mapped restore: SIGBUS"


def _dir_fd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def test_a_published_entry_comes_back_by_descriptor_with_the_same_content(
    tmp_path: Path, cache: NodeCache
) -> None:
    """publish() writes an entry out whole (holes kept, bookkeeping left behind); a cache
    that lacks it takes it back through a descriptor, checked like any source."""
    v = cache.get(publish(tmp_path / "pub"), KEY)
    cache.mark_verified(v.entry, {"restore_seconds": 1.0}, KEY)
    shared = tmp_path / "shared"
    shared.mkdir()
    parent = _dir_fd(shared)
    try:
        done = published.publish(v.path, parent, "ckpt-1", str(shared), owner=(65534, 65534))
        with pytest.raises(CopyError, match="published once"):
            published.publish(v.path, parent, "ckpt-1", str(shared))
    finally:
        os.close(parent)
    out = shared / "ckpt-1"
    assert done.files == 4 and done.bytes == v.bytes + len((v.path / MANIFEST_NAME).read_bytes())
    assert not (out / node_cache.ENTRY_RECORD).exists()
    assert [p.name for p in shared.iterdir()] == ["ckpt-1"]  # no partial directory left
    assert stat.S_IMODE((out / "images" / "pages-1.img").stat().st_mode) == 0o444
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in [out, *out.rglob("*")]}
    assert owners == {(65534, 65534)}, owners  # the pod's storage: the pod may remove it

    other = NodeCache(tmp_path / "other", budget_bytes=8 << 20)
    src = _dir_fd(out)
    try:
        back = other.get(src, KEY, where="pod:/ckpt-1")
    finally:
        os.close(src)
    assert back.copied is True and back.entry == v.entry
    assert (back.path / "images" / "pages-1.img").read_bytes() == PAGES
    # Proven before it was published: the copy says so, from the signed record only.
    assert manifest_io.is_verified(back.path, back.manifest)
    assert other.report()[0].source == "pod:/ckpt-1"


def test_a_tampered_published_copy_is_refused_on_the_way_back(
    tmp_path: Path, cache: NodeCache
) -> None:
    """Shared storage is writable by whoever mounts it: a changed file, or a directory
    swapped for a link to an identical copy, fails the pull."""
    v = cache.get(publish(tmp_path / "pub"), KEY)
    shared = tmp_path / "shared"
    shared.mkdir()
    parent = _dir_fd(shared)
    try:
        published.publish(v.path, parent, "a", str(shared))
        published.publish(v.path, parent, "b", str(shared))
    finally:
        os.close(parent)
    page = shared / "a" / "images" / "pages-1.img"
    os.chmod(page, 0o644)
    page.write_bytes(b"\xcc" * len(PAGES))
    images = shared / "b" / "images"
    images.rename(shared / "b-images")
    images.symlink_to(shared / "b-images")
    for name, why in (("a", "digest does not match"), ("b", "links are not followed")):
        fresh = NodeCache(tmp_path / f"fresh-{name}", budget_bytes=8 << 20)
        src = _dir_fd(shared / name)
        try:
            with pytest.raises(CopyError, match=why) as e:
                fresh.get(src, KEY, where=f"pod:/{name}")
        finally:
            os.close(src)
        assert e.value.reason == "checksum_mismatch"
        assert fresh.names() == []


def test_a_dropped_entry_goes_unless_a_replica_maps_it(tmp_path: Path, cache: NodeCache) -> None:
    """What unpublish does to the node's copy of a deleted checkpoint: a replica that
    restored with mapped memory pins it, and a pinned entry is never removed under it."""
    v = cache.get(publish(tmp_path / "pub"), KEY)
    cache.pin(v.entry, "pod-a")
    assert cache.drop(v.entry) is False
    assert (v.path / "images" / "pages-1.img").read_bytes() == PAGES
    cache.unpin_holder("pod-a")
    assert cache.drop(v.entry) is True
    assert cache.names() == [] and cache.drop(v.entry) is False


def test_the_resident_plan_puts_the_newest_entry_first_its_small_files_first(
    tmp_path: Path,
) -> None:
    cache = NodeCache(tmp_path / "cache", budget_bytes=8 << 20)
    old = cache.get(publish(tmp_path / "old", pages=b"o" * len(PAGES)), KEY)
    new = cache.get(publish(tmp_path / "new", pages=b"n" * len(PAGES)), KEY)
    os.utime(cache.entries / old.entry / node_cache.ENTRY_RECORD, (1, 1))
    plan = cache.resident_plan()
    owners = [p.split("/", 1)[0] for p, _ in plan]
    n = owners.count(new.entry)
    assert owners == [new.entry] * n + [old.entry] * (len(plan) - n)
    mine = plan[:n]
    assert [s for _, s in mine] == sorted(s for _, s in mine)
    assert mine[-1] == (f"{new.entry}/images/pages-1.img", len(PAGES))
    assert {p for p, _ in mine} == {
        str(f.relative_to(cache.entries))
        for f in (cache.entries / new.entry).rglob("*")
        if f.is_file()
    }
