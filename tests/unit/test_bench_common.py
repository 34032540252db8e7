"""The benches' shared table and plot helpers, and bench kv's table built with them."""

from __future__ import annotations

from pathlib import Path

from rekindle_dev import bench_common, bench_kv


def test_md_table_and_cells() -> None:
    text = bench_common.md_table(("a", "b"), [("1", "2"), ("3", "-")])
    assert text == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | - |\n"
    assert bench_common.fmt(None) == "-"
    assert bench_common.fmt(1.23456, "{:.2f}") == "1.23"
    s = {"t": 1.5, "t_min": 1.0, "t_max": 2.0, "u": 3.0}
    assert bench_common.spread(s, "t") == "1.500 (1.000-2.000)"
    assert bench_common.spread(s, "u") == "3.000"  # no range recorded: the value alone
    assert bench_common.spread(s, "v") == "-"
    assert bench_common.spread({"m": 2.0, "lo": 1.0, "hi": 3.0}, "m", "{:.1f}", "lo", "hi") == (
        "2.0 (1.0-3.0)"
    )


def test_residency_cell() -> None:
    assert bench_common.residency_cell({"variant": "naive"}) == "-"
    assert bench_common.residency_cell({"variant": "disk-floor"}) == "-"
    assert bench_common.residency_cell({"variant": "patched"}) == "not recorded"
    one = {"median": 99.5, "min": 99.5, "max": 99.5}
    assert bench_common.residency_cell({"variant": "patched", "residency_before_percent": one}) == (
        "99.5"
    )


def test_save_figure_writes_a_png(tmp_path: Path) -> None:
    fig, ax = bench_common.pyplot().subplots()
    ax.plot([0, 1], [0, 1])
    bench_common.save_figure(fig, tmp_path / "f.png", "title")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def _row(variant: str, turn: int, ttft: float) -> dict[str, object]:
    return {
        "variant": variant,
        "turn": turn,
        "prompt_tokens": 100 * (turn + 1),
        "hits_median": 96 * turn,
        "ttft_median": ttft,
        "ttft_min": ttft - 0.1,
        "ttft_max": ttft + 0.1,
    }


def test_kv_table_pairs_each_reuse_turn_with_its_baseline(tmp_path: Path) -> None:
    summary = {
        "reuse/1": {**_row("reuse", 1, 0.5), "speedup": 4.0},
        "no-reuse/1": _row("no-reuse", 1, 2.0),
        "reuse/2": _row("reuse", 2, 0.6),  # no baseline: left out
    }
    text = bench_kv.table(summary)
    assert "| 2 | 200 | 96 | 0.500 (0.400-0.600) | 2.000 (1.900-2.100) | 4.0 |" in text
    assert "| 3 |" not in text
    bench_kv.plot(summary, tmp_path / "kv.png", "t")
    assert (tmp_path / "kv.png").stat().st_size > 0


def test_host_facts_name_the_machine_and_keep_the_loads() -> None:
    from rekindle_dev.bench_common import host_facts

    h = host_facts(load_avg_at_end=(1.0, 2.0, 3.0))
    assert h["cpus"] and h["kernel"] and h["memory_gib"] > 0
    assert h["load_avg_at_end"] == (1.0, 2.0, 3.0) and "load_avg_at_start" not in h
