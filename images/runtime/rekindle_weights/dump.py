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
