"""Real CRIU dump/restore of a process with a mix of memory, stock and with --mmap-restore.

Every scenario runs against stock CRIU 4.2.1 and against the patched build with
--mmap-restore: the process must not be able to tell the difference. The patched
runs also check that the patch took effect (the restored VMAs map pages-*.img),
and that it fell back to reading where a file mapping would change semantics.
"""

import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .criu_helpers import Flavor, cmdline_has, flavors, wait_gone

pytestmark = pytest.mark.criu

BIG_MIB = 64
MEMMIX = b"memmix"
CRIU_TIMEOUT = 120

# Regions of memmix.c that --mmap-restore maps from the image, and those it must
# read instead (the fallbacks), with the VmFlags each must keep either way.
MAPPED = ("big", "zeros", "ro", "dontfork", "malloc", "holey")
READ = ("sparse", "wipeonfork", "hugepage", "noreserve", "growsdown", "shared")
VMFLAGS = {
    "wipeonfork": "wf",
    "dontfork": "dc",
    "hugepage": "hg",
    "noreserve": "nr",
    "growsdown": "gd",
}
# One log line per fallback class (and task), see criu-patches/0005.
FALLBACK_LOGS = ("short runs", "MAP_GROWSDOWN", "MAP_NORESERVE", "madvise()d", "heap")


def _is_memmix(pid: int) -> bool:
    return cmdline_has(pid, MEMMIX)


@dataclass
class Memmix:
    """One memmix process, through its dumps and restores."""

    binary: Path
    run: Path
    pid: int = 0
    popen: subprocess.Popen[bytes] | None = None
    pids: set[int] = field(default_factory=set)

    def start(self) -> None:
        self.run.mkdir(parents=True, exist_ok=True)
        with open(self.run / "out.log", "wb") as log:
            self.popen = subprocess.Popen(
                [str(self.binary), str(self.run), str(BIG_MIB)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self.pids.add(self.pid)
        deadline = time.monotonic() + 30
        while not (self.run / "ready").exists():
            assert self.popen.poll() is None, (self.run / "out.log").read_text()
            assert time.monotonic() < deadline, "memmix did not get ready"
            time.sleep(0.02)

    def seq(self) -> int:
        return int((self.run / "result").read_text().split()[0])

    def command(self, sig: int) -> str:
        """Send SIGUSR1 (verify) or SIGUSR2 (write, then verify); return the result line."""
        before = self.seq()
        os.kill(self.pid, sig)
        deadline = time.monotonic() + 60
        while self.seq() == before:
            assert _is_memmix(self.pid), "memmix died"
            assert time.monotonic() < deadline, "memmix did not answer"
            time.sleep(0.02)
        return (self.run / "result").read_text().strip()

    def verify(self, gen: int) -> None:
        line = self.command(signal.SIGUSR1)
        assert line.endswith(f" OK gen={gen}"), line

    def mutate(self, gen: int) -> None:
        line = self.command(signal.SIGUSR2)
        assert line.endswith(f" OK gen={gen}"), line

    def regions(self) -> dict[str, tuple[int, int]]:
        out = {}
        for line in (self.run / "regions").read_text().splitlines():
            name, start, end = line.split()
            out[name] = (int(start, 16), int(end, 16))
        return out

    def smaps(self) -> list[tuple[int, int, str, str]]:
        """(start, end, path, VmFlags) of every VMA of the process."""
        vmas: list[tuple[int, int, str, str]] = []
        cur: list = []
        for line in Path(f"/proc/{self.pid}/smaps").read_text().splitlines():
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
            if m:
                cur = [int(m[1], 16), int(m[2], 16), m[3], ""]
            elif line.startswith("VmFlags:"):
                cur[3] = line.split(":", 1)[1].strip()
                vmas.append((cur[0], cur[1], cur[2], cur[3]))
        return vmas

    def vmas_of(self, name: str) -> list[tuple[int, int, str, str]]:
        start, end = self.regions()[name]
        return [v for v in self.smaps() if v[0] < end and v[1] > start]


@pytest.fixture
def memmix_proc(memmix: Path, tmp_path: Path) -> Iterator[Memmix]:
    proc = Memmix(memmix, tmp_path / "run")
    try:
        yield proc
    finally:
        # Kill whatever is left: the original process and every restored one.
        for pid in sorted(proc.pids):
            if _is_memmix(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.kill()
        if proc.popen is not None:
            proc.popen.wait(timeout=30)
        for pid in proc.pids:
            wait_gone(pid)


def criu(flavor: Flavor, *args: str, timeout: float = CRIU_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(flavor.criu), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def dump(flavor: Flavor, proc: Memmix, images: Path, *extra: str) -> None:
    images.mkdir(parents=True)
    res = criu(flavor, "dump", "-t", str(proc.pid), "-D", str(images), "-v4", "-o", "dump.log",
               *extra)  # fmt: skip
    assert res.returncode == 0, (images / "dump.log").read_text()[-3000:]
    if proc.popen is not None and proc.popen.pid == proc.pid:
        proc.popen.wait(timeout=30)
    wait_gone(proc.pid)


def restore(flavor: Flavor, proc: Memmix, images: Path, *extra: str) -> None:
    pidfile = images / "restore.pid"
    res = criu(flavor, "restore", "-D", str(images), "-d", "--pidfile", str(pidfile),
               "-v4", "-o", "restore.log", *flavor.restore_args, *extra)  # fmt: skip
    assert res.returncode == 0, (images / "restore.log").read_text()[-3000:]
    pid = int(pidfile.read_text())
    assert pid == proc.pid
    proc.pids.add(pid)
    assert _is_memmix(pid)


def pages_images(images: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(images.glob("pages-*.img"))
    }


def check_layout(flavor: Flavor, proc: Memmix, images: Path) -> None:
    """Where the patch maps and where it must fall back; VmFlags survive either way."""
    image_paths = {str(p) for p in images.glob("pages-*.img")}
    for name in MAPPED + READ:
        vmas = proc.vmas_of(name)
        assert vmas, name
        paths = {v[2] for v in vmas}
        if flavor.mmap and name in MAPPED:
            # The first page of a mapped run stays anonymous (mremap() cannot grow
            # across it), the rest maps the image; holes stay anonymous.
            head, rest = vmas[0], vmas[1:]
            assert head[1] - head[0] == 4096 and head[2] == "", (name, head)
            assert {v[2] for v in rest} & image_paths, (name, paths)
            assert {v[2] for v in rest} <= image_paths | {""}, (name, paths)
        else:
            assert not any("pages-" in p for p in paths), (name, paths)
    for name, flag in VMFLAGS.items():
        for vma in proc.vmas_of(name):
            assert flag in vma[3].split(), (name, vma)
    # Nothing anywhere in the process maps an image unless asked to.
    if not flavor.mmap:
        assert not any("pages-" in v[2] for v in proc.smaps())


def check_restore_log(flavor: Flavor, images: Path) -> None:
    log = (images / "restore.log").read_text()
    if not flavor.mmap:
        assert "mmap-restore" not in log
        return
    assert re.search(r"mmap-restore: mapping \d+ ranges \(\d+ KiB\) from pages-\d+\.img", log)
    for reason in FALLBACK_LOGS:
        hits = [ln for ln in log.splitlines() if "mmap-restore: " + reason in ln]
        assert len(hits) == 1, (reason, hits)


def test_dump_restore_redump(flavor: Flavor, memmix_proc: Memmix, tmp_path: Path) -> None:
    proc = memmix_proc
    proc.start()
    proc.verify(gen=0)

    first = tmp_path / "img1"
    dump(flavor, proc, first)
    hashes = pages_images(first)
    assert hashes

    restore(flavor, proc, first)
    check_restore_log(flavor, first)
    check_layout(flavor, proc, first)
    proc.verify(gen=0)

    # Write into restored pages: copy on write must not reach the image.
    proc.mutate(gen=1)
    proc.verify(gen=1)
    assert pages_images(first) == hashes

    # A second checkpoint of the restored process must be complete on its own.
    second = tmp_path / "img2"
    dump(flavor, proc, second)
    if flavor.mmap:
        assert "dumping it as anonymous memory" in (second / "dump.log").read_text()
    subprocess.run(["rm", "-rf", str(first)], check=True)

    restore(flavor, proc, second)
    check_layout(flavor, proc, second)
    proc.verify(gen=1)
    proc.mutate(gen=2)
    proc.verify(gen=2)
    assert not any(str(first) in v[2] for v in proc.smaps())


# Not stock with a truncated image: stock CRIU 4.2.1 spins forever in the restorer's
# preadv() loop on a short pages image (criu-patches/0001 fixes it); only the fix is
# ours to assert.
@pytest.mark.parametrize(
    ("flavor_name", "damage"),
    [("stock", "missing"), ("patched", "truncated"), ("patched", "missing")],
)
def test_damaged_pages_image_fails_cleanly(
    flavor_name: str, damage: str, criu_prefix: Path, memmix_proc: Memmix, tmp_path: Path
) -> None:
    flavor = flavors(criu_prefix)[flavor_name]
    proc = memmix_proc
    proc.start()
    images = tmp_path / "img"
    dump(flavor, proc, images)
    # The task's own pages image is the largest one (the other holds shared memory).
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    if damage == "truncated":
        os.truncate(pages, pages.stat().st_size // 2)
    else:
        pages.unlink()

    pidfile = images / "restore.pid"
    res = criu(flavor, "restore", "-D", str(images), "-d", "--pidfile", str(pidfile),
               "-v4", "-o", "restore.log", *flavor.restore_args)  # fmt: skip
    assert res.returncode != 0
    log = (images / "restore.log").read_text()
    assert "Restoring FAILED" in log
    # Stock fails too, but says only "Can't read pages data (-9)" for a missing image.
    if damage == "truncated":
        assert "The pages image is truncated: its pagemap needs" in log, log[-2000:]
    elif flavor.name == "patched":
        assert f"{pages.name} is missing, but the pagemap lists pages in it" in log, log[-2000:]
    else:
        assert "Can't read pages data" in log, log[-2000:]
    assert not pidfile.exists()
    # No half-alive process is left behind.
    wait_gone(proc.pid)
    assert not _is_memmix(proc.pid)


@pytest.mark.parametrize("mode", ["auto-dedup", "parent-images"])
def test_whole_task_fallbacks(
    criu_prefix: Path, memmix_proc: Memmix, tmp_path: Path, mode: str
) -> None:
    """With --auto-dedup or pre-dump images nothing can be mapped: read all, say so once."""
    flavor = flavors(criu_prefix)["patched"]
    proc = memmix_proc
    proc.start()
    images = tmp_path / "img"
    if mode == "parent-images":
        # Soft-dirty tracking (pre-dump --track-mem) is not available on every kernel.
        # The restore takes the parent-images path whenever the image directory has
        # a "parent" link to images of the same task: give it one.
        proc.mutate(gen=1)
        dump(flavor, proc, images)
        shutil.copytree(images, tmp_path / "pre", symlinks=True)
        (images / "parent").symlink_to("../pre")
        expected = "images with a parent (pre-dump): all memory is read"
        restore(flavor, proc, images)
    else:
        dump(flavor, proc, images)
        expected = "--auto-dedup punches holes into the image: all memory is read"
        restore(flavor, proc, images, "--auto-dedup")
    log = (images / "restore.log").read_text()
    assert log.count(expected) == 1, log[-3000:]
    assert "--mmap-restore has no effect" in log or mode == "parent-images"
    assert not any("pages-" in v[2] for v in proc.smaps())
    proc.verify(gen=1 if mode == "parent-images" else 0)


def test_option_from_config_file(criu_prefix: Path, memmix_proc: Memmix, tmp_path: Path) -> None:
    """`mmap-restore` in a configuration file works like --mmap-restore."""
    flavor = Flavor("patched", criu_prefix / "patched" / "criu", ())
    proc = memmix_proc
    proc.start()
    images = tmp_path / "img"
    dump(flavor, proc, images)
    config = tmp_path / "criu.conf"
    config.write_text("mmap-restore\n")
    restore(flavor, proc, images, "--config", str(config))
    check_layout(Flavor("patched", flavor.criu, ("--mmap-restore",)), proc, images)
    proc.verify(gen=0)
