"""The weight dump format and the parallel reloader, on CPU tensors (fast, no vLLM)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from rekindle_dev.testenv import require

require("torch")  # the reloader is tested on real tensors: fail, never skip
import torch  # noqa: E402
from rekindle_weights import format as fmt  # noqa: E402
from rekindle_weights.dump import dump_tensors  # noqa: E402
from rekindle_weights.reload import (  # noqa: E402
    HostCopyEngine,
    ReloadOptions,
    plan_chunks,
    release_staging_buffers,
    reload_tensors,
    run_threads,
    verify_file,
)

BLOCK = 4 * 4096  # small checksum blocks so small tensors span several


def _sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(300, 257, generator=g)  # 308 400 bytes: many blocks, unaligned end
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.w": big,
        "layers.0.norm": torch.randn(33, generator=g).half(),
        "ids": torch.arange(17, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(8, 12, generator=g).t(),  # not contiguous
        "fp8": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
    }


def _triples(ts: dict[str, torch.Tensor]) -> list[tuple[str, str, torch.Tensor]]:
    return [(n, "param", t) for n, t in ts.items()]


def _blank(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Same shapes/dtypes/strides, different content (a model whose weights were dropped)."""
    out = {}
    for n, t in ts.items():
        z = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        if z.is_contiguous() and z.numel():
            z.view(-1).view(torch.uint8).fill_(1)  # valid for every dtype, bool included
        else:
            z.zero_()
        out[n] = z
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return a.shape == b.shape
    return bool(
        torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


@pytest.fixture()
def dumped(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = _sample()
    res = dump_tensors(_triples(src), tmp_path, rank=0, block_bytes=BLOCK)
    assert res.tensors == len(src)
    return tmp_path, src


def test_layout_is_page_aligned_and_index_complete(
    dumped: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    d, src = dumped
    index = fmt.read_index(d, 0)
    assert [t.name for t in index.tensors] == list(src)
    assert index.file_bytes % fmt.ALIGN == 0
    assert os.path.getsize(fmt.data_path(d, 0)) == index.file_bytes
    for e in index.tensors:
        assert e.offset % fmt.ALIGN == 0
        t = src[e.name]
        assert e.shape == tuple(t.shape) and e.stride == tuple(t.stride())
        assert e.nbytes == t.numel() * t.element_size()
    assert not list(d.glob("*.tmp"))  # atomic write left no temp files
    # Each block's CRC is that of the bytes in the file.
    raw = fmt.data_path(d, 0).read_bytes()
    big = next(e for e in index.tensors if e.name == "layers.0.w")
    data = raw[big.offset : big.offset + big.nbytes]
    assert len(big.block_checksums()) == -(-big.nbytes // BLOCK) > 1
    assert big.block_checksums() == fmt.block_crcs(data, BLOCK)


@pytest.mark.parametrize(
    ("threads", "chunk", "staged", "buffers"),
    [
        (1, BLOCK, False, None),
        (4, BLOCK, False, None),
        (3, 2 * BLOCK, True, 1),
        (2, BLOCK, True, 5),
    ],
)
def test_round_trip_is_bit_exact(
    dumped: tuple[Path, dict[str, torch.Tensor]],
    threads: int,
    chunk: int,
    staged: bool,
    buffers: int | None,
) -> None:
    d, src = dumped
    dst = _blank(src)
    ptrs = {n: t.data_ptr() for n, t in dst.items()}
    opts = ReloadOptions(threads=threads, chunk_bytes=chunk, staged=staged, buffers=buffers)
    res = reload_tensors(d, dst, options=opts)
    assert res.path == ("staged" if staged else "host")
    for n in src:
        assert _bitwise_equal(src[n], dst[n]), n
        assert dst[n].data_ptr() == ptrs[n], f"{n} was reallocated, not refilled in place"
    assert res.bytes == sum(t.numel() * t.element_size() for t in src.values())


def test_plan_covers_every_byte_once_in_file_order() -> None:
    entries = [
        fmt.TensorEntry(f"t{i}", "param", "uint8", (n,), (1,), off, n, "0")
        for i, (n, off) in enumerate([(10, 0), (70000, 4096), (0, 77824), (5000, 77824)])
    ]
    for pack in (False, True):
        chunks = plan_chunks(entries, 16384, pack=pack)
        offs = [c.file_offset for c in chunks]
        assert offs == sorted(offs)
        seen: dict[int, int] = {}
        for c in chunks:
            assert c.length <= 16384
            for p in c.pieces:
                assert c.file_offset <= p.file_offset
                assert p.file_offset + p.length <= c.file_offset + c.length
                seen[p.tensor] = seen.get(p.tensor, 0) + p.length
        assert seen == {0: 10, 1: 70000, 3: 5000}
    packed = plan_chunks(entries, 16384, pack=True)
    # t1's tail and t3 (past the empty t2) share one read.
    assert [(p.tensor, p.tensor_offset) for p in packed[-1].pieces] == [(1, 65536), (3, 0)]


def test_short_reads_are_completed(
    dumped: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    d, src = dumped
    real = os.preadv
    calls = {"n": 0}

    def stingy(fd: int, bufs: list[memoryview], off: int) -> int:
        calls["n"] += 1
        return real(fd, [bufs[0][:1000]], off)  # never more than 1000 bytes a call

    monkeypatch.setattr(os, "preadv", stingy)
    for staged in (False, True):
        dst = _blank(src)
        reload_tensors(d, dst, options=ReloadOptions(threads=3, chunk_bytes=BLOCK, staged=staged))
        assert all(_bitwise_equal(src[n], dst[n]) for n in src)
    assert calls["n"] > 600


def test_eof_mid_tensor_names_the_tensor(
    dumped: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    d, src = dumped
    index = fmt.read_index(d, 0)
    big = next(e for e in index.tensors if e.name == "layers.0.w")
    real = os.preadv

    def eof_in_big(fd: int, bufs: list[memoryview], off: int) -> int:
        return (
            0
            if off >= big.offset + BLOCK and off < big.offset + big.nbytes
            else real(fd, bufs, off)
        )

    monkeypatch.setattr(os, "preadv", eof_in_big)
    with pytest.raises(fmt.WeightsFormatError, match=r"layers\.0\.w.*truncated"):
        reload_tensors(d, _blank(src), options=ReloadOptions(threads=2, chunk_bytes=BLOCK))


def test_truncated_file_is_refused_before_loading(
    dumped: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    d, src = dumped
    index = fmt.read_index(d, 0)
    last = index.tensors[-1]
    with open(fmt.data_path(d, 0), "r+b") as f:
        f.truncate(last.offset + 1)
    dst = _blank(src)
    before = {n: t.clone() for n, t in dst.items()}
    with pytest.raises(fmt.WeightsFormatError, match=repr(last.name)):
        reload_tensors(d, dst)
    assert all(_bitwise_equal(before[n], dst[n]) for n in dst)  # nothing written


@pytest.mark.parametrize("staged", [False, True])
def test_corrupt_byte_is_caught_and_names_the_tensor(
    dumped: tuple[Path, dict[str, torch.Tensor]], staged: bool
) -> None:
    d, src = dumped
    index = fmt.read_index(d, 0)
    big = next(e for e in index.tensors if e.name == "layers.0.w")
    with open(fmt.data_path(d, 0), "r+b") as f:
        f.seek(big.offset + 2 * BLOCK + 17)
        b = f.read(1)
        f.seek(big.offset + 2 * BLOCK + 17)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(
        fmt.WeightsFormatError,
        match=r"'layers\.0\.w'.*checksum mismatch in bytes "
        f"{2 * BLOCK}",
    ):
        reload_tensors(d, _blank(src), options=ReloadOptions(chunk_bytes=BLOCK, staged=staged))
    with pytest.raises(fmt.WeightsFormatError, match=r"layers\.0\.w"):
        verify_file(d, 0)
    # Without verification the same file loads (the caller chose to skip the check).
    reload_tensors(d, _blank(src), options=ReloadOptions(verify=False))


def test_verify_file_accepts_a_good_dump(dumped: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, src = dumped
    assert verify_file(d, 0, threads=3) == sum(t.numel() * t.element_size() for t in src.values())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.__setitem__("layers.0.norm", torch.zeros(33)), r"'layers\.0\.norm'.*float16"),
        (lambda m: m.__setitem__("ids", torch.zeros(18, dtype=torch.int64)), r"'ids'.*\[17\]"),
        (lambda m: m.pop("mask"), r"'mask' that the model lacks"),
        (lambda m: m.__setitem__("extra.bias", torch.zeros(3)), r"no tensor 'extra\.bias'"),
    ],
)
def test_index_that_does_not_match_the_model_is_refused(
    dumped: tuple[Path, dict[str, torch.Tensor]], change: object, message: str
) -> None:
    d, src = dumped
    dst = _blank(src)
    change(dst)  # type: ignore[operator]
    before = {n: t.clone() for n, t in dst.items()}
    with pytest.raises(fmt.WeightsFormatError, match=message):
        reload_tensors(d, dst)
    assert all(_bitwise_equal(before[n], dst[n]) for n in dst)


def test_bad_index_documents_are_refused(dumped: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, _src = dumped
    ipath = fmt.index_path(d, 0)
    doc = json.loads(ipath.read_text())
    doc["tensors"][1]["offset"] += 1
    ipath.write_text(json.dumps(doc))
    with pytest.raises(fmt.WeightsFormatError, match=r"'layers\.0\.w'.*unaligned"):
        fmt.read_index(d, 0)
    ipath.write_text("{not json")
    with pytest.raises(fmt.WeightsFormatError, match="not valid JSON"):
        fmt.read_index(d, 0)
    ipath.unlink()
    with pytest.raises(fmt.WeightsFormatError, match="rekindle_dump_weights"):
        fmt.read_index(d, 0)


def test_run_threads_stops_on_first_failure_and_raises_it() -> None:
    done: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        if i == 5:
            raise RuntimeError("reader 5 failed")
        with lock:
            done.append(i)

    with pytest.raises(RuntimeError, match="reader 5 failed"):
        run_threads(3, 1000, work, "t")
    assert len(done) < 100  # the others stopped soon after, not after all 1000 items


class DeferredEngine(HostCopyEngine):
    """A fake asynchronous copy engine: a copy runs only when its fence is waited on.

    If the pipeline refilled a staging buffer before waiting on the fence of
    the copies still reading it, those copies would see the new data and the
    round trip would not be bit-exact.
    """

    def __init__(self) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.unfinished: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.finished = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not hasattr(self.local, "pending"):
            self.local.pending = []
        self.local.pending.append((dst, src))

    def record(self) -> object:
        fence = getattr(self.local, "pending", [])
        self.local.pending = []
        with self.lock:
            self.unfinished.append(fence)
        return fence

    def wait(self, fence: object) -> None:
        assert isinstance(fence, list) or fence is None
        for dst, src in fence or []:
            dst.copy_(src)
        if fence:
            fence.clear()

    def finish(self) -> None:
        for fence in self.unfinished:
            self.wait(fence)
        self.finished = True


@pytest.mark.parametrize(("threads", "buffers"), [(1, 1), (2, 2), (3, 6)])
def test_staged_pipeline_waits_for_copies_before_reusing_a_buffer(
    dumped: tuple[Path, dict[str, torch.Tensor]], threads: int, buffers: int
) -> None:
    d, src = dumped
    dst = _blank(src)
    engine = DeferredEngine()
    opts = ReloadOptions(threads=threads, chunk_bytes=BLOCK, buffers=buffers, staged=True)
    reload_tensors(d, dst, options=opts, engine=engine)
    assert engine.finished
    for n in src:
        assert _bitwise_equal(src[n], dst[n]), n


def test_copy_failure_in_one_reader_is_raised_after_in_flight_copies_finish(
    dumped: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    d, src = dumped

    class Failing(DeferredEngine):
        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            if dst.numel() == 33 * 2:  # the float16 norm
                raise RuntimeError("copy engine broke")
            super().copy(dst, src)

    engine = Failing()
    with pytest.raises(RuntimeError, match="copy engine broke"):
        reload_tensors(d, _blank(src), options=ReloadOptions(threads=2, staged=True), engine=engine)
    assert engine.finished


def test_staging_buffers_are_kept_for_the_next_reload_until_released(
    dumped: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    d, src = dumped
    release_staging_buffers()
    allocs: list[int] = []

    class Counting(HostCopyEngine):
        def alloc(self, nbytes: int) -> torch.Tensor:
            allocs.append(nbytes)
            return super().alloc(nbytes)

    opts = ReloadOptions(threads=2, buffers=3, chunk_bytes=BLOCK, staged=True)
    reload_tensors(d, _blank(src), options=opts, engine=Counting())
    first = len(allocs)
    # up to 3 for the dense tensors, 1 for the non-contiguous one's own (small) read
    assert 1 <= first <= 4
    reload_tensors(d, _blank(src), options=opts, engine=Counting())
    assert len(allocs) == first  # the second reload reused them
    assert release_staging_buffers() >= (first - 1) * BLOCK  # the stand-in's read is smaller
    assert release_staging_buffers() == 0


def test_ring_is_sized_to_need(dumped: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """No more buffers than reads, none bigger than the largest read, exact sizes when the
    engine's memory is page-aligned (no page added: pinned memory would double)."""
    d, src = dumped
    release_staging_buffers()
    allocs: list[int] = []

    class Aligned(HostCopyEngine):
        page_aligned = True

        def alloc(self, nbytes: int) -> torch.Tensor:
            allocs.append(nbytes)
            raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
            skip = (-raw.data_ptr()) % 4096
            return raw[skip : skip + nbytes]

    dst = _blank(src)
    opts = ReloadOptions(threads=2, buffers=64, chunk_bytes=16 << 20, staged=True)
    reload_tensors(d, dst, options=opts, engine=Aligned())
    for n in src:
        assert _bitwise_equal(src[n], dst[n]), n
    file_bytes = fmt.read_index(d, 0).file_bytes
    # the whole small dump is one packed read (< 16 MiB): one buffer of that read's size,
    # and one for the non-contiguous tensor's own read; not 64 buffers of 16 MiB
    assert all(n % 4096 == 0 and n <= file_bytes for n in allocs), allocs
    assert len(allocs) == 2, allocs
    assert allocs[1] == 4096  # the 384-byte read: one page exactly, not a page more
    release_staging_buffers()


def test_release_empties_pytorchs_pinned_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from rekindle_weights import reload as rl

    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("empty"), raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    rl.release_staging_buffers()
    assert calls == ["empty"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert rl.empty_pinned_host_cache() is False  # no CUDA in this process: nothing pinned
    assert calls == ["empty"]


def test_non_contiguous_stand_ins_one_at_a_time(tmp_path: Path) -> None:
    """Each non-contiguous tensor is loaded through its own stand-in, freed before the next."""
    g = torch.Generator().manual_seed(2)
    src = {f"t{i}": torch.randn(64, 48, generator=g).t() for i in range(4)}
    src["dense"] = torch.randn(100, generator=g)
    dump_tensors(_triples(src), tmp_path, block_bytes=BLOCK)
    dst = _blank(src)
    live: list[int] = []
    alive = {"n": 0}
    orig = torch.Tensor.new_empty

    def counting_new_empty(self: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        import weakref

        t = orig(self, *a, **k)
        alive["n"] += 1
        live.append(alive["n"])
        weakref.finalize(t, lambda: alive.__setitem__("n", alive["n"] - 1))
        return t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "new_empty", counting_new_empty)
        reload_tensors(tmp_path, dst, options=ReloadOptions(threads=2))
    assert len(live) == 4 and max(live) == 1, live
    for n in src:
        assert _bitwise_equal(src[n], dst[n]), n
