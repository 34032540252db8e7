"""Fast parallel reload of a dump (format.py) into existing tensors, in place.

Two paths, chosen by where the tensors live:

- Host tensors (CPU serving): reader threads `preadv` the file straight into
  the tensors' own memory, one chunk each, so the only copy is the kernel's
  page-cache copy. The GIL is released for the whole read. With
  `map_file`, page-aligned chunks are mapped from the dump instead (no copy,
  no fresh page to fault in: map_range), the rest read.
- Device tensors (GPU), or host tensors with O_DIRECT: reader threads fill a
  ring of pinned, page-aligned host buffers and hand each to a copy engine
  (`CudaCopyEngine`: one CUDA stream per reader, asynchronous copies); a
  buffer is reused only after the copy that reads it has finished (an event),
  so reads of the next chunk overlap the copy of the previous one.

Tensors are refilled in place: the same storage, so CUDA graphs, views and
any pointer held elsewhere stay valid. The index is checked against the
tensors (names, dtypes, shapes) before a single byte is written; a short
file or a checksum mismatch raises WeightsFormatError naming the tensor.
Checksums are verified per 8 MiB block by the reader that read it (on by
default; `verify_file` checks a dump without loading it, e.g. while it is
prefetched into the page cache, after which reload can skip verification).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap as mmap_module
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rekindle_weights import format as fmt
from rekindle_weights.tensors import (
    byte_tensor,
    dtype_name,
    host_bytes,
    is_dense,
    nbytes,
)

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
MAP_FIXED = 0x10  # Linux, every architecture (<asm-generic/mman-common.h>)
MADV_POPULATE_READ = 22  # Linux >= 5.14
# The lifetime mark on a mapped dump: an OFD read lock on this byte ("CRIU"), the
# byte and meaning of the patched CRIU's mark on the pages images it maps (mark_mapped).
MAPPED_MARK = 0x43524955


def default_threads(device: str = "cpu") -> int:
    """Readers: the CPU count (page-cache copies are CPU work), at least 2, at most 8."""
    cpus = os.cpu_count() or 2
    return max(2, min(8, cpus))


@dataclass(frozen=True)
class ReloadOptions:
    """Knobs with measured defaults (docs/weights.md); every one can be overridden."""

    threads: int | None = None  # None: default_threads()
    chunk_bytes: int | None = None  # None: 8 MiB host path, 16 MiB staged path
    buffers: int | None = None  # pinned ring size; None: 2 per reader (double-buffered)
    verify: bool = True  # check each block's CRC-32 as it is read
    direct: bool = False  # O_DIRECT reads (staged path); falls back where unsupported
    staged: bool | None = None  # None: staged iff any tensor is on a device
    # Host path: map the page-aligned part of each chunk privately from the dump over
    # the tensor's memory instead of copying it (see map_range); the rest is read.
    map_file: bool = False

    def resolved_threads(self) -> int:
        n = self.threads if self.threads is not None else default_threads()
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {n}")
        return n


@dataclass(frozen=True)
class ReloadResult:
    rank: int
    bytes: int
    seconds: float
    tensors: int
    threads: int
    verified: bool
    path: str  # "host" or "staged"
    direct: bool
    mapped: tuple[tuple[int, int], ...] = ()  # (address, bytes) mapped from the dump (map_file)
    map_note: str = ""  # map_file asked but nothing could be mapped: why

    @property
    def mapped_bytes(self) -> int:
        return sum(n for _, n in self.mapped)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
            "gbps": round(self.gbps, 3),
            "tensors": self.tensors,
            "threads": self.threads,
            "verified": self.verified,
            "path": self.path,
            "direct": self.direct,
            "mapped_bytes": self.mapped_bytes,
            "map_note": self.map_note,
        }


# ---------------------------------------------------------------- planning


@dataclass(frozen=True)
class Piece:
    """A byte range of one tensor: where it is in the file and in the tensor."""

    tensor: int  # position in the index's tensor list
    tensor_offset: int
    length: int
    file_offset: int


@dataclass(frozen=True)
class Chunk:
    """One read: a contiguous file range holding one or more pieces."""

    file_offset: int
    length: int
    pieces: tuple[Piece, ...]


def plan_chunks(entries: Sequence[fmt.TensorEntry], chunk_bytes: int, pack: bool) -> list[Chunk]:
    """Split tensors into reads of at most chunk_bytes, in file order.

    Big tensors are cut at multiples of chunk_bytes (so readers share them);
    with pack, consecutive small tensors share one read (one buffer, fewer
    syscalls). Empty tensors need no read.
    """
    if chunk_bytes <= 0 or chunk_bytes % fmt.ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {fmt.ALIGN}")
    order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
    chunks: list[Chunk] = []
    cur: list[Piece] = []

    def flush() -> None:
        if cur:
            start = cur[0].file_offset
            end = cur[-1].file_offset + cur[-1].length
            chunks.append(Chunk(start, end - start, tuple(cur)))
            cur.clear()

    for i in order:
        e = entries[i]
        for toff in range(0, e.nbytes, chunk_bytes):
            p = Piece(i, toff, min(chunk_bytes, e.nbytes - toff), e.offset + toff)
            if not (pack and cur and p.file_offset + p.length - cur[0].file_offset <= chunk_bytes):
                flush()
            cur.append(p)
    flush()
    return chunks


def validate(index: fmt.WeightIndex, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in index order, after checking the dump describes exactly these tensors.

    Runs before any write, so a mismatched dump never half-loads a model.
    """
    by_name = {e.name: e for e in index.tensors}
    missing = [n for n in tensors if n not in by_name]
    if missing:
        raise fmt.WeightsFormatError(
            f"the dump has no tensor {missing[0]!r} that the model has "
            f"({len(missing)} missing): it was made from a different model or configuration"
        )
    out = []
    for e in index.tensors:
        t = tensors.get(e.name)
        if t is None:
            raise fmt.WeightsFormatError(
                f"the dump has tensor {e.name!r} that the model lacks: "
                "it was made from a different model or configuration"
            )
        shape = tuple(int(s) for s in t.shape)
        if dtype_name(t) != e.dtype or shape != e.shape:
            raise fmt.WeightsFormatError(
                f"tensor {e.name!r}: the dump has {e.dtype}{list(e.shape)}, "
                f"the model has {dtype_name(t)}{list(shape)}"
            )
        if nbytes(t) != e.nbytes:
            raise fmt.WeightsFormatError(
                f"tensor {e.name!r}: the dump has {e.nbytes} bytes, the model {nbytes(t)}"
            )
        out.append(t)
    return out


# ---------------------------------------------------------------- reading


def read_exact(fd: int, buf: memoryview, offset: int, what: str, path: str) -> None:
    """Fill buf from fd at offset, looping over short reads; EOF is a truncated dump."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise fmt.WeightsFormatError(
                f"{path}: {what}: the file ends at byte {offset + got}, "
                f"{len(buf) - got} bytes short (truncated dump)"
            )
        got += n


def check_blocks(
    entry: fmt.TensorEntry, tensor_offset: int, data: memoryview, block_bytes: int, path: str
) -> None:
    """Compare the CRCs of data (bytes tensor_offset.. of entry) with the index."""
    first = tensor_offset // block_bytes
    got = fmt.block_crcs(data, block_bytes)
    want = entry.block_checksums()[first : first + len(got)]
    if got != want:
        bad = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
        start = (first + bad) * block_bytes
        raise fmt.WeightsFormatError(
            f"{path}: tensor {entry.name!r}: checksum mismatch in bytes "
            f"{start}..{min(start + block_bytes, entry.nbytes)} (corrupt dump)"
        )


def run_threads(threads: int, count: int, work: Callable[[int], None], name: str) -> None:
    """Call work(i) for every i < count from `threads` threads, in order of i.

    The first exception stops the others (after their current item) and is
    raised here, so a failed read is never mistaken for a finished reload.
    """
    lock = threading.Lock()
    state = {"next": 0}
    errors: list[BaseException] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with lock:
                i = state["next"]
                if i >= count:
                    return
                state["next"] = i + 1
            try:
                work(i)
            except BaseException as e:
                errors.append(e)
                stop.set()
                return

    pool = [
        threading.Thread(target=loop, name=f"{name}-{k}", daemon=True)
        for k in range(min(threads, count))
    ]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- copy engines


class CopyEngine(Protocol):
    """Moves bytes from a staging buffer to a tensor; copies may be asynchronous."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def record(self) -> object:
        """A fence for the copies this thread issued so far."""
        ...

    def wait(self, fence: object) -> None:
        """Block until the copies behind fence have finished reading their source."""
        ...

    def finish(self) -> None:
        """Block until every copy issued by any thread has finished."""
        ...

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A host staging buffer (pinned for DMA where that exists)."""
        ...


class HostCopyEngine:
    """Synchronous host-to-host copies (the O_DIRECT host path, and tests)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> object:
        return None

    def wait(self, fence: object) -> None:
        pass

    def finish(self) -> None:
        pass

    def alloc(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)


class CudaCopyEngine:
    """Asynchronous host-to-device copies, one CUDA stream per reader thread."""

    page_aligned = True  # pinned buffers come page-aligned from the driver (staging_buffer)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._local = threading.local()
        self._streams: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    def _stream(self) -> torch.cuda.Stream:
        import torch

        s = getattr(self._local, "stream", None)
        if s is None:
            s = torch.cuda.Stream(device=self.device)
            self._local.stream = s
            with self._lock:
                self._streams.append(s)
        return s

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        import torch

        with torch.cuda.stream(self._stream()):
            dst.copy_(src, non_blocking=True)

    def record(self) -> object:
        import torch

        ev = torch.cuda.Event()
        ev.record(self._stream())
        return ev

    def wait(self, fence: object) -> None:
        if fence is not None:
            fence.synchronize()  # type: ignore[attr-defined]

    def finish(self) -> None:
        for s in self._streams:
            s.synchronize()

    def alloc(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _aligned(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The page-aligned nbytes-long slice of raw (O_DIRECT needs aligned addresses)."""
    skip = (-raw.data_ptr()) % fmt.ALIGN
    return raw[skip : skip + nbytes]


def staging_buffer(engine: CopyEngine, nbytes: int) -> torch.Tensor:
    """A page-aligned staging buffer of exactly nbytes.

    Pinned memory comes page-aligned from the driver (engines that say so
    with page_aligned), so the exact size is asked first: asking nbytes plus
    a page to align by hand would make PyTorch's pinned allocator, which
    rounds every request up to a power of two, hand out twice the memory
    (16 MiB + 4 KiB -> 32 MiB). Other engines' memory (plain host
    allocations) is asked with a page to spare and aligned by hand.
    """
    if getattr(engine, "page_aligned", False):
        raw = engine.alloc(nbytes)
        if raw.data_ptr() % fmt.ALIGN == 0:
            return raw[:nbytes]
        del raw
    return _aligned(engine.alloc(nbytes + fmt.ALIGN), nbytes)


@dataclass
class _Slot:
    buf: torch.Tensor | None = None  # allocated by the first reader that uses it
    fence: object = None


# Staging buffers kept between reloads in one process (pinned memory is slow to
# allocate: ~10 ms per 64 MiB); release_staging_buffers() gives them back.
_POOL: dict[tuple[str, int], list[torch.Tensor]] = {}
_POOL_LOCK = threading.Lock()


def release_staging_buffers() -> int:
    """Free the staging buffers kept for the next reload; returns their bytes.

    Dropping the tensors is not enough for pinned memory: PyTorch's caching
    host allocator keeps freed pinned blocks for reuse, so the server's RSS
    (and a later checkpoint's image) would still hold them. The cache is
    emptied too (empty_pinned_host_cache).
    """
    with _POOL_LOCK:
        freed = sum(b.numel() for bufs in _POOL.values() for b in bufs)
        _POOL.clear()
    empty_pinned_host_cache()
    return int(freed)


def empty_pinned_host_cache() -> bool:
    """Return PyTorch's cached, unused pinned host blocks to the driver; whether it ran.

    Only where CUDA is initialised in this process (nothing is pinned
    otherwise); torch._C._host_emptyCache exists in the PyTorch versions vLLM
    uses, and its absence is not an error.
    """
    try:
        import torch
    except ImportError:
        return False
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None or not torch.cuda.is_initialized():
        return False
    empty()
    return True


@dataclass
class _Targets:
    """Where each index entry's bytes go: the dense tensors themselves.

    Non-contiguous tensors (rare: vLLM's are dense) cannot be read into in
    place; load_into fills each through a dense stand-in of its own, one at a
    time, so at most one stand-in is alive: the peak is the largest such
    tensor, not their sum.
    """

    tensors: list[torch.Tensor]
    dests: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not all(is_dense(t) for t in self.tensors):
            raise ValueError("_Targets holds dense tensors only")
        self.dests = list(self.tensors)


def _open(path: str, direct: bool) -> tuple[int, bool]:
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY), False


def _host_reload(
    index: fmt.WeightIndex,
    path: str,
    targets: _Targets,
    threads: int,
    chunk: int,
    verify: bool,
    map_file: bool = False,
) -> tuple[list[tuple[int, int]], str]:
    """Read (or, with map_file, map where aligned) every chunk; the ranges mapped, and why
    none could be (mark_mapped failed) or ""."""
    chunks = plan_chunks(index.tensors, chunk, pack=False)
    views = [host_bytes(d) for d in targets.dests]
    mapped: list[tuple[int, int]] = []
    note = ""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if map_file:
            note = mark_mapped(fd)
            map_file = not note  # no mapping without its lifetime mark: read it all

        def work(i: int) -> None:
            (p,) = chunks[i].pieces
            e = index.tensors[p.tensor]
            mv = views[p.tensor][p.tensor_offset : p.tensor_offset + p.length]
            done = 0
            if map_file:
                addr = targets.dests[p.tensor].data_ptr() + p.tensor_offset
                done = map_range(fd, addr, p.file_offset, p.length)
                if done:
                    mapped.append((addr, done))  # list.append is atomic under the GIL
            if done < p.length:
                read_exact(fd, mv[done:], p.file_offset + done, f"tensor {e.name!r}", path)
            if verify:
                check_blocks(e, p.tensor_offset, mv, index.block_bytes, path)

        try:
            run_threads(threads, len(chunks), work, "rekindle-read")
        except BaseException:
            unmap_ranges(mapped)  # a failed reload leaves no mapping behind
            raise
    finally:
        os.close(fd)  # the mappings keep the file open (and so its mark)
    return mapped, note


# ---------------------------------------------------------------- mapping the dump

PAGE = mmap_module.PAGESIZE
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc = lib
    return _libc


def mark_mapped(fd: int) -> str:
    """Put the lifetime mark on fd's file before mapping from fd; "" or why it failed.

    The mark is an OFD read lock on byte MAPPED_MARK. An OFD lock belongs to the
    open file, and every mapping made from fd keeps that open file after fd is
    closed, so the mark lasts exactly as long as any mapping of the dump (in
    every process the memory goes to) and goes with the last one (unmap_ranges,
    exit): `/proc/locks` shows which dumps a server maps, and the patched CRIU,
    which recognises a private mapping of a marked file, would dump its content
    as anonymous memory (not tested for a weight dump: the release unmaps it
    before any dump). A file system without OFD locks gets no mark, and the
    caller then maps nothing.
    """
    cmd = getattr(fcntl, "F_OFD_SETLK", 37)
    # struct flock: l_type, l_whence, (pad), l_start, l_len, l_pid, (pad); l_pid 0 for OFD.
    req = struct.pack("hh4xqqi4x", fcntl.F_RDLCK, os.SEEK_SET, MAPPED_MARK, 1, 0)
    try:
        fcntl.fcntl(fd, cmd, req)
    except OSError as e:
        return f"cannot mark the dump as mapped (OFD read lock): {e.strerror or e}"
    return ""


def map_range(fd: int, addr: int, file_offset: int, length: int) -> int:
    """Map file bytes [file_offset, +n) privately over memory [addr, +n); returns n.

    Why: a reload into freshly allocated memory is bound by first-touch page
    faults (docs/weights.md, "Fresh memory"); mapping the dump instead copies
    nothing, and its pages are the page cache's own until written (weights
    are not), shared by every process that maps them. Only whole pages can be
    mapped: n is length rounded down to a page, and 0 (nothing done, the caller
    reads) unless addr and file_offset are both page-aligned. The memory must be
    the caller's own writable allocation (a tensor's storage): MAP_FIXED
    replaces what was there.
    """
    n = length // PAGE * PAGE
    if n == 0 or addr % PAGE or file_offset % PAGE:
        return 0
    got = _c().mmap(
        addr,
        n,
        mmap_module.PROT_READ | mmap_module.PROT_WRITE,
        mmap_module.MAP_PRIVATE | MAP_FIXED,
        fd,
        file_offset,
    )
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping the weight dump at {addr:#x}: {os.strerror(err)}")
    # Fill the page tables now, from this reader thread (in parallel with the others),
    # without copying: a read populate maps the page cache's pages as they are (a write
    # populate, or MAP_POPULATE on a writable private mapping, would copy every page).
    # Kernels before 5.14 lack it (EINVAL): the pages then fault in on first use.
    _c().madvise(addr, n, MADV_POPULATE_READ)
    return n


def unmap_ranges(ranges: Iterable[tuple[int, int]]) -> None:
    """Turn mapped ranges back into private anonymous memory (zero-filled) in place.

    Before the memory is freed or the process is checkpointed: a file mapping
    left in a heap that the allocator reuses would tie the process (and any
    checkpoint of it) to the dump file.
    """
    for addr, n in ranges:
        got = _c().mmap(
            addr,
            n,
            mmap_module.PROT_READ | mmap_module.PROT_WRITE,
            mmap_module.MAP_PRIVATE | mmap_module.MAP_ANONYMOUS | MAP_FIXED,
            -1,
            0,
        )
        if got != addr:
            err = ctypes.get_errno()
            raise OSError(err, f"unmapping the weight dump at {addr:#x}: {os.strerror(err)}")


def _staged_reload(
    index: fmt.WeightIndex,
    path: str,
    targets: _Targets,
    engine: CopyEngine,
    threads: int,
    chunk: int,
    buffers: int,
    verify: bool,
    direct: bool,
) -> bool:
    """Read into a ring of staging buffers and copy from there; returns whether O_DIRECT ran."""
    chunks = plan_chunks(index.tensors, chunk, pack=True)
    # Sized to need: a buffer is as big as the largest read (a small model's reads
    # are small), and there are never more buffers than reads.
    buf_bytes = fmt.align_up(max((c.length for c in chunks), default=fmt.ALIGN))
    key = (type(engine).__name__, buf_bytes)
    with _POOL_LOCK:
        kept = _POOL.pop(key, [])
    ring = min(max(buffers, threads), max(1, len(chunks)))
    all_slots = [_Slot(kept.pop() if kept else None) for _ in range(ring)]
    slots = queue.SimpleQueue[_Slot]()
    for sl in all_slots:
        slots.put(sl)
    dest_bytes = [byte_tensor(d) for d in targets.dests]
    fd, used_direct = _open(path, direct)
    try:

        def work(i: int) -> None:
            c = chunks[i]
            slot = slots.get()
            try:
                engine.wait(slot.fence)  # the copy out of this buffer must be done
                slot.fence = None
                if slot.buf is None:  # allocated here, overlapping other readers' reads
                    slot.buf = staging_buffer(engine, buf_bytes)
                buf = slot.buf
                span = fmt.align_up(c.length) if used_direct else c.length
                mv = host_bytes(buf)[:span]
                first = index.tensors[c.pieces[0].tensor].name
                read_exact(fd, mv, c.file_offset, f"tensor {first!r}", path)
                for p in c.pieces:
                    at = p.file_offset - c.file_offset
                    e = index.tensors[p.tensor]
                    if verify:
                        check_blocks(
                            e, p.tensor_offset, mv[at : at + p.length], index.block_bytes, path
                        )
                    dst = dest_bytes[p.tensor][p.tensor_offset : p.tensor_offset + p.length]
                    engine.copy(dst, buf[at : at + p.length])
                slot.fence = engine.record()
            finally:
                slots.put(slot)

        try:
            run_threads(threads, len(chunks), work, "rekindle-read")
        finally:
            engine.finish()  # never free a buffer a copy still reads
            with _POOL_LOCK:
                _POOL[key] = [sl.buf for sl in all_slots if sl.buf is not None]
    finally:
        os.close(fd)
    return used_direct


def _sub_index(index: fmt.WeightIndex, positions: list[int]) -> fmt.WeightIndex:
    """The index restricted to some entries (their file offsets unchanged)."""
    if len(positions) == len(index.tensors):
        return index
    return fmt.WeightIndex(
        rank=index.rank,
        tensors=tuple(index.tensors[i] for i in positions),
        file_bytes=index.file_bytes,
        align=index.align,
        block_bytes=index.block_bytes,
    )


def _engine_for(tensors: Iterable[torch.Tensor]) -> CopyEngine:
    devices = {t.device for t in tensors if t.device.type != "cpu"}
    if not devices:
        return HostCopyEngine()
    if len(devices) > 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"reload supports CPU tensors or one CUDA device, got {devices}")
    return CudaCopyEngine(next(iter(devices)))


def load_into(
    index: fmt.WeightIndex,
    data_file: Path | str,
    tensors: Sequence[torch.Tensor],
    options: ReloadOptions | None = None,
    engine: CopyEngine | None = None,
) -> ReloadResult:
    """Fill tensors (index order, already validated) from data_file."""
    opts = options or ReloadOptions()
    t0 = time.perf_counter()
    path = str(data_file)
    threads = opts.resolved_threads()
    engine = engine or _engine_for(tensors)
    staged = opts.staged
    if staged is None:
        staged = opts.direct or not isinstance(engine, HostCopyEngine)
    default_chunk = 16 * MiB if staged else 8 * MiB
    chunk = opts.chunk_bytes or default_chunk
    if opts.verify:
        # Pieces must start on checksum-block boundaries to be checked on their own.
        chunk = max(index.block_bytes, chunk // index.block_bytes * index.block_bytes)
    buffers = opts.buffers if opts.buffers is not None else 2 * threads

    mapped: list[tuple[int, int]] = []
    notes: list[str] = []

    def fill(positions: list[int], dests: list[torch.Tensor], may_map: bool = True) -> bool:
        """Load the index entries at positions into dests (dense); whether O_DIRECT ran."""
        sub = _sub_index(index, positions)
        targets = _Targets(dests)
        if staged:
            return _staged_reload(
                sub, path, targets, engine, threads, chunk, buffers, opts.verify, opts.direct
            )
        ranges, note = _host_reload(
            sub, path, targets, threads, chunk, opts.verify, opts.map_file and may_map
        )
        mapped.extend(ranges)
        notes.extend([note] if note else [])
        return False

    dense = [i for i, t in enumerate(tensors) if is_dense(t)]
    used_direct = fill(dense, [tensors[i] for i in dense]) if dense else False
    for i in (i for i, t in enumerate(tensors) if not is_dense(t)):
        stand_in = tensors[i].new_empty(tensors[i].shape)  # dense, one at a time
        # Never mapped: the stand-in is freed right after (a mapping must not outlive it).
        used_direct = fill([i], [stand_in], may_map=False) or used_direct
        tensors[i].copy_(stand_in)
        del stand_in
    return ReloadResult(
        rank=index.rank,
        bytes=index.data_bytes,
        seconds=time.perf_counter() - t0,
        tensors=len(index.tensors),
        threads=threads,
        verified=opts.verify,
        path="staged" if staged else "host",
        direct=used_direct,
        mapped=tuple(sorted(mapped)),
        map_note="; ".join(dict.fromkeys(notes)),
    )


def reload_tensors(
    directory: Path | str,
    tensors: Mapping[str, torch.Tensor],
    rank: int = 0,
    options: ReloadOptions | None = None,
    engine: CopyEngine | None = None,
) -> ReloadResult:
    """Refill the named tensors in place from directory's dump for rank (validated first)."""
    index = fmt.read_index(directory, rank)
    ordered = validate(index, tensors)
    return load_into(index, fmt.data_path(directory, rank), ordered, options, engine)


def verify_file(directory: Path | str, rank: int = 0, threads: int | None = None) -> int:
    """Check every block of a dump against its index without loading it; returns bytes checked.

    Reading the file also brings it into the page cache, so the agent can run
    this as its prefetch, off the restore's critical path, then reload with
    verify=False.
    """
    index = fmt.read_index(directory, rank)
    path = str(fmt.data_path(directory, rank))
    chunks = plan_chunks(index.tensors, index.block_bytes * 4, pack=False)
    n = threads or default_threads()
    local = threading.local()
    fd = os.open(path, os.O_RDONLY)
    try:

        def work(i: int) -> None:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = memoryview(bytearray(index.block_bytes * 4))
            (p,) = chunks[i].pieces
            e = index.tensors[p.tensor]
            mv = buf[: p.length]
            read_exact(fd, mv, p.file_offset, f"tensor {e.name!r}", path)
            check_blocks(e, p.tensor_offset, mv, index.block_bytes, path)

        run_threads(n, len(chunks), work, "rekindle-verify")
    finally:
        os.close(fd)
    return index.data_bytes
