"""Dump tensors, exactly as they sit in memory, into the flat file of format.py.

Run once per checkpoint, after vLLM has loaded and post-processed the model
(quantized, repacked, fused), so a reload needs no re-processing: it only has
to put bytes back where they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from rekindle_weights import format as fmt
from rekindle_weights.tensors import byte_tensor, dtype_name, host_bytes, nbytes

if TYPE_CHECKING:
    import torch

# Device tensors are copied to the host in pieces of this size while dumping.
_HOST_COPY_BYTES = 64 << 20
_ZEROS = bytes(fmt.ALIGN)


@dataclass(frozen=True)
class DumpResult:
    rank: int
    bytes: int
    seconds: float
    tensors: int
    data_path: str
    index_path: str

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
            "tensors": self.tensors,
            "data_path": self.data_path,
            "index_path": self.index_path,
        }


def _host_pieces(t: torch.Tensor) -> Iterable[memoryview]:
    """The tensor's row-major bytes as host memoryviews, copying device memory in pieces."""
    if t.device.type == "cpu":
        dense = t.contiguous()  # kept alive here while the caller uses its bytes
        yield host_bytes(dense)
        return
    flat = byte_tensor(t.contiguous())
    for start in range(0, flat.numel(), _HOST_COPY_BYTES):
        piece = flat[start : start + _HOST_COPY_BYTES].cpu()
        yield host_bytes(piece)


def _write_tensor(f: BinaryIO, t: torch.Tensor, block_bytes: int) -> list[int]:
    """Write t's bytes at f's position; return its block CRCs (computed on what was written)."""
    crcs: list[int] = []
    pending = bytearray()  # a partial block carried across device pieces
    for mv in _host_pieces(t):
        f.write(mv)
        view = mv
        if pending:
            need = block_bytes - len(pending)
            pending += view[:need]
            view = view[need:]
            if len(pending) == block_bytes:
                crcs.append(fmt.block_crcs(pending, block_bytes)[0])
                pending = bytearray()
        whole = len(view) - len(view) % block_bytes
        if whole:
            crcs += fmt.block_crcs(view[:whole], block_bytes)
        pending += view[whole:]
    if pending or not crcs:
        crcs.append(fmt.block_crcs(pending, block_bytes)[0])
    return crcs


@dataclass(frozen=True)
class Coverage:
    """Whether a dump holds every byte of the memory behind the model's tensors.

    A release frees (CPU) or discards (GPU, level-2 sleep) whole allocations;
    a reload puts back only what the dump holds. Bytes of those allocations
    that no dumped tensor covers would come back as garbage, silently, so a
    dump that would miss any is refused instead.
    """

    tensor_bytes: int  # the dumped tensors' bytes (shared storages once)
    storage_bytes: int  # bytes of the distinct storages behind them
    allocated_bytes: int | None  # live allocator blocks in the weights' memory (CUDA), else None
    problems: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {
            "tensor_bytes": self.tensor_bytes,
            "storage_bytes": self.storage_bytes,
            "allocated_bytes": self.allocated_bytes,
            "complete": self.complete,
            "problems": list(self.problems),
        }


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of half-open [start, end) ranges, sorted."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range [start, end) of t's storage that t's elements occupy (dense or not)."""
    if t.numel() == 0:
        return (0, 0)
    start = int(t.storage_offset()) * t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (start, start + (int(last) + 1) * t.element_size())


def uncovered(live: list[tuple[int, int]], covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts (address, size) of live allocations that no covered range holds."""
    cov = _merge([(a, a + n) for a, n in covered])
    out: list[tuple[int, int]] = []
    for a, b in _merge([(a, a + n) for a, n in live]):
        pos = a
        for c, d in cov:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c - pos))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b - pos))
    return out


def coverage(
    tensors: list[tuple[str, str, torch.Tensor]],
    live_allocations: list[tuple[int, int]] | None = None,
) -> Coverage:
    """Check that the dump of tensors covers their memory.

    Structural (every device): each storage behind a dumped tensor must be
    covered end to end by the dumped tensors that view it; a parameter that is
    a slice of a bigger buffer leaves the rest of that buffer undumped.
    Accounting (CUDA): live_allocations, the allocator's live blocks in the
    memory a level-2 sleep discards (the "weights" pool), must all lie inside
    those storages; one that does not is memory vLLM allocated while loading
    (outside any parameter or buffer) that the dump would miss.
    """
    by_storage: dict[int, tuple[int, list[tuple[int, int]], list[str]]] = {}
    tensor_bytes = 0
    for name, _, t in tensors:
        s = t.untyped_storage()
        ptr, size = int(s.data_ptr()), int(s.nbytes())
        if not size:
            continue
        if ptr not in by_storage:
            by_storage[ptr] = (size, [], [])
        by_storage[ptr][1].append(_span(t))
        by_storage[ptr][2].append(name)
    problems: list[str] = []
    for size, spans, names in by_storage.values():
        merged = _merge(spans)
        tensor_bytes += sum(b - a for a, b in merged)
        missing = size - sum(min(b, size) - a for a, b in merged)
        if missing > 0:
            problems.append(
                f"{missing} of {size} bytes of the storage behind {names[0]!r} are in no "
                "dumped tensor (a parameter or buffer that views part of a larger allocation)"
            )
    storage_bytes = sum(size for size, _, _ in by_storage.values())
    allocated = None
    if live_allocations is not None:
        allocated = sum(n for _, n in live_allocations)
        gaps = uncovered(live_allocations, [(p, v[0]) for p, v in by_storage.items()])
        if gaps:
            missed = sum(n for _, n in gaps)
            problems.append(
                f"{missed} bytes in {len(gaps)} live allocation(s) of the weights' memory "
                "belong to no parameter or buffer (allocated while loading the model); a "
                "level-2 sleep discards them and the dump cannot restore them"
            )
    return Coverage(tensor_bytes, storage_bytes, allocated, tuple(problems))


def dump_tensors(
    tensors: Iterable[tuple[str, str, torch.Tensor]],
    directory: Path | str,
    rank: int = 0,
    progress: Callable[[str], None] | None = None,
    block_bytes: int = fmt.BLOCK_BYTES,
) -> DumpResult:
    """Write (name, kind, tensor) triples as weights-rank{rank}.bin/.json in directory.

    Both files are written to a temp name, fsynced and renamed (data first,
    index last), so a crash mid-dump leaves the previous dump or none.
    """
    if block_bytes <= 0 or block_bytes % fmt.ALIGN:
        raise ValueError(f"block_bytes must be a positive multiple of {fmt.ALIGN}")
    t0 = time.perf_counter()
    items = list(tensors)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    offsets, file_bytes = fmt.layout([nbytes(t) for _, _, t in items])
    entries: list[fmt.TensorEntry] = []

    def write_data(f: BinaryIO) -> None:
        for i, ((name, kind, t), off) in enumerate(zip(items, offsets, strict=True)):
            assert f.tell() == off
            crcs = _write_tensor(f, t, block_bytes)
            pad = fmt.align_up(f.tell()) - f.tell()
            f.write(_ZEROS[:pad])
            entries.append(
                fmt.TensorEntry(
                    name=name,
                    kind=kind,
                    dtype=dtype_name(t),
                    shape=tuple(int(s) for s in t.shape),
                    stride=tuple(int(s) for s in t.stride()),
                    offset=off,
                    nbytes=nbytes(t),
                    checksum=fmt.format_checksum(crcs),
                )
            )
            if progress and (i + 1) % 200 == 0:
                progress(f"dumped {i + 1}/{len(items)} tensors")
        assert f.tell() == file_bytes

    dpath = fmt.data_path(directory, rank)
    fmt.write_atomic(dpath, write_data)
    index = fmt.WeightIndex(
        rank=rank, tensors=tuple(entries), file_bytes=file_bytes, block_bytes=block_bytes
    )
    ipath = fmt.write_index(directory, index)
    return DumpResult(
        rank=rank,
        bytes=file_bytes,
        seconds=time.perf_counter() - t0,
        tensors=len(entries),
        data_path=str(dpath),
        index_path=str(ipath),
    )
