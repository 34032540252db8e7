"""The device path on a real GPU: pinned ring, CUDA streams, in-place refill (needs CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rekindle_dev.testenv import require

require("torch")  # the reloader is tested on real tensors: fail, never skip
import torch  # noqa: E402
from rekindle_weights import format as fmt  # noqa: E402
from rekindle_weights.dump import dump_tensors  # noqa: E402
from rekindle_weights.reload import (  # noqa: E402
    CudaCopyEngine,
    ReloadOptions,
    release_staging_buffers,
    reload_tensors,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(3)
    return {
        "a": torch.randn(1000, 513, device="cuda", generator=g).to(torch.bfloat16),
        "b": torch.randn(7, device="cuda", generator=g),
        "c": torch.randint(0, 100, (33, 5), device="cuda", generator=g),
        "t": torch.randn(64, 48, device="cuda", generator=g).t(),
        "big": torch.randn(9 << 20, device="cuda", generator=g).half(),  # spans many chunks
    }


@pytest.mark.parametrize("direct", [False, True])
def test_cuda_round_trip_in_place(tmp_path: Path, direct: bool) -> None:
    src = _weights()
    dump_tensors([(n, "param", t) for n, t in src.items()], tmp_path, 0)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    ptrs = {n: t.data_ptr() for n, t in dst.items()}
    res = reload_tensors(
        tmp_path, dst, options=ReloadOptions(threads=4, chunk_bytes=8 << 20, direct=direct)
    )
    assert res.path == "staged"
    for n in src:
        assert torch.equal(src[n], dst[n]), n
        assert dst[n].data_ptr() == ptrs[n]
    assert release_staging_buffers() > 0


def test_cuda_corruption_names_the_tensor(tmp_path: Path) -> None:
    src = _weights()
    dump_tensors([(n, "param", t) for n, t in src.items()], tmp_path, 0)
    e = next(t for t in fmt.read_index(tmp_path, 0).tensors if t.name == "big")
    with open(fmt.data_path(tmp_path, 0), "r+b") as f:
        f.seek(e.offset + e.nbytes - 3)
        f.write(b"\x00\x01\x02")
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    with pytest.raises(fmt.WeightsFormatError, match=r"'big'.*checksum"):
        reload_tensors(tmp_path, dst, engine=CudaCopyEngine(torch.device("cuda")))
