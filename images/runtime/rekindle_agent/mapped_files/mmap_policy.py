"""Whether a restore may map the image files instead of copying them (--mmap-restore).

Memory mapped MAP_PRIVATE from pages-N.img acts like anonymous memory except in
a few places (criu-patches/README.md lists them). The patched CRIU handles
what it can see in one VMA (heap and MAP_NORESERVE arenas stay anonymous,
mremap growth is fenced, nothing is mapped under overcommit 2 at restore or on
a noexec mount). What it cannot see is a program's assumptions as a whole: an
allocator that counts on zeros after MADV_DONTNEED, a userfaultfd, arenas that
lost their MAP_NORESERVE mark because overcommit was 2 at dump time, a VMA
count that the split mappings would push past vm.max_map_count. So the agent
records those facts for the whole tree when it dumps (in the signed
manifest), checks the storage and the node when it restores, and maps only
when every check passes; the status says which way it went and why.

The heap (the brk area) is a second, narrower decision (heap_decision): CRIU
maps it only when asked (--mmap-restore-heap), and the agent asks only when the
dumped tree's allocators are glibc malloc's alone, whose main arena never counts
on zeros after MADV_DONTNEED (criu-patches/README.md).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

PROC = Path("/proc")
SYS_VM = Path("/proc/sys/vm")

# Allocators that give memory back with MADV_DONTNEED/MADV_FREE and may count
# on zeros afterwards (jemalloc does); glibc malloc's arenas CRIU recognises.
ALLOCATOR_RE = re.compile(r"lib(jemalloc|tcmalloc(_minimal)?|mimalloc)[.-]")
USERFAULTFD_FD = "anon_inode:[userfaultfd]"
# VmFlags (proc(5)) the mapped memory must not carry: userfaultfd registrations.
UFFD_VMFLAGS = {"um", "uw", "ui"}
# The mmap restore splits VMAs (measured on a PyTorch process: 556 -> 887); keep
# the dumped count at most half of vm.max_map_count so the restored tree has room.
VMA_HEADROOM = 2
# The byte of every mapped pages image that carries the patched CRIU's OFD read
# lock (its lifetime mark): the dump-side guard depends on OFD locks working.
MARK_OFFSET = 0x43524955
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Decision:
    """How a restore brings memory back: mapped from the images or copied, and why."""

    use: bool
    why: str
    heap: bool = False  # the heap (brk area) is mapped too: --mmap-restore-heap

    @property
    def path(self) -> Literal["mmap", "copy"]:
        return "mmap" if self.use else "copy"


# -- dump time: the tree ----------------------------------------------------------------
def read_sysctl(name: str, root: Path = SYS_VM) -> int | None:
    try:
        return int((root / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def process_facts(pid: int, proc: Path = PROC) -> dict[str, Any]:
    """One process: allocator libraries mapped, userfaultfd use, VMA count."""
    allocators: set[str] = set()
    vmas = 0
    uffd_vmas = 0
    try:
        with open(proc / str(pid) / "smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("VmFlags:"):
                    if UFFD_VMFLAGS & set(line.split()[1:]):
                        uffd_vmas += 1
                    continue
                first = line.split(" ", 1)[0]
                if "-" in first and ":" not in first:  # a VMA header: start-end perms ...
                    vmas += 1
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        m = ALLOCATOR_RE.search(os.path.basename(parts[5]))
                        if m:
                            allocators.add(m.group(1))
    except OSError:
        pass
    uffd_fds = 0
    try:
        for name in os.listdir(proc / str(pid) / "fd"):
            try:
                if os.readlink(proc / str(pid) / "fd" / name) == USERFAULTFD_FD:
                    uffd_fds += 1
            except OSError:
                continue
    except OSError:
        pass
    return {
        "allocators": sorted(allocators),
        "vmas": vmas,
        "userfaultfd": uffd_fds + uffd_vmas,
    }


def tree_facts(pids: list[int], proc: Path = PROC, sys_vm: Path = SYS_VM) -> dict[str, Any]:
    """What the manifest records about the dumped tree for the restore's decision."""
    allocators: set[str] = set()
    uffd_pids = []
    max_vmas = 0
    for pid in pids:
        f = process_facts(pid, proc)
        allocators.update(f["allocators"])
        if f["userfaultfd"]:
            uffd_pids.append(pid)
        max_vmas = max(max_vmas, f["vmas"])
    return {
        "allocators": sorted(allocators),
        "userfaultfd_pids": uffd_pids,
        "max_vmas": max_vmas,
        "overcommit_memory": read_sysctl("overcommit_memory", sys_vm),
        "max_map_count": read_sysctl("max_map_count", sys_vm),
    }


def tree_refusals(facts: dict[str, Any], max_map_count: int | None) -> list[str]:
    """Why the dumped tree must not be restored with mapped memory (empty: it may)."""
    out = []
    if facts.get("allocators"):
        out.append(
            f"the tree maps {', '.join(facts['allocators'])}, which may count on zeros "
            "after MADV_DONTNEED"
        )
    if facts.get("userfaultfd_pids"):
        out.append(f"pids {facts['userfaultfd_pids']} use userfaultfd (refused on file VMAs)")
    if facts.get("overcommit_memory") == 2:
        out.append("vm.overcommit_memory was 2 at dump: allocator arenas cannot be told apart")
    vmas = int(facts.get("max_vmas") or 0)
    if max_map_count and vmas * VMA_HEADROOM > max_map_count:
        out.append(
            f"a process has {vmas} VMAs, more than 1/{VMA_HEADROOM} of "
            f"vm.max_map_count {max_map_count}"
        )
    return out


# -- restore time: the storage and the node --------------------------------------------
def ofd_locks_work(path: Path) -> bool:
    """True if F_OFD_GETLK works on path's file system (the lifetime mark needs OFD locks)."""
    cmd = getattr(fcntl, "F_OFD_GETLK", 36)
    # struct flock: l_type, l_whence, (pad), l_start, l_len, l_pid, (pad); l_pid 0 for OFD.
    req = struct.pack("hh4xqqi4x", fcntl.F_RDLCK, os.SEEK_SET, MARK_OFFSET, 1, 0)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, cmd, req)
        return True
    except OSError as e:
        return e.errno not in (errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
    finally:
        os.close(fd)


def storage_refusals(images: Path) -> list[str]:
    """Why the images' storage cannot back mapped memory (empty: it can)."""
    out = []
    try:
        if os.statvfs(images).f_flag & os.ST_NOEXEC:
            out.append(f"{images} is on a noexec mount (executable memory could not map it)")
    except OSError as e:
        return [f"cannot stat {images}: {e.strerror}"]
    pages = sorted(images.glob("pages-*.img"))
    if not pages:
        out.append(f"no pages-*.img in {images}")
    elif not ofd_locks_work(pages[0]):
        out.append(f"{images} is on a file system without OFD locks (no lifetime guard)")
    return out


def heap_decision(criu_has_heap_option: bool, facts: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether a mapped restore maps the heap too, and why. Only glibc malloc's main
    arena is known not to count on zeros after MADV_DONTNEED in the brk area; another
    allocator in the tree, or a manifest that does not say, keeps the heap read."""
    if not criu_has_heap_option:
        return False, "heap read: this CRIU has no --mmap-restore-heap"
    if facts is None or "allocators" not in facts:
        return False, "heap read: the checkpoint does not record the tree's allocators"
    if facts["allocators"]:
        return False, f"heap read: the tree maps {', '.join(facts['allocators'])}"
    return True, "heap mapped too: the tree's only allocator is glibc malloc"


def decide(
    mode: str,
    criu_has_option: bool,
    facts: dict[str, Any] | None,
    images: Path,
    sys_vm: Path = SYS_VM,
    criu_has_heap_option: bool = False,
) -> Decision:
    """The restore's path. auto maps only when every check passes; on maps whenever
    CRIU can (an expert's override: the checks' findings are still reported); off never.
    A mapped restore maps the heap too when heap_decision() allows it."""
    decision = _decide_mapping(mode, criu_has_option, facts, images, sys_vm)
    if not decision.use:
        return decision
    heap, heap_why = heap_decision(criu_has_heap_option, facts)
    return Decision(True, f"{decision.why}; {heap_why}", heap)


def _decide_mapping(
    mode: str,
    criu_has_option: bool,
    facts: dict[str, Any] | None,
    images: Path,
    sys_vm: Path,
) -> Decision:
    """decide() without the heap: whether anything is mapped."""
    if mode == "off":
        return Decision(False, "--mmap-restore off")
    if not criu_has_option:
        return Decision(False, "this CRIU has no --mmap-restore (stock CRIU)")
    found = []
    if facts is None:
        found.append("the checkpoint records no facts about its tree (made by an older agent)")
    else:
        found += tree_refusals(facts, read_sysctl("max_map_count", sys_vm))
    if read_sysctl("overcommit_memory", sys_vm) == 2:
        found.append("vm.overcommit_memory is 2 on this node (CRIU would map nothing)")
    found += storage_refusals(images)
    if mode == "on":
        return Decision(
            True, "--mmap-restore on" + (f" despite: {'; '.join(found)}" if found else "")
        )
    if found:
        return Decision(False, "; ".join(found))
    return Decision(
        True,
        "no jemalloc/tcmalloc/mimalloc or userfaultfd in the tree, overcommit not 2, "
        "VMAs within limits, images on exec storage with OFD locks",
    )
