from __future__ import annotations

from pathlib import Path
from typing import Any

from rekindle_dev import bench_local


def _run(variant: str, cache: str, ttft: float, **phases: float) -> dict[str, Any]:
    return {"variant": variant, "cache": cache, "ttft": ttft, "phases": phases, "mmap": False}


RUNS = [
    _run("naive", "warm", 30.0, agent_start=0.5, vllm_boot=29.0, first_request=0.5),
    _run("naive", "warm", 34.0, agent_start=0.5, vllm_boot=33.0, first_request=0.5),
    _run("naive", "warm", 31.0, agent_start=0.5, vllm_boot=30.0, first_request=0.5),
    _run("patched", "warm", 1.5, agent_start=0.5, criu_restore=0.9, first_request=0.1),
    _run("patched", "warm", 1.4, agent_start=0.4, criu_restore=0.9, first_request=0.1),
    _run("patched", "warm", 2.0, agent_start=0.5, criu_restore=1.4, first_request=0.1),
]


def test_summary_medians_spread_and_speedup() -> None:
    s = bench_local.summarize(RUNS)
    naive, patched = s["naive/warm"], s["patched/warm"]
    assert (naive["ttft_median"], naive["ttft_min"], naive["ttft_max"]) == (31.0, 30.0, 34.0)
    assert patched["ttft_median"] == 1.5
    assert abs(patched["speedup_vs_naive"] - 31.0 / 1.5) < 1e-9
    assert patched["phases_median"] == {
        "agent_start": 0.5,
        "criu_restore": 0.9,
        "first_request": 0.1,
    }


def test_table_and_plot(tmp_path: Path) -> None:
    s = bench_local.summarize(RUNS)
    text = bench_local.table(s)
    assert "| patched | warm | 3 | 1.50 | 1.40-2.00 | 20.7 |" in text
    bench_local.plot(s, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
