"""Where a private file mapping is not anonymous memory: each case, stock vs --mmap-restore.

memprobe (tests/criu/memprobe.c) is dumped and restored with stock CRIU and with the
patched CRIU plus --mmap-restore; then it probes, after the restore, each place where
memory mapped from the pages image could behave unlike the anonymous memory it was.
criu-patches/README.md says, for each, whether the patch handles it, keeps such memory
out of the mapping, refuses to map at all, or leaves a documented difference: the
expectations below are that table.
"""

import errno
import shutil
import subprocess
from pathlib import Path

import pytest

from .criu_helpers import Flavor, Probe, criu, log_tail, mapped_from, sysctl

pytestmark = pytest.mark.criu

PAGES = {"plain": 4096, "cow": 4096, "arena": 2048, "wof": 512}


def cycle(flavor: Flavor, probe: Probe, images: Path, *restore_extra: str) -> None:
    """Start (if needed), verify, dump, restore, verify."""
    if not probe.pids:
        probe.start()
    probe.verify_all()
    probe.dump(flavor, images)
    probe.restore(flavor, images, *restore_extra)
    probe.verify_all()


def is_mapped(probe: Probe, region: str, images: Path, d: Path | None = None) -> bool:
    mapped, _ = mapped_from(probe.vmas(region, d), images)
    return bool(mapped)


def check_mapped(flavor: Flavor, probe: Probe, images: Path, region: str = "plain") -> None:
    """The patch took effect where expected (stock maps nothing)."""
    assert is_mapped(probe, region, images) == flavor.mmap, probe.vmas(region)


def test_mremap_growth(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """mremap() growth never reaches other data or the end of the image."""
    img1 = tmp_path / "img1"
    cycle(flavor, probe, img1)
    check_mapped(flavor, probe, img1)
    if flavor.mmap:
        # The merged VMA of c2, c1, c0 (glibc chunks): each chunk starts with an
        # anonymous page, the rest of it maps the image.
        for name in ("c0", "c1", "c2", "chunk"):
            head = probe.vmas(name)[0]
            start = probe.regions()[name][0]
            assert head.start == start - 16 and head.end - head.start == 4096, (name, head)
            assert head.path == "", (name, head)
            assert is_mapped(probe, name, img1), probe.vmas(name)

    # A whole mapped VMA: stock grows it with zeroes; patched refuses (EFAULT)
    # rather than map the image's next bytes.
    out = probe.ok("mremap plain 16")
    if flavor.mmap:
        assert out == f"errno={errno.EFAULT}", out
    else:
        assert out == "old=ok new=zeroes errno=0", out
    # glibc realloc() of mmapped chunks: whatever mremap() does, the data survives
    # and the new part can be written -- also for c0, the topmost chunk in a VMA
    # of three, whose data lies close to the end of the image (SIGBUS if grown there).
    for name in ("c0", "c1", "chunk"):
        assert probe.ok(f"realloc {name} 32") == "data=ok"
    assert probe.ok("exec plain") == "errno=0"
    probe.verify_all()

    # Dump what came of it, restore that and check again.
    img2 = tmp_path / "img2"
    probe.dump(flavor, img2)
    shutil.rmtree(img1)
    probe.restore(flavor, img2)
    probe.verify_all()
    assert probe.ok("realloc c2 32") == "data=ok"
    probe.verify_all()


def test_mremap_past_image_end(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """A mapping grown past the end of the image (by hand): a re-dump survives it."""
    img1 = tmp_path / "img1"
    cycle(flavor, probe, img1)
    # The part of "plain" after its first page, grown by 1 GiB and moved: with
    # the patch, that maps the image far past its end (SIGBUS if touched there).
    assert probe.ok("growpiece plain").startswith("piece=")
    probe.verify_all()
    img2 = tmp_path / "img2"
    probe.dump(flavor, img2)  # must not read past the end of img1's pages image
    probe.restore(flavor, img2)
    probe.verify_all()
    assert probe.ok("lastpage piece") == "last=zeroes"


def test_madv_dontneed(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """MADV_DONTNEED: zeroes on anonymous memory, the image's data on a mapping.

    Decided: a documented difference for plain memory (the first page, anonymous,
    reads zeroes); allocator arenas, which count on zeroes, are not mapped
    (MAP_NORESERVE, the heap; vm.overcommit_memory=2 maps nothing).
    """
    img = tmp_path / "img"
    cycle(flavor, probe, img)
    check_mapped(flavor, probe, img)
    assert not is_mapped(probe, "arena", img)
    out = probe.ok("dontneed plain")
    if flavor.mmap:
        assert out == "zero=1 data=4095 old=0 other=0", out
    else:
        assert out == "zero=4096 data=0 old=0 other=0", out
    assert probe.ok("purge arena") == "zero=2048 data=0 old=0 other=0"
    probe.verify_all()


@pytest.mark.parametrize("op", ["free", "uffd"])
def test_einval_on_a_mapping(op: str, flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """MADV_FREE (a hint; the data stays) and userfaultfd registration fail with EINVAL on
    a file mapping: documented differences. Anonymous memory (the arena) is unaffected."""
    img = tmp_path / "img"
    cycle(flavor, probe, img)
    out = probe.ok(f"{op} plain")
    assert out == (f"errno={errno.EINVAL}" if flavor.mmap else "errno=0"), out
    assert probe.ok(f"{op} arena") == "errno=0"
    probe.verify_all()


def test_wipeonfork(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """MADV_WIPEONFORK from before the dump is kept (such VMAs are read); set after the
    restore on a mapping it fails with EINVAL (documented), and the child sees the data."""
    img = tmp_path / "img"
    cycle(flavor, probe, img)
    assert not is_mapped(probe, "wof", img)
    assert "wf" in probe.vmas("wof")[0].flags
    assert probe.ok("forkread wof") == "zero=512 data=0 old=0 other=0"
    out = probe.ok("wipeonfork plain")
    if flavor.mmap:
        assert out == f"errno={errno.EINVAL}", out
        # madvise() went as far as the anonymous first page
        assert probe.ok("forkread plain") == "zero=1 data=4095 old=0 other=0"
    else:
        assert out == "errno=0", out
        assert probe.ok("forkread plain") == "zero=4096 data=0 old=0 other=0"
    probe.verify_all()


def test_fork_cow(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """fork() after the restore, both processes write (copy-on-write both ways)."""
    img = tmp_path / "img"
    cycle(flavor, probe, img)
    check_mapped(flavor, probe, img, "cow")
    for region in ("cow", "plain"):
        assert probe.ok(f"forkcow {region}") == "child=ok parent=ok"
    probe.verify_all()
    # The image never changes.
    img2 = tmp_path / "img2"
    probe.dump(flavor, img2)
    probe.restore(flavor, img2)
    probe.verify_all()


def test_exec_on_noexec_mount(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """Images on a noexec mount: a mapping could never become PROT_EXEC, so nothing is
    mapped (refused when detected); mprotect(PROT_EXEC) works after the restore."""
    mnt = tmp_path / "noexec"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "noexec,size=1g", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, f"cannot mount a noexec tmpfs (root needed): {res.stderr.strip()}"
    try:
        img = mnt / "img"
        cycle(flavor, probe, img)
        assert not any(v.path.startswith(str(mnt)) for v in probe.vmas("plain"))
        if flavor.mmap:
            log = (img / "restore.log").read_text()
            assert "on a noexec mount" in log and "nothing is mapped" in log, log_tail(
                img / "restore.log"
            )
        assert probe.ok("exec plain") == "errno=0"
        probe.verify_all()
    finally:
        probe.kill()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_thp_always(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """Transparent huge pages enabled=always: same data, fork and COW; the mapped memory
    is page cache until written, so it has no huge pages (a performance difference)."""
    knob = "/sys/kernel/mm/transparent_hugepage/enabled"
    assert Path(knob).exists(), f"no {knob}: a kernel without transparent huge pages"
    with sysctl(knob, "always"):
        probe.start()
        before = sum(v.fields.get("AnonHugePages", 0) for v in probe.vmas("plain"))
        img = tmp_path / "img"
        cycle(flavor, probe, img)
        after = sum(v.fields.get("AnonHugePages", 0) for v in probe.vmas("plain"))
        assert probe.ok("forkcow plain") == "child=ok parent=ok"
        probe.verify_all()
    print(
        f"THP always, {flavor.name}: AnonHugePages of 16 MiB 'plain': {before} kB before "
        f"the dump, {after} kB after the restore"
    )
    if flavor.mmap:
        assert after == 0
        check_mapped(flavor, probe, img)


def test_overcommit_never(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """vm.overcommit_memory=2: MAP_NORESERVE is dropped, so a jemalloc-style arena
    (which purges with MADV_DONTNEED and counts on zeroes) cannot be told apart. The
    patched restore maps nothing then (refused when detected); the purge reads zeroes."""
    img = tmp_path / "img"
    # The commit limit goes up 1000-fold for the few seconds mode 2 is on, so
    # that nothing else on the machine fails to allocate meanwhile.
    with (
        sysctl("/proc/sys/vm/overcommit_ratio", "100000"),
        sysctl("/proc/sys/vm/overcommit_memory", "2"),
    ):
        probe.start()
        assert "nr" not in probe.vmas("arena")[0].flags
        cycle(flavor, probe, img)
    if flavor.mmap:
        log = (img / "restore.log").read_text()
        assert "vm.overcommit_memory=2" in log and "nothing is mapped" in log, log_tail(
            img / "restore.log"
        )
    assert not any("pages-" in v.path for name in PAGES for v in probe.vmas(name))
    assert probe.ok("purge arena") == "zero=2048 data=0 old=0 other=0"
    probe.verify_all()


def soft_dirty(criu_prefix: Path) -> bool:
    res = subprocess.run(
        [str(criu_prefix / "stock" / "criu"), "check", "--feature", "mem_dirty_track"],
        capture_output=True,
        text=True,
        check=False,
    )
    return res.returncode == 0


def test_predump_chain(flavor: Flavor, probe: Probe, tmp_path: Path, criu_prefix: Path) -> None:
    """A restored process, pre-dumped and dumped (--track-mem, parent images): a page
    written before the pre-dump and dropped with MADV_DONTNEED after it must come back
    as what the process reads now, not as the pre-dump's copy."""
    if not soft_dirty(criu_prefix):
        # The one documented skip of the CRIU suite, like a GPU test without a GPU: the
        # feature under test cannot exist on such a kernel. It runs on kernels built
        # with CONFIG_MEM_SOFT_DIRTY (Debian's); the development VMs' kernel is not.
        pytest.skip(
            "no soft-dirty tracking in this kernel (CONFIG_MEM_SOFT_DIRTY is not set): "
            "`criu check --feature mem_dirty_track` fails, so pre-dump cannot run here"
        )
    img1 = tmp_path / "img1"
    cycle(flavor, probe, img1)
    assert probe.ok("refill cow") == ""  # generation 1, written: anonymous pages now
    pre = tmp_path / "chain" / "pre"
    probe.dump(flavor, pre, "pre-dump", "--track-mem")
    out = probe.ok("dontneed cow")  # patched: back to the image (generation 0)
    if flavor.mmap:
        assert out == "zero=1 data=0 old=4095 other=0", out
    else:
        assert out == "zero=4096 data=0 old=0 other=0", out
    final = tmp_path / "chain" / "final"
    probe.dump(flavor, final, "--track-mem", "--prev-images-dir", "../pre")
    probe.restore(flavor, final)
    probe.verify_all()


def test_process_tree(flavor: Flavor, memprobe: Path, tmp_path: Path) -> None:
    """A root with two children (their inherited memory COW-shared, plus their own):
    every task restored, its own memory mapped from its own image, its own log lines."""
    probe = Probe(memprobe, tmp_path / "run", children=2)
    try:
        img1 = tmp_path / "img1"
        cycle(flavor, probe, img1)
        images = set()
        for d in probe.dirs()[1:]:
            assert probe.ok("forkcow own", d) == "child=ok parent=ok"
            mapped, _ = mapped_from(probe.vmas("own", d), img1)
            assert bool(mapped) == flavor.mmap, probe.vmas("own", d)
            images |= {v.path for v in mapped}
        if flavor.mmap:
            assert len(images) == 2, images  # one pages image per task
            log = (img1 / "restore.log").read_text().splitlines()
            for pid in probe.pids:
                said = [ln for ln in log if f" {pid}: mmap-restore:" in ln]
                # Each task says why it reads what it reads (COW-shared memory is premapped)
                assert said, (pid, log[-50:])
        probe.verify_all()
        img2 = tmp_path / "img2"
        probe.dump(flavor, img2)
        shutil.rmtree(img1)
        probe.restore(flavor, img2)
        probe.verify_all()
    finally:
        probe.kill()


def test_guard_region(flavor: Flavor, probe: Probe, tmp_path: Path) -> None:
    """A VMA with a guard region (MADV_GUARD_INSTALL) is read, the others still mapped."""
    probe.start()
    assert (probe.run / "guard").exists(), "no MADV_GUARD_INSTALL on this kernel (6.13 or later)"
    res = criu(flavor, "check", "--feature", "pagemap_scan_guard_pages")
    assert res.returncode == 0, (
        f"CRIU cannot see guard regions on this kernel (no PAGEMAP_SCAN guard pages): "
        f"{res.stdout}{res.stderr}"
    )
    img = tmp_path / "img"
    cycle(flavor, probe, img)
    assert not is_mapped(probe, "guarded", img)
    check_mapped(flavor, probe, img, "chunk")
    if flavor.mmap:
        assert "mmap-restore: guard-region VMAs are read" in (img / "restore.log").read_text()
