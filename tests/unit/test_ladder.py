"""The size ladder's pure logic: shapes, parameter counts, shards, the streamed safetensors."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from rekindle_dev import ladder


@pytest.mark.parametrize("size", sorted(ladder.SIZES))
def test_param_count_is_the_nominal_size(size: str) -> None:
    spec = ladder.SIZES[size]
    count = ladder.param_count(spec)
    assert abs(count - spec.nominal_params) <= 0.10 * spec.nominal_params, (size, count)


def test_param_counts_match_the_published_models() -> None:
    """Qwen2.5-0.5B 0.49B, Qwen2.5-1.5B 1.54B, Llama-3.2-3B 3.21B (tied heads counted once)."""
    got = {k: round(ladder.param_count(v) / 1e9, 2) for k, v in ladder.SIZES.items()}
    assert got == {"0.5b": 0.49, "1.5b": 1.54, "3b": 3.21}


def test_qwen_has_qkv_biases_and_llama_none() -> None:
    qwen = ladder.tensor_shapes(ladder.SIZES["0.5b"])
    llama = ladder.tensor_shapes(ladder.SIZES["3b"])
    assert qwen["model.layers.0.self_attn.k_proj.bias"] == (2 * 64,)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen
    assert not [n for n in llama if n.endswith(".bias")]
    assert llama["model.layers.27.self_attn.k_proj.weight"] == (8 * 128, 3072)
    assert "lm_head.weight" not in llama  # tied


def test_untied_head_is_counted() -> None:
    spec = ladder.SIZES["0.5b"]
    untied = dataclasses.replace(spec, tie_word_embeddings=False)
    extra = ladder.param_count(untied) - ladder.param_count(spec)
    assert extra == spec.vocab_size * spec.hidden_size


def test_unknown_size_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"0\.5b, 1\.5b, 3b"):
        ladder.spec_for("7b")
    assert ladder.spec_for("0.5B") is ladder.SIZES["0.5b"]


def test_cache_key_names_the_size_and_changes_with_the_spec() -> None:
    spec = ladder.SIZES["1.5b"]
    key = ladder.cache_key(spec)
    assert key.startswith("ladder-1.5b-") and key == ladder.cache_key(spec)
    assert ladder.cache_key(dataclasses.replace(spec, seed=1)) != key


def test_shards_respect_the_bound_and_keep_order() -> None:
    shapes = ladder.tensor_shapes(ladder.SIZES["3b"])
    shards = ladder.plan_shards(shapes, 2 << 30)
    assert [n for s in shards for n in s] == list(shapes)
    for s in shards:
        size = sum(2 * _numel(shapes[n]) for n in s)
        assert size <= 2 << 30 or len(s) == 1
    assert len(shards) == 4  # 6.4 GB of bf16


def test_header_is_aligned_and_offsets_contiguous() -> None:
    shapes = {"a": (3, 5), "b": (7,)}
    raw = ladder.safetensors_header(["a", "b"], shapes)
    (n,) = struct.unpack("<Q", raw[:8])
    assert n == len(raw) - 8 and n % 8 == 0
    doc = json.loads(raw[8:])
    assert doc["a"] == {"dtype": "BF16", "shape": [3, 5], "data_offsets": [0, 30]}
    assert doc["b"]["data_offsets"] == [30, 44]


def _small_spec() -> ladder.LadderSpec:
    return dataclasses.replace(
        ladder.SIZES["0.5b"],
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=40,
    )


def test_streamed_shards_load_with_safetensors(tmp_path: Path) -> None:
    """The hand-written files are valid safetensors with the planned tensors and values."""
    import torch
    from safetensors.torch import load_file

    spec = _small_spec()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    wmap = ladder.write_shards(spec, a, vocab=30, progress=lambda _: None, max_bytes=3000)
    ladder.write_shards(spec, b, vocab=30, progress=lambda _: None, max_bytes=3000)
    files = sorted({*wmap.values()})
    assert len(files) > 1 and (a / "model.safetensors.index.json").is_file()
    for f in files:  # seeded: the same bytes every time
        assert (a / f).read_bytes() == (b / f).read_bytes()
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(a / f)))
    shapes = ladder.tensor_shapes(spec)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == shapes
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert torch.equal(tensors["model.norm.weight"], torch.ones(16, dtype=torch.bfloat16))
    assert not tensors["model.layers.0.self_attn.q_proj.bias"].any()
    emb = tensors["model.embed_tokens.weight"].float()
    assert emb[:30].abs().min() >= 2**-8 and emb[:30].abs().max() < 2**-6
    assert not emb[30:].any()  # rows the tokenizer cannot produce: logit 0, never picked
    q = tensors["model.layers.0.self_attn.q_proj.weight"].float()
    assert (q > 0).any() and (q < 0).any()
    assert not torch.equal(q, tensors["model.layers.1.self_attn.q_proj.weight"].float())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_reload_is_compared_with_the_same_runs_best_read() -> None:
    """The reload alone and with the dump's check it waited for, each divided by the median
    of the trials' best page-cache reads; naive rows get the baseline but no ratio."""
    from rekindle_dev.bench_ladder import RESTORE, vs_read_cell, with_read_baseline

    summary = {
        f"{RESTORE}/warm": {
            "reload_seconds_median": 1.0,
            "reload_gb_per_s_median": 6.0,
            "reload_checked_gb_per_s_median": 2.0,
            "phases_median": {"weights_check_wait": 2.0, "reload_weights": 1.0},
        },
        "naive/warm": {"phases_median": {}},
    }
    reads = [{"best": 4.0}, {"best": 2.0}, {"best": 3.0}]
    out = with_read_baseline(summary, reads)
    r = out[f"{RESTORE}/warm"]
    assert r["read_best_gbps_median"] == 3.0 and r["read_best_gbps_range"] == (2.0, 4.0)
    assert r["reload_vs_best_read"] == 2.0
    assert r["reload_checked_vs_best_read"] == 2.0 / 3.0
    assert "reload_vs_best_read" not in out["naive/warm"]
    assert vs_read_cell(r) == "2.00 / 0.67 (read 3.00 GB/s, 2.00-4.00)"
    assert vs_read_cell(out["naive/warm"]) == "-"
    assert with_read_baseline({"x": {}}, []) == {"x": {}}


def test_reload_rate_with_its_check_counts_the_wait() -> None:
    """The reload's GB/s alone and counting the wait for the dump's BLAKE3 (the reload
    starts only once it is checked), per run, then the median."""
    from rekindle_dev.bench_ladder import RESTORE, reload_cell, summarize_size

    def run(trial: int, reload: float, wait: float) -> dict[str, Any]:
        phases = {"reload_weights": reload, "weights_check_wait": wait}
        return {"variant": RESTORE, "cache": "warm", "ttft": 5.0, "trial": trial,
                "phases": phases, "mmap": True}  # fmt: skip

    s = summarize_size([run(0, 1.0, 1.0), run(1, 2.0, 0.0), run(2, 0.5, 1.5)], 4 * 10**9)
    r = s[f"{RESTORE}/warm"]
    assert r["reload_gb_per_s_median"] == 4.0  # 4, 2, 8
    assert r["reload_checked_gb_per_s_median"] == 2.0  # 2, 2, 2
    assert reload_cell(r, "warm") == "4.00 / 2.00"
    assert reload_cell(r, "cold") == "4.00 / 2.00 (page cache: prefetched)"


def test_reload_rate_is_the_read_and_the_repack_is_apart() -> None:
    """Where the agent split reload_weights, the rate counts only reading or mapping the
    dump; the CPU GEMM repack after it is shown on its own."""
    from rekindle_dev.bench_ladder import RESTORE, reload_cell, summarize_size

    def run(trial: int, read: float, repack: float) -> dict[str, Any]:
        phases = {
            "reload_weights": read + repack + 0.01,
            "reload_weights.read": read,
            "reload_weights.repack": repack,
            "weights_check_wait": 0.0,
        }
        return {"variant": RESTORE, "cache": "warm", "ttft": 5.0, "trial": trial,
                "phases": phases, "mmap": True}  # fmt: skip

    s = summarize_size([run(0, 0.5, 3.0), run(1, 1.0, 4.0), run(2, 0.25, 5.0)], 4 * 10**9)
    r = s[f"{RESTORE}/warm"]
    assert r["reload_gb_per_s_median"] == 8.0  # 8, 4, 16
    assert r["repack_seconds_median"] == 4.0
    assert reload_cell(r, "warm") == "8.00 / 8.00; then CPU GEMM repack 4.00 s"
