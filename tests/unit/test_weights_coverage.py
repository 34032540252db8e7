"""The dump's coverage check: every byte a release frees must be in the dump.

On CPU the check is structural (whole storages covered by the dumped tensors); the CUDA
accounting (live allocator blocks of vLLM's "weights" memory) is fed here with the
addresses of real CPU tensors standing in for those blocks.
"""

from __future__ import annotations

from rekindle_dev.testenv import require

require("torch")  # the reloader is tested on real tensors: fail, never skip
import torch  # noqa: E402
from rekindle_weights.dump import coverage, uncovered  # noqa: E402
from rekindle_weights.tensors import model_tensors  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two names
        self.register_buffer("cos_sin", torch.randn(32, 4))


def test_a_plain_model_is_covered() -> None:
    m = Tiny()
    cov = coverage(list(model_tensors(m)))
    assert cov.complete, cov.problems
    expected = sum(p.numel() * p.element_size() for p in m.parameters()) + 32 * 4 * 4
    assert cov.tensor_bytes == cov.storage_bytes == expected
    assert cov.allocated_bytes is None
    assert cov.to_json()["complete"] is True


def test_a_parameter_viewing_part_of_an_allocation_is_refused() -> None:
    fused = torch.randn(3, 64)  # e.g. a loader that kept a fused buffer and exposed one third
    tensors = [("q.weight", "param", fused[0]), ("k.weight", "param", fused[1])]
    cov = coverage(tensors)
    assert not cov.complete
    assert "256 of 768 bytes" in cov.problems[0] and "'q.weight'" in cov.problems[0]
    whole = [*tensors, ("v.weight", "param", fused[2])]
    assert coverage(whole).complete


def test_non_contiguous_views_cover_their_storage() -> None:
    w = torch.randn(8, 6)
    assert coverage([("w_t", "param", w.t())]).complete
    assert not coverage([("every_other", "param", w[:, ::2])]).complete


def _live(*ts: torch.Tensor) -> list[tuple[int, int]]:
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in ts]


def test_live_allocations_outside_parameters_are_found() -> None:
    m = Tiny()
    tensors = list(model_tensors(m))
    own = _live(*(t for _, _, t in tensors))
    assert coverage(tensors, own).complete
    workspace = torch.empty(1000, dtype=torch.uint8)  # allocated at load, held by no parameter
    cov = coverage(tensors, [*own, *_live(workspace)])
    assert not cov.complete
    assert cov.allocated_bytes == sum(n for _, n in own) + 1000
    assert "1000 bytes in 1 live allocation" in cov.problems[-1]


def test_uncovered_ranges() -> None:
    assert uncovered([(100, 50)], [(100, 50)]) == []
    assert uncovered([(100, 50)], [(90, 100)]) == []
    assert uncovered([(100, 50)], [(110, 10)]) == [(100, 10), (120, 30)]
    assert uncovered([(0, 10), (5, 10)], []) == [(0, 15)]
    assert uncovered([(0, 10)], [(0, 4), (4, 4)]) == [(8, 2)]
