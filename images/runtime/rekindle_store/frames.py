"""One part of a checkpoint file as the object store keeps it: a frame.

The store is the slow link of a plain pull (a node reads a checkpoint from it
at a fraction of its disk's pace), and a checkpoint is mostly air: the pages of
a sleeping vLLM compress about 4x with zstd's default level (4.3x on the CPU
tree's pages here, decoded at 0.5-0.9 GB/s per core on this 2-core machine,
where decoding then becomes the pull's limit) and its /dev/shm files are
mostly zeroes. So each part of a file is stored as the shortest of

    nothing   the part is all zeroes: nothing is stored or fetched (a hole on the node)
    zstd      one zstd frame, shorter than the part
    raw       the part itself, when it does not compress

and a frame's length alone says which: 0, less than the part, or the part's length.
Frames are never trusted: the signed manifest's digests are over the file's own
bytes, so a frame that decodes to anything else fails the same check a changed
raw byte does; decoding is bounded by the part's length.
"""

from __future__ import annotations

import zstandard

LEVEL = 3  # zstd's default: 4.3x on vLLM's pages where level 1 gives 3.8x, both decode alike
SPARSE = 8  # a frame this many times shorter than its part is mostly zeroes (_decode_sparse)
PAGE = 4096


class FrameError(ValueError):
    """A frame that does not decode to its part (damaged, or not one of ours)."""


def encode(part: memoryview) -> bytes:
    """The frame to store for part: b"" (zeroes), a zstd frame, or part's own bytes."""
    if is_zero(part):
        return b""
    packed = zstandard.ZstdCompressor(level=LEVEL).compress(part)
    return packed if len(packed) < len(part) else part.tobytes()


def decode_into(frame: memoryview, out: memoryview) -> None:
    """Write the part frame stands for into out, which is exactly the part's length
    (zeroes are not written: out is a fresh hole). Raises FrameError when frame
    decodes to more or fewer bytes, or is not a zstd frame."""
    if len(frame) == 0:
        return
    if len(frame) == len(out):
        out[:] = frame
        return
    if len(frame) > len(out):
        raise FrameError(f"a {len(frame)}-byte frame for a {len(out)}-byte part")
    if len(frame) * SPARSE <= len(out):
        _decode_sparse(frame, out)
    else:
        _decode_dense(frame, out)


def _decode_dense(frame: memoryview, out: memoryview) -> None:
    """Decode straight into out (a part of data: the pages of a process)."""
    filled = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
            while filled < len(out):
                n = reader.readinto(out[filled:])
                if not n:
                    break
                filled += n
            extra = reader.read(1)
    except zstandard.ZstdError as e:
        raise FrameError(f"not a zstd frame of ours: {e}") from e
    if filled != len(out) or extra:
        more = "more" if extra else f"{filled}"
        raise FrameError(f"the frame decodes to {more} bytes, {len(out)} expected")


def _decode_sparse(frame: memoryview, out: memoryview) -> None:
    """Decode aside, then write only the pages that hold data: a part that compresses
    this well is mostly zeroes (a /dev/shm file), and its zero pages stay holes, as
    on the node that made it (otherwise the whole file is written, and restoring it
    into /dev/shm copies every zero page again)."""
    try:
        size = zstandard.frame_content_size(frame)  # read first: decoding allocates it
        if size != len(out):
            said = "no size" if size < 0 else f"{size} bytes"
            raise FrameError(f"the frame decodes to {said}, {len(out)} expected")
        part = zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FrameError(f"not a zstd frame of ours: {e}") from e
    if len(part) != len(out):
        raise FrameError(f"the frame decodes to {len(part)} bytes, {len(out)} expected")
    run = -1  # where the current run of data pages began
    for off in range(0, len(part) + PAGE, PAGE):
        data = off < len(part) and part[off : off + PAGE] != _ZERO[: min(PAGE, len(part) - off)]
        if data and run < 0:
            run = off
        elif not data and run >= 0:
            out[run:off] = part[run:off]
            run = -1


_ZERO = bytes(1 << 20)


def is_zero(part: memoryview) -> bool:
    """Whether part is all zeroes, compared a MiB at a time (first MiB first: data
    almost always differs there)."""
    for off in range(0, len(part), len(_ZERO)):
        chunk = part[off : off + len(_ZERO)].tobytes()  # bytes compare as memcmp
        if chunk != _ZERO[: len(chunk)]:
            return False
    return True
