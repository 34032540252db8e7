"""`rekindle-dev bench mm`: the pure parts (flags, workload, stream reading, counters, summary)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rekindle_dev import bench_mm as bench
from rekindle_dev import commands as cli


def test_cli_has_bench_mm_with_small_defaults() -> None:
    args = cli.build_parser().parse_args(["bench", "mm", "--trials", "3"])
    assert args.func is bench.run
    assert args.configs == "shm,lru,off" and args.trials == 3
    assert "rekindle-dev bench mm --trials 3 --configs shm,lru,off" in bench.command_line(args)


def test_each_configuration_gets_its_cache_flags() -> None:
    args = cli.build_parser().parse_args(["bench", "mm", "--cache-gb", "0.5"])
    shm = bench.vllm_argv(bench.server_options(Path("/m"), 1234, "shm", args))
    lru = bench.vllm_argv(bench.server_options(Path("/m"), 1234, "lru", args))
    off = bench.vllm_argv(bench.server_options(Path("/m"), 1234, "off", args))

    def value(argv: list[str], flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else None

    assert value(shm, "--mm-processor-cache-type") == "shm"
    assert value(shm, "--mm-processor-cache-gb") == "0.5"
    assert value(shm, "--mm-shm-cache-max-object-size-mb") == "64"
    assert value(lru, "--mm-processor-cache-type") == "lru"
    assert value(lru, "--mm-processor-cache-gb") == "0.5"
    assert "--mm-shm-cache-max-object-size-mb" not in lru  # vLLM refuses it without shm
    assert value(off, "--mm-processor-cache-gb") == "0"
    assert "--mm-processor-cache-type" not in off
    for argv in (shm, lru, off):  # the prefix cache would also hit on repeats
        assert "--no-enable-prefix-caching" in argv
    with pytest.raises(ValueError, match="unknown configuration"):
        bench.cache_flags("disk", 1.0, 64)


def test_request_order_sends_every_image_then_repeats() -> None:
    assert bench.request_order(3, 2) == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="at least 1"):
        bench.request_order(0, 2)


def test_draw_images_are_distinct_and_reproducible() -> None:
    pytest.importorskip("PIL")
    a = bench.draw_images(3, 64, seed=1)
    assert len(set(a)) == 3 and all(p.startswith(b"\x89PNG") for p in a)
    assert bench.draw_images(3, 64, seed=1) == a


def _sse(*chunks: object) -> list[bytes]:
    return [f"data: {json.dumps(c)}\n".encode() for c in chunks] + [b"data: [DONE]\n"]


def test_read_stream_times_the_first_content_chunk_and_counts_tokens() -> None:
    lines = _sse(
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {"content": "b"}}]},
        {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 70}},
    )
    reply = bench.read_stream(iter([b": keep-alive\n", *lines]), started=0.0)
    assert reply.tokens == 2 and 0 < reply.ttft <= reply.latency
    with pytest.raises(RuntimeError, match="without a token"):
        bench.read_stream(iter(_sse({"choices": [{"delta": {"content": ""}}]})), 0.0)
    with pytest.raises(RuntimeError, match="error"):
        bench.read_stream(iter(_sse({"error": {"message": "bad image"}})), 0.0)


def test_counter_totals_sums_labels_and_reads_total_suffix() -> None:
    text = (
        "# HELP vllm:mm_cache_hits_total hits\n"
        "# TYPE vllm:mm_cache_hits_total counter\n"
        'vllm:mm_cache_hits_total{engine="0",model_name="vlm"} 3.0\n'
        'vllm:mm_cache_hits_total{engine="1",model_name="vlm"} 2.0\n'
        'vllm:mm_cache_queries_total{engine="0",model_name="vlm"} 9.0\n'
        'vllm:mm_cache_hits_created{engine="0"} 1.7e9\n'
    )
    assert bench.counter_totals(text) == {
        "vllm:mm_cache_queries": 9.0,
        "vllm:mm_cache_hits": 5.0,
    }
    assert bench.counter_totals("") == {"vllm:mm_cache_queries": 0.0, "vllm:mm_cache_hits": 0.0}


def _run(config: str, ttft: float, rps: float, hits: float) -> dict[str, object]:
    return {
        "config": config,
        "ttft_median": ttft,
        "ttft_first_median": ttft * 2,
        "ttft_repeat_median": ttft,
        "latency_median": ttft * 3,
        "requests_per_s": rps,
        "tokens_per_s": rps * 8,
        "mm_cache_queries": 32.0,
        "mm_cache_hits": hits,
        "boot_s": 30.0,
    }


def test_summary_medians_ratios_vs_off_and_table() -> None:
    runs = [
        _run(c, t, r, h)
        for c, ts, r, h in (("off", (2.0, 3.0, 4.0), 1.0, 0.0), ("shm", (1.0, 1.5, 2.0), 2.0, 24.0))
        for t in ts
    ]
    s = bench.summarize(runs)
    assert list(s) == ["shm", "off"]  # the order of CONFIGS
    assert s["shm"]["ttft_median"] == 1.5 and s["shm"]["trials"] == 3
    assert s["shm"]["ttft_median_min"] == 1.0 and s["shm"]["ttft_median_max"] == 2.0
    assert s["shm"]["ttft_vs_off"] == 2.0 and s["shm"]["throughput_vs_off"] == 2.0
    text = bench.table(s)
    assert "| shm | 3 | 1.500 (1.000-2.000) |" in text and "| 24 / 32 |" in text
