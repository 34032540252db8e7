"""Real CRIU dump/restore of glibc's heap with --mmap-restore --mmap-restore-heap.

heapprobe.c keeps a few hundred malloc() chunks in the brk area. With the heap
option the patched CRIU maps the heap from the pages image like other private
memory; glibc's malloc must not be able to tell: the chunks keep their data,
calloc() still returns zeroes where malloc_trim() made pages read as the
image's data again (MADV_DONTNEED on a file mapping), the break grows and
shrinks, realloc() works, and a dump of the restored process is a complete
checkpoint of its own that is still restored as heap. Without the option the
heap is read, as before.
"""

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .criu_helpers import Flavor, Probe, flavors, mapped_from, vmas_in

pytestmark = pytest.mark.criu

HEAP_FLAG = "--mmap-restore-heap"
LIVE = "live=256"  # heapprobe.c: 320 chunks, every fifth freed
GROW_MIB = 64
MAPPED_LOG = "heap VMAs are mapped too"
READ_LOG = "heap VMAs are read, not mapped"
ANON_LOG = "dumping it as anonymous memory"


class HeapProbe(Probe):
    """A heapprobe process: memprobe's command protocol, glibc heap commands."""

    NAME = b"heapprobe"


@pytest.fixture
def heap(heapprobe: Path, tmp_path: Path) -> Iterator[HeapProbe]:
    p = HeapProbe(heapprobe, tmp_path / "run")
    try:
        yield p
    finally:
        p.kill()


@pytest.fixture
def patched(criu_prefix: Path) -> Flavor:
    flavor = flavors(criu_prefix)["patched"]
    help_text = subprocess.run(
        [str(flavor.criu), "--help"], capture_output=True, text=True, check=False, timeout=20
    )
    assert HEAP_FLAG in help_text.stdout + help_text.stderr, f"{flavor.criu} lacks {HEAP_FLAG}"
    return flavor


def brk_range(heap: HeapProbe) -> tuple[int, int]:
    """The heap's bounds: start_brk (/proc/PID/stat field 47, proc(5)) and the break
    now, which only the process itself can tell (sbrk(0))."""
    fields = Path(f"/proc/{heap.root}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[44]), result(heap.ok("brk"))["brk"]


def heap_split(heap: HeapProbe, images: Path) -> tuple[int, int, list[str]]:
    """Bytes of the heap mapped from images/, bytes not, and the names of the latter."""
    pid = heap.root
    start, end = brk_range(heap)
    mapped, other = mapped_from(vmas_in(pid, start, end), images)
    size = sum(min(v.end, end) - max(v.start, start) for v in mapped)
    return size, end - start - size, [v.path for v in other]


def result(text: str) -> dict[str, int]:
    """'a=1 b=2' -> {'a': 1, 'b': 2} (hex for brk values)."""
    out = {}
    for k, v in re.findall(r"(\w+)=(\w+)", text):
        out[k] = int(v, 16) if k.startswith("brk") else int(v)
    return out


def exercise(heap: HeapProbe, images: Path, mapped: bool) -> None:
    """Everything glibc malloc does to its heap, checked after a restore from images."""
    assert heap.ok("verify") == LIVE
    churn = result(heap.ok("churn"))
    assert churn["freed"] > 0 and churn["calloc_zero"] == churn["freed"], churn
    if mapped:
        # malloc_trim()'s MADV_DONTNEED brought back the image's data, not zeroes,
        # and calloc() cleared it all the same.
        assert churn["stale"] > 0, churn
    else:
        assert churn["stale"] == 0, churn
    assert heap.ok("verify") == LIVE

    pid = heap.root
    _, brk0 = brk_range(heap)
    grow = result(heap.ok(f"grow {GROW_MIB}"))
    _, brk1 = brk_range(heap)
    assert grow["calloc_zero"] == 4 and brk1 >= brk0 + GROW_MIB * 2**20, (grow, brk0, brk1)
    # New break is new anonymous memory past the heap's restored VMAs.
    fresh = vmas_in(pid, (brk0 + 4095) & ~4095, brk1)
    assert fresh and not mapped_from(fresh, images)[0], fresh
    assert heap.ok("verify") == "live=260"

    shrink = result(heap.ok("shrink"))
    _, brk2 = brk_range(heap)
    assert shrink["freed"] == 4 and brk2 < brk1 - GROW_MIB * 2**20 // 2, (shrink, brk1, brk2)
    assert not vmas_in(pid, (brk2 + 4095) & ~4095, brk1)
    assert heap.ok("verify") == LIVE
    assert result(heap.ok("realloc"))["reallocated"] == 8
    assert heap.ok("verify") == LIVE


def test_heap_mapped_with_the_option(heap: HeapProbe, patched: Flavor, tmp_path: Path) -> None:
    heap.start()
    assert heap.ok("verify") == LIVE
    img1 = tmp_path / "img1"
    heap.dump(patched, img1)
    heap.restore(patched, img1, HEAP_FLAG)
    assert MAPPED_LOG in (img1 / "restore.log").read_text()
    mapped, other, names = heap_split(heap, img1)
    assert mapped > other, (mapped, other)  # most of the heap comes from the image
    assert "[heap]" in names  # the first page of each run stays anonymous
    assert heap.ok("verify") == LIVE
    exercise(heap, img1, mapped=True)

    # A dump of the mapped heap carries the memory itself, and its heap is heap again.
    img2 = tmp_path / "img2"
    heap.dump(patched, img2)
    assert ANON_LOG in (img2 / "dump.log").read_text()
    shutil.rmtree(img1)  # the new checkpoint does not depend on the old one
    heap.restore(patched, img2, HEAP_FLAG)
    assert MAPPED_LOG in (img2 / "restore.log").read_text()
    assert heap_split(heap, img2)[0] > 0
    exercise(heap, img2, mapped=True)

    # Restored without the option, the re-dumped heap is read like any heap.
    heap.kill()
    (img2 / "restore.pid").unlink()
    heap.restore(patched, img2)
    log = (img2 / "restore.log").read_text()
    assert READ_LOG in log and MAPPED_LOG not in log
    assert heap_split(heap, img2)[0] == 0
    exercise(heap, img2, mapped=False)


def test_heap_read_without_the_option(heap: HeapProbe, patched: Flavor, tmp_path: Path) -> None:
    heap.start()
    images = tmp_path / "img"
    heap.dump(patched, images)
    heap.restore(patched, images)
    log = (images / "restore.log").read_text()
    assert READ_LOG in log and MAPPED_LOG not in log
    mapped, _, names = heap_split(heap, images)
    assert mapped == 0 and names == ["[heap]"], names
    exercise(heap, images, mapped=False)
