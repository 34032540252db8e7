"""The agent's choice between mapping and copying a checkpoint's memory, and the immutable
flag on its pages images. Real processes and files; fake /proc and /proc/sys/vm trees
where a node setting must differ from this machine's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rekindle_agent.checkpointing import criu
from rekindle_agent.mapped_files import immutable, mmap_policy
from rekindle_agent.mapped_files.mmap_policy import decide, tree_refusals
from rekindle_dev.testenv import require

SAFE = {
    "allocators": [],
    "userfaultfd_pids": [],
    "max_vmas": 900,
    "overcommit_memory": 0,
    "max_map_count": 65530,
}


def sysctls(tmp: Path, overcommit: int = 0, max_map_count: int = 65530) -> Path:
    d = tmp / "vm"
    d.mkdir(exist_ok=True)
    (d / "overcommit_memory").write_text(f"{overcommit}\n")
    (d / "max_map_count").write_text(f"{max_map_count}\n")
    return d


def images(tmp: Path) -> Path:
    d = tmp / "images"
    d.mkdir(parents=True, exist_ok=True)
    (d / "pages-1.img").write_bytes(b"\0" * 4096)
    return d


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"allocators": ["jemalloc"]}, "jemalloc"),
        ({"userfaultfd_pids": [12]}, "userfaultfd"),
        ({"overcommit_memory": 2}, "overcommit_memory was 2"),
        ({"max_vmas": 40000}, "40000 VMAs"),
    ],
)
def test_each_tree_fact_refuses(change: dict, expect: str) -> None:
    assert tree_refusals(SAFE, 65530) == []
    (why,) = tree_refusals({**SAFE, **change}, 65530)
    assert expect in why


def test_auto_maps_only_when_every_check_passes(tmp_path: Path) -> None:
    vm, img = sysctls(tmp_path), images(tmp_path)
    d = decide("auto", True, SAFE, img, vm)
    assert d.use and d.path == "mmap" and "no jemalloc" in d.why
    d = decide("auto", True, {**SAFE, "allocators": ["tcmalloc"]}, img, vm)
    assert not d.use and d.path == "copy" and "tcmalloc" in d.why
    # The node's own settings count at restore time: a lower max_map_count here...
    d = decide("auto", True, SAFE, img, sysctls(tmp_path, max_map_count=1000))
    assert not d.use and "max_map_count 1000" in d.why
    # ... and overcommit 2 now (CRIU would map nothing anyway).
    d = decide("auto", True, SAFE, img, sysctls(tmp_path, overcommit=2))
    assert not d.use and "overcommit_memory is 2 on this node" in d.why
    # A checkpoint from an agent that recorded nothing is not trusted with the option.
    d = decide("auto", True, None, img, sysctls(tmp_path))
    assert not d.use and "older agent" in d.why


def test_off_stock_and_on(tmp_path: Path) -> None:
    vm, img = sysctls(tmp_path), images(tmp_path)
    assert decide("off", True, SAFE, img, vm).why == "--mmap-restore off"
    assert "stock CRIU" in decide("auto", False, SAFE, img, vm).why
    forced = decide("on", True, {**SAFE, "allocators": ["jemalloc"]}, img, vm)
    assert forced.use and "despite" in forced.why and "jemalloc" in forced.why


def test_heap_mapped_only_for_a_glibc_only_tree(tmp_path: Path) -> None:
    vm, img = sysctls(tmp_path), images(tmp_path)
    d = decide("auto", True, SAFE, img, vm, criu_has_heap_option=True)
    assert d.use and d.heap and "heap mapped too" in d.why and "no jemalloc" in d.why
    # A CRIU without --mmap-restore-heap (an older patched build): the heap is read.
    d = decide("auto", True, SAFE, img, vm)
    assert d.use and not d.heap and "no --mmap-restore-heap" in d.why
    # Forced on with jemalloc in the tree: memory mapped, the heap still read.
    d = decide("on", True, {**SAFE, "allocators": ["jemalloc"]}, img, vm, criu_has_heap_option=True)
    assert d.use and not d.heap and "heap read: the tree maps jemalloc" in d.why
    # Nothing mapped: nothing said about the heap.
    d = decide("off", True, SAFE, img, vm, criu_has_heap_option=True)
    assert not d.use and not d.heap and "heap" not in d.why


@pytest.mark.parametrize(
    ("facts", "expect"),
    [
        (None, "does not record the tree's allocators"),
        ({k: v for k, v in SAFE.items() if k != "allocators"}, "does not record"),
        ({**SAFE, "allocators": ["mimalloc", "tcmalloc"]}, "mimalloc, tcmalloc"),
    ],
)
def test_heap_read_without_the_facts_or_with_another_allocator(
    facts: dict | None, expect: str
) -> None:
    heap, why = mmap_policy.heap_decision(True, facts)
    assert not heap and why.startswith("heap read") and expect in why
    assert mmap_policy.heap_decision(True, SAFE) == (
        True,
        "heap mapped too: the tree's only allocator is glibc malloc",
    )


def test_restore_argv_maps_the_heap_only_with_mmap() -> None:
    both = criu.restore_argv("/c/criu", "/i", "/l", "/p", mmap=True, mmap_heap=True)
    assert both.index(criu.MMAP_RESTORE_HEAP_FLAG) == both.index(criu.MMAP_RESTORE_FLAG) + 1
    plain = criu.restore_argv("/c/criu", "/i", "/l", "/p", mmap=True)
    assert criu.MMAP_RESTORE_HEAP_FLAG not in plain and criu.MMAP_RESTORE_FLAG in plain
    copy = criu.restore_argv("/c/criu", "/i", "/l", "/p", mmap_heap=True)
    assert criu.MMAP_RESTORE_HEAP_FLAG not in copy and criu.MMAP_RESTORE_FLAG not in copy
    # A build without the heap option is told apart from one with it.
    assert not criu.supports_option("  --mmap-restore   map ...\n", criu.MMAP_RESTORE_HEAP_FLAG)
    assert criu.supports_option("  --mmap-restore-heap   with ...\n", criu.MMAP_RESTORE_HEAP_FLAG)


def test_storage_without_pages_or_on_noexec(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no pages-*.img" in decide("auto", True, SAFE, empty, sysctls(tmp_path)).why


def test_images_on_a_noexec_mount_are_copied(tmp_path: Path, require_root: None) -> None:
    mnt = tmp_path / "noexec"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,size=1m", "tmpfs", str(mnt)], check=True)
    try:
        d = decide("auto", True, SAFE, images(mnt), sysctls(tmp_path))
        assert not d.use and "noexec" in d.why
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_ofd_locks_work_here(tmp_path: Path) -> None:
    f = images(tmp_path) / "pages-1.img"
    assert mmap_policy.ofd_locks_work(f)
    assert not mmap_policy.ofd_locks_work(tmp_path / "missing")


def fake_proc(tmp: Path, pid: int, smaps: str, fds: dict[str, str]) -> Path:
    d = tmp / "proc" / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "smaps").write_text(smaps)
    for n, target in fds.items():
        os.symlink(target, d / "fd" / n)
    return tmp / "proc"


SMAPS = """\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
VmFlags: rd wr mr mw me ac
7f0000000000-7f0000100000 r-xp 00000000 08:01 42    /usr/lib/x86_64-linux-gnu/libjemalloc.so.2
Size:               1024 kB
VmFlags: rd ex mr mw me
7f0000200000-7f0000300000 rw-p 00000000 00:00 0
Size:               1024 kB
VmFlags: rd wr mr mw me ac um
"""


def test_tree_facts_from_proc(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 7, SMAPS, {"0": "/dev/null", "3": mmap_policy.USERFAULTFD_FD})
    facts = mmap_policy.tree_facts([7], proc, sysctls(tmp_path, overcommit=1))
    assert facts["allocators"] == ["jemalloc"]
    assert facts["userfaultfd_pids"] == [7]
    assert facts["max_vmas"] == 3
    assert facts["overcommit_memory"] == 1


def test_tree_facts_of_a_real_python() -> None:
    """This interpreter: glibc malloc, no userfaultfd, a few hundred VMAs."""
    facts = mmap_policy.tree_facts([os.getpid()])
    assert facts["allocators"] == [] and facts["userfaultfd_pids"] == []
    assert 10 < facts["max_vmas"] < facts["max_map_count"]


def test_a_preloaded_allocator_is_seen(tmp_path: Path) -> None:
    """A library named like jemalloc, LD_PRELOADed into a real process, is found in its maps."""
    require("gcc")
    lib = tmp_path / "libjemalloc.so.2"
    src = tmp_path / "fake.c"
    src.write_text("int rekindle_fake_allocator;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "LD_PRELOAD": str(lib)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        facts = mmap_policy.tree_facts([child.pid])
        assert facts["allocators"] == ["jemalloc"]
        assert tree_refusals(facts, facts["max_map_count"])
    finally:
        child.kill()
        child.wait()


def test_immutable_pages_stop_root_and_remove_tree_clears_them(
    tmp_path: Path, require_root: None
) -> None:
    ckpt = tmp_path / "ckpt"
    img = images(ckpt)
    (img / "core-1.img").write_bytes(b"core")
    os.symlink("/etc/hostname", ckpt / "link")  # removed, never followed
    assert immutable.protect_pages(img) == []
    assert immutable.is_immutable(img / "pages-1.img")
    assert not immutable.is_immutable(img / "core-1.img")
    with pytest.raises(PermissionError):
        (img / "pages-1.img").write_bytes(b"overwrite")
    with pytest.raises(PermissionError):
        os.unlink(img / "pages-1.img")
    immutable.remove_tree(ckpt)
    assert not ckpt.exists() and Path("/etc/hostname").exists()
    immutable.remove_tree(ckpt)  # already gone: nothing to do


def test_remove_tree_via_the_cli(tmp_path: Path) -> None:
    from rekindle_agent.cli import main

    d = tmp_path / "c"
    (d / "images").mkdir(parents=True)
    (d / "images" / "pages-1.img").write_bytes(b"p")
    assert main(["remove-checkpoint", str(d)]) == 0
    assert not d.exists()


def test_checkpoint_bound_read_only_in_a_mount_namespace(
    tmp_path: Path, require_root: None
) -> None:
    """In a new mount namespace (as in a pod): writes fail with EROFS; the host sees no change."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{}")
    script = (
        "import sys, errno; from pathlib import Path\n"
        "from rekindle_agent.mapped_files import mounts\n"
        "p = Path(sys.argv[1]); mounts.bind_read_only(p)\n"
        "assert mounts.is_read_only_mount(p)\n"
        "try:\n    (p / 'new').write_text('x')\nexcept OSError as e:\n"
        "    assert e.errno == errno.EROFS, e\n    print('refused')\n"
    )
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script, str(ckpt)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr
    from rekindle_agent.mapped_files import mounts

    assert not mounts.is_read_only_mount(ckpt)  # this namespace: untouched, still writable
    (ckpt / "new").write_text("x")
