"""bench local's per-trial residency and naive split: recorded, summarized, shown."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from rekindle_dev import bench_common, bench_local

from tests.unit.test_bench_report import BOOT_LOG


def _run(variant: str, cache: str, ttft: float, **extra: Any) -> dict[str, Any]:
    return {
        "variant": variant,
        "cache": cache,
        "ttft": ttft,
        "ready": ttft - 0.5,
        "phases": {"agent_start": 0.5},
        "mmap": True,
        **extra,
    }


def _resident(percent: float) -> dict[str, Any]:
    return {"percent": percent, "resident_bytes": 0, "bytes": 100, "tool": "mincore"}


def _split(imports: float, weights: float) -> dict[str, Any]:
    phases = {"interpreter + vLLM imports": imports, "weights load": weights}
    return {"phases": phases, "eager": True, "lines": ["l"]}


RUNS = [
    _run("naive", "cold", 30.0, vllm_split=_split(10.0, 2.0)),
    _run("naive", "cold", 34.0, vllm_split=_split(14.0, 4.0)),
    _run("naive", "cold", 32.0, vllm_split={"error": "vLLM log lacks ['server']"}),
    _run("patched", "cold", 3.0, residency_before=_resident(0.0)),
    _run("patched", "cold", 3.2, residency_before=_resident(2.0)),
    _run("patched", "cold", 3.1, residency_before=None),  # asking failed: left out
    _run("patched", "warm", 1.0, residency_before=_resident(100.0)),
]


def test_summary_keeps_residency_and_the_naive_split_of_the_same_run() -> None:
    s = bench_local.summarize(RUNS)
    assert s["patched/cold"]["residency_before_percent"] == {"median": 1.0, "min": 0.0, "max": 2.0}
    assert s["patched/warm"]["residency_before_percent"]["median"] == 100.0
    naive = s["naive/cold"]
    # The boot whose log could not be split counts for the first token, not for the split.
    assert naive["vllm_split_trials"] == 2
    assert naive["vllm_split_median"] == {"interpreter + vLLM imports": 12.0, "weights load": 3.0}
    assert naive["ready_median"] == 31.5
    assert "residency_before_percent" not in naive


def test_table_has_the_residency_column_and_the_split() -> None:
    text = bench_local.table(bench_local.summarize(RUNS))
    assert "page cache before restore (%) |" in text
    assert "| patched (mmap) | cold | 3 | 3.10 | 3.00-3.20 | 10.3 | 1.0 (0.0-2.0) |" in text
    assert "| patched (mmap) | warm | 1 | 1.00 | 1.00-1.00 | 1.0 | 100.0 |" in text
    assert "| naive (mmap) | cold | 3 | 32.00 | 30.00-34.00 | 1.0 | - |" in text
    assert "- naive/cold (median of 2; " in text
    assert "interpreter + vLLM imports 12.00, weights load 3.00" in text


def test_old_results_say_not_recorded() -> None:
    old = [
        {k: v for k, v in r.items() if k not in ("residency_before", "vllm_split")} for r in RUNS
    ]
    s = bench_local.summarize(old)
    assert bench_common.residency_cell(s["patched/cold"]) == "not recorded"
    assert "Naive boot split" not in bench_local.table(s)


def test_vllm_split_reads_the_boots_own_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(BOOT_LOG)
    # The parser stamps the log's month-day with this year.
    launched = datetime.strptime(f"{datetime.now().year}-11-24 04:07:08", "%Y-%m-%d %H:%M:%S")
    split = bench_local.vllm_split(log, launched.timestamp(), 150.0)
    assert split["phases"]["interpreter + vLLM imports"] == 2.0  # 04:07:08 to 04:07:10
    assert split["phases"]["routes up to Ready"] == 2.0  # 04:09:36 to launch + 150 s
    assert split["phases"]["weights load"] == 15.61
    assert split["eager"] is True
    log.write_text(BOOT_LOG.split("Starting vLLM server")[0])
    assert "server" in bench_local.vllm_split(log, launched.timestamp(), 150.0)["error"]
    assert "error" in bench_local.vllm_split(tmp_path / "gone.log", launched.timestamp(), 150.0)


def test_residency_before_measures_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "pages-1.img").write_bytes(b"x" * 8192)
    doc = bench_local.residency_before(tmp_path / "ckpt")
    assert doc is not None and doc["files"] == 1
    assert bench_local.residency_before(tmp_path / "gone") is None
