"""`rekindle-dev bench weights`: the command wiring, the summary, and a small real run (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

from rekindle_dev.testenv import require

require("torch")  # the reloader is tested on real tensors: fail, never skip
from rekindle_dev import bench_weights as bench  # noqa: E402
from rekindle_dev import commands as cli  # noqa: E402


def test_summary_ratios_and_table() -> None:
    rows = [
        {"set": "1GiB", "method": m, "cache": "warm", "trial": t, "bytes": 1, "gbps": g}
        for m, gs in {"rekindle": [4.0, 5.0, 6.0], "pagecache": [5.0, 5.0, 9.0]}.items()
        for t, g in enumerate(gs)
    ]
    s = bench.summarize(rows)
    rk = s["1GiB"]["warm"]["rekindle"]
    assert rk["gbps_median"] == 5.0 and rk["trials"] == 3
    assert rk["vs_pagecache"] == 1.0
    assert "| 1GiB | warm | pagecache | 5.000 | 5.000..9.000 | 1.00 |  |" in bench.table(s)


def test_cli_has_bench_weights_beside_other_benchmarks() -> None:
    args = cli.build_parser().parse_args(["bench", "weights", "--sizes", "1", "--no-cold"])
    assert args.func is bench.run and args.sizes == "1" and args.no_cold
    assert bench.command_line(args) == (
        "rekindle-dev bench weights --sizes 1 --trials 3 --device cpu --no-cold"
    )


def test_small_real_run_writes_json_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = cli.main(
        [
            "bench",
            "weights",
            "--sizes",
            "0.05",
            "--trials",
            "1",
            "--no-cold",
            "--no-vllm",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    warm = doc["summary"]["0.05GiB"]["warm"]
    methods = ("pagecache", "rekindle", "rekindle_verify", "rekindle_fresh")
    for method in (*methods, "dump_check_blake3", "rekindle_fresh_checked"):
        assert warm[method]["gbps_median"] > 0, method
    assert (
        len(doc["commit"]) == 40
        and "scripts/rekindle_dev/bench_weights.py" in (doc["measured_paths"])
    )
    assert doc["host"]["load_avg_at_start"] and doc["host"]["disk"]
    assert (out / "results.png").stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "rekindle_verify" in md and "Made from commit " in md
    assert '"_checked": the restore\'s BLAKE3 check of the dump' in md
