"""The lifetime of a mapped pages image: CRIU itself must not destroy it.

A process restored with --mmap-restore maps its pages image for as long as it lives.
The patched CRIU marks the image's open file (an OFD read lock on one byte, which lives
as long as the mappings do) and refuses to dump into a directory holding such an image,
under any name, and to deduplicate it; a later dump recognises the mapped memory by that
mark, not by the file's name. Patched CRIU only: stock CRIU never maps an image.
"""

import hashlib
import os
import re
import shutil
import socket
from pathlib import Path

import pytest

from .criu_helpers import Flavor, Probe, criu, criu_dump, log_tail

pytestmark = pytest.mark.criu

# An OFD read lock on byte 0x43524955 ("CRIU") of the image: criu-patches, image.h
MARK = 0x43524955


def sha(images: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(images.glob("*.img"))
    }


def restored(patched: Flavor, probe: Probe, images: Path) -> Path:
    """Start, dump, restore with --mmap-restore; returns the task's (largest) pages image."""
    probe.start()
    probe.dump(patched, images)
    probe.restore(patched, images)
    probe.verify_all()
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    assert any(v.path == str(pages) for v in probe.vmas("plain")), "nothing mapped"
    return pages


def marks(path: Path) -> list[str]:
    """/proc/locks lines that are the mmap-restore mark on path's inode."""
    st = path.stat()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return [
        ln
        for ln in Path("/proc/locks").read_text().splitlines()
        if "OFDLCK" in ln and " READ " in ln and dev in ln and f" {MARK} {MARK}" in ln
    ]


def test_dump_into_the_restored_from_dir_is_refused(
    patched: Flavor, probe: Probe, tmp_path: Path
) -> None:
    images = tmp_path / "img"
    pages = restored(patched, probe, images)
    assert marks(pages), Path("/proc/locks").read_text()
    before = sha(images)

    res = criu_dump(patched, probe.root, images)
    assert res.returncode != 0
    log = (images / "dump.log").read_text()
    assert (
        f"{pages.name} in the images directory is mapped by tasks restored with --mmap-restore"
        in log
    ), log[-2000:]
    # Nothing was frozen, nothing written: the process runs on, its image intact.
    probe.verify_all()
    assert sha(images) == before

    # The page server (it writes pages images too) refuses as well, before it listens.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = criu(
        patched,
        "page-server",
        "-D",
        str(images),
        "--port",
        str(port),
        "-v4",
        "-o",
        "ps.log",
        timeout=30,
    )
    assert res.returncode != 0
    assert "is mapped by tasks restored with --mmap-restore" in (images / "ps.log").read_text()

    # The mark goes with the last mapping: then the directory may be reused.
    probe.kill()
    assert not marks(pages)
    other = Probe(probe.binary, tmp_path / "run2")
    try:
        other.start()
        other.dump(patched, images)
    finally:
        other.kill()


@pytest.mark.parametrize("how", ["hardlink", "symlink", "renamed"])
def test_the_image_under_another_name_is_refused(
    patched: Flavor, probe: Probe, tmp_path: Path, how: str
) -> None:
    """The image is known by its inode: a hard link, a symlink (followed by O_TRUNC) or
    a renamed image in another directory still refuses a dump into that directory."""
    images = tmp_path / "img"
    pages = restored(patched, probe, images)
    other = tmp_path / "other"
    other.mkdir()
    if how == "hardlink":
        os.link(pages, other / "pages-1.img")
    elif how == "symlink":
        (other / "pages-1.img").symlink_to(pages)
    else:
        os.rename(pages, other / "blob.img")
    res = criu_dump(patched, probe.root, other)
    assert res.returncode != 0
    assert "is mapped by tasks restored with --mmap-restore" in (other / "dump.log").read_text()
    probe.verify_all()


def test_dedup_is_refused(patched: Flavor, probe: Probe, tmp_path: Path) -> None:
    """criu dedup (and --auto-dedup, same code) would punch holes into the mapped image."""
    images = tmp_path / "img"
    restored(patched, probe, images)
    before = sha(images)
    # A newer image set whose parent is the mapped one: dedup punches the parent.
    child = tmp_path / "child"
    shutil.copytree(images, child)
    (child / "parent").symlink_to("../img")
    res = criu(patched, "dedup", "-D", str(child), "-v4", "-o", "dedup.log")
    assert res.returncode != 0
    log = (child / "dedup.log").read_text()
    assert re.search(
        r"pages-\d+\.img is mapped by tasks restored with --mmap-restore: deduplicating", log
    ), log[-2000:]
    assert sha(images) == before
    probe.verify_all()


def test_renamed_image_is_still_recognised(patched: Flavor, probe: Probe, tmp_path: Path) -> None:
    """A later dump recognises the mapped memory by the mark, not by the file's name."""
    images = tmp_path / "img"
    pages = restored(patched, probe, images)
    moved = tmp_path / "moved"
    moved.mkdir()
    os.rename(pages, moved / "renamed")
    assert any(v.path == str(moved / "renamed") for v in probe.vmas("plain"))
    second = tmp_path / "img2"
    probe.dump(patched, second)
    assert "dumping it as anonymous memory" in (second / "dump.log").read_text()
    shutil.rmtree(images)
    shutil.rmtree(moved)
    probe.restore(patched, second)
    probe.verify_all()


def test_file_named_like_an_image_is_a_file(
    patched: Flavor, memprobe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process's own private mapping of a file called pages-1.img is a file mapping."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "pages-1.img").write_bytes(os.urandom(1 << 20))
    env_probe = Probe(memprobe, tmp_path / "run")
    with monkeypatch.context() as m:  # memprobe maps the file it names
        m.setenv("MEMPROBE_MAPFILE", str(own / "pages-1.img"))
        env_probe.start()
    try:
        images = tmp_path / "img"
        env_probe.dump(patched, images)
        log = (images / "dump.log").read_text()
        assert "dumping it as anonymous memory" not in log, log_tail(images / "dump.log")
        env_probe.restore(patched, images)
        env_probe.verify_all()
        assert any(v.path == str(own / "pages-1.img") for v in env_probe.vmas("file"))
    finally:
        env_probe.kill()


def test_stock_dump_refuses_nothing(criu_prefix: Path, memprobe: Path, tmp_path: Path) -> None:
    """Without --mmap-restore nothing is marked: a dump over old images works as before."""
    stock = Flavor("stock", criu_prefix / "stock" / "criu", ())
    patched = Flavor("patched", criu_prefix / "patched" / "criu", ())
    for flavor in (stock, patched):
        images = tmp_path / f"img-{flavor.name}"
        p = Probe(memprobe, tmp_path / f"run-{flavor.name}")
        try:
            p.start()
            p.dump(flavor, images)
            p.restore(flavor, images)
            p.verify_all()
            res = criu_dump(flavor, p.root, images)
            assert res.returncode == 0, log_tail(images / "dump.log")
        finally:
            p.kill()
