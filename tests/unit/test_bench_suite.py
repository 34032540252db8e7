"""bench suite: what it reads from make's output and how it reports against the budget."""

from __future__ import annotations

from rekindle_dev import bench_suite

OUTPUT = """\
.venv/bin/python -m pytest -m vllm --durations=25 --durations-min=1
============================= slowest 25 durations =============================
64.02s setup    tests/vllm/test_agent_flow.py::test_checkpoint_manifest_and_verification
3.10s call     tests/vllm/test_agent_flow.py::test_restore_serves
48.50s call     tests/vllm/test_tp2.py::test_tp2
================== 67 passed, 2 deselected in 660.01s (0:11:00) ==================
"""


def test_parse_output_reads_the_summary_and_the_slowest_first() -> None:
    summary, slowest = bench_suite.parse_output(OUTPUT, top=2)
    assert summary == "67 passed, 2 deselected"
    assert slowest == [
        {
            "seconds": 64.02,
            "phase": "setup",
            "test": "tests/vllm/test_agent_flow.py::test_checkpoint_manifest_and_verification",
        },
        {"seconds": 48.5, "phase": "call", "test": "tests/vllm/test_tp2.py::test_tp2"},
    ]
    assert bench_suite.parse_output("make: Nothing to be done\n") == ("", [])


def _doc(total: float, passed: bool) -> dict:
    run = bench_suite.TargetRun("test-vllm", total, 0 if passed else 2, "67 passed")
    return {
        "commit": "0123456789abcdef",
        "date": "2026-11-26T01:00:00Z",
        "total_seconds": total,
        "passed": passed,
        "targets": [
            {**run.__dict__, "slowest": [{"seconds": 64.0, "phase": "setup", "test": "t"}]}
        ],
    }


def test_table_says_whether_it_fits_the_budget() -> None:
    ok = bench_suite.table(_doc(39 * 60, True))
    assert "39.0 min in all, within the 40-minute budget; every target passed" in ok
    assert "| test-vllm | 39.0 | 0 | 67 passed |" in ok
    assert "- test-vllm: 64.0 s setup t" in ok
    assert "NOT within the 40-minute budget" in bench_suite.table(_doc(41 * 60, True))
    assert "NOT within the 40-minute budget; FAILED" in bench_suite.table(_doc(60, False))
