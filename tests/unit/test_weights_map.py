"""Reload by mapping the dump (ReloadOptions.map_file): page-aligned parts mapped, the rest read."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
from rekindle_dev.testenv import require

require("torch")  # the reloader is tested on real tensors: fail, never skip
import torch  # noqa: E402
from rekindle_weights import format as fmt  # noqa: E402
from rekindle_weights.dump import dump_tensors  # noqa: E402
from rekindle_weights.reload import (  # noqa: E402
    PAGE,
    ReloadOptions,
    map_range,
    reload_tensors,
    unmap_ranges,
)

BLOCK = 4 * 4096


def _aligned(shape: tuple[int, ...], dtype: torch.dtype, keep: list[mmap.mmap]) -> torch.Tensor:
    """A tensor whose memory starts on a page (an anonymous mmap), like a big PyTorch
    allocation under THP_MEM_ALLOC_ENABLE=1; filled with 0x01 bytes."""
    n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    m = mmap.mmap(-1, max(n, 1))
    keep.append(m)
    t = torch.frombuffer(m, dtype=torch.uint8, count=n)
    t.fill_(1)
    return t.view(dtype).view(shape)


@pytest.fixture()
def dump(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    src = {
        "big": torch.randn(300, 257, generator=g),  # 308 400 bytes: 75 pages and a tail
        "small": torch.randn(33, generator=g).half(),  # under a page: always read
        "pages": torch.randn(2, 4096, generator=g),  # exactly 8 pages
    }
    dump_tensors([(n, "param", t) for n, t in src.items()], tmp_path, rank=0, block_bytes=BLOCK)
    return tmp_path, src


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("verify", [True, False])
def test_map_reload_is_bit_exact_and_maps_whole_pages(
    dump: tuple[Path, dict[str, torch.Tensor]], verify: bool
) -> None:
    d, src = dump
    keep: list[mmap.mmap] = []
    dst = {n: _aligned(tuple(t.shape), t.dtype, keep) for n, t in src.items()}
    res = reload_tensors(d, dst, options=ReloadOptions(map_file=True, verify=verify))
    try:
        for n in src:
            assert _bytes(dst[n]) == _bytes(src[n]), n
        big = src["big"].numel() * 4
        # big: every whole page mapped, its 1 904-byte tail read; pages: all of it; small: none.
        assert res.mapped_bytes == big // PAGE * PAGE + 2 * 4096 * 4
        assert all(addr % PAGE == 0 and n % PAGE == 0 for addr, n in res.mapped)
        # A write to mapped memory stays private: the dump is never changed.
        dst["pages"][0, 0] = 12345.0
        again = {n: _aligned(tuple(t.shape), t.dtype, keep) for n, t in src.items()}
        reload_tensors(d, again)
        assert _bytes(again["pages"]) == _bytes(src["pages"])
    finally:
        unmap_ranges(res.mapped)
    # Unmapped: anonymous, zero-filled memory again, still usable.
    assert not dst["pages"].any()
    dst["pages"].fill_(2.0)
    assert bool((dst["pages"] == 2.0).all())


def test_unaligned_memory_is_read_not_mapped(dump: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, src = dump
    keep: list[mmap.mmap] = []
    dst = {}
    for n, t in src.items():
        whole = _aligned((t.numel() * t.element_size() + 64,), torch.uint8, keep)
        dst[n] = whole[64:].view(t.dtype).view(t.shape)  # 64 bytes into a page
    res = reload_tensors(d, dst, options=ReloadOptions(map_file=True))
    assert res.mapped == ()
    for n in src:
        assert _bytes(dst[n]) == _bytes(src[n]), n


def test_map_range_refuses_unaligned_and_partial_pages(tmp_path: Path) -> None:
    f = tmp_path / "data"
    f.write_bytes(bytes(range(256)) * 64)  # 4 pages
    m = mmap.mmap(-1, 4 * PAGE)
    addr = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
    with f.open("rb") as fh:
        fd = fh.fileno()
        assert map_range(fd, addr + 64, 0, 2 * PAGE) == 0
        assert map_range(fd, addr, 64, 2 * PAGE) == 0
        assert map_range(fd, addr, 0, PAGE - 1) == 0
        assert map_range(fd, addr, PAGE, 2 * PAGE + 100) == 2 * PAGE
    assert m[:PAGE] == f.read_bytes()[PAGE : 2 * PAGE]
    unmap_ranges([(addr, 2 * PAGE)])
    assert m[: 2 * PAGE] == bytes(2 * PAGE)
    m.close()


def test_failed_reload_leaves_no_mapping(dump: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, src = dump
    index = fmt.read_index(d, 0)
    big = next(e for e in index.tensors if e.name == "big")
    with open(fmt.data_path(d, 0), "r+b") as f:  # corrupt the last block of "big"
        f.seek(big.offset + big.nbytes - 5)
        b = f.read(1)
        f.seek(big.offset + big.nbytes - 5)
        f.write(bytes([b[0] ^ 0xFF]))
    keep: list[mmap.mmap] = []
    dst = {n: _aligned(tuple(t.shape), t.dtype, keep) for n, t in src.items()}
    with pytest.raises(fmt.WeightsFormatError, match="'big'"):
        reload_tensors(d, dst, options=ReloadOptions(map_file=True, chunk_bytes=BLOCK))
    # Whatever had been mapped is anonymous memory again: rewriting the dump shows through
    # nowhere, and every page of "big" is either zeroes (unmapped) or a copy.
    with open(fmt.data_path(d, 0), "r+b") as f:
        f.seek(big.offset)
        f.write(b"\x7f" * PAGE)
    assert dst["big"].view(-1).view(torch.uint8)[:PAGE].tolist().count(0x7F) == 0
