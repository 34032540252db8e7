"""A part of a checkpoint file as the object store keeps it (rekindle_store.frames):
the shortest of nothing, a zstd frame or the raw part, told apart by length alone,
and decoded only into exactly the part's length."""

from __future__ import annotations

import os

import pytest
import zstandard
from rekindle_store import frames

PART = 1 << 20


def _decoded(frame: bytes, size: int) -> bytes:
    out = bytearray(size)
    frames.decode_into(memoryview(frame), memoryview(out))
    return bytes(out)


def test_a_part_of_zeroes_is_stored_as_nothing() -> None:
    assert frames.encode(memoryview(bytes(PART))) == b""
    assert _decoded(b"", PART) == bytes(PART)
    # One byte anywhere, even in the last MiB compared, is data.
    late = bytearray(3 * PART)
    late[-1] = 1
    assert frames.encode(memoryview(late)) != b""


def test_a_part_that_compresses_is_a_shorter_zstd_frame() -> None:
    part = os.urandom(4096) * (PART // 4096)
    frame = frames.encode(memoryview(part))
    assert 0 < len(frame) < PART // 100
    assert _decoded(frame, PART) == part


def test_a_part_that_does_not_compress_is_stored_raw() -> None:
    part = os.urandom(PART)
    frame = frames.encode(memoryview(part))
    assert frame == part  # its length, the part's, says raw
    assert _decoded(frame, PART) == part


def test_a_mostly_zero_part_writes_only_its_data_pages() -> None:
    """Its zero pages are never written: they stay holes in the staging file (shown
    here by a buffer of 0xff that keeps them)."""
    part = bytearray(PART)
    part[5 * 4096 + 7] = 1  # one page of data, and a run of two at the end
    part[-2 * 4096 :] = os.urandom(2 * 4096)
    frame = frames.encode(memoryview(part))
    assert len(frame) * frames.SPARSE <= PART
    out = bytearray(b"\xff" * PART)
    frames.decode_into(memoryview(frame), memoryview(out))
    data = {5, PART // 4096 - 2, PART // 4096 - 1}
    for n in range(PART // 4096):
        page = out[n * 4096 : (n + 1) * 4096]
        assert page == (part[n * 4096 : (n + 1) * 4096] if n in data else b"\xff" * 4096), n


def test_a_frame_that_decodes_to_another_length_is_refused() -> None:
    dense = os.urandom(PART // 4) * 4  # compresses 4x: decoded straight into the part
    frame = zstandard.ZstdCompressor().compress(dense)
    assert len(frame) * frames.SPARSE > PART
    with pytest.raises(frames.FrameError, match=f"decodes to {PART} bytes, {PART + 1} expected"):
        _decoded(frame, PART + 1)
    with pytest.raises(frames.FrameError, match="decodes to more bytes"):
        _decoded(frame, PART - 1)
    with pytest.raises(frames.FrameError, match="decodes to more bytes"):  # a second frame after
        _decoded(frame + frame, PART)
    sparse = zstandard.ZstdCompressor().compress(bytes(PART - 1) + b"x")
    with pytest.raises(frames.FrameError, match=f"decodes to {PART} bytes, {PART + 1} expected"):
        _decoded(sparse, PART + 1)
    with pytest.raises(frames.FrameError, match="not a zstd frame of ours"):  # data after it
        _decoded(sparse + sparse, PART)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(PART))
    with pytest.raises(frames.FrameError, match=f"decodes to no size, {PART} expected"):
        _decoded(unsized, PART)


def test_garbage_or_an_oversized_frame_is_refused() -> None:
    with pytest.raises(frames.FrameError, match="not a zstd frame of ours"):
        _decoded(os.urandom(100), PART)
    with pytest.raises(frames.FrameError, match="a 11-byte frame for a 10-byte part"):
        _decoded(bytes(11), 10)
