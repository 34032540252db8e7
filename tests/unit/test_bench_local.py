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


def test_table_has_the_residency_columns_and_the_split() -> None:
    text = bench_local.table(bench_local.summarize(RUNS))
    assert "| data in page cache before (%) | runtime in page cache before (%) |" in text
    # No trial numbers in these runs: the ratio of medians only.
    assert (
        "| patched (mmap) | cold | 3 | 3.10 | 3.00, 3.20, 3.10 | 10.3 | - | 1.0 (0.0-2.0) | - |"
        in (text)
    )
    assert "| patched (mmap) | warm | 1 | 1.00 | 1.00 | - | - | 100.0 | - |" in text
    assert "| naive (mmap) | cold | 3 | 32.00 | 30.00, 34.00, 32.00 | - | - | - | - |" in text
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


def _trial(variant: str, cache: str, trial: int, ttft: float, data: float, rt: float) -> dict:
    before = {"data": {"percent": data}, "runtime": {"percent": rt}}
    return {**_run(variant, cache, ttft), "trial": trial, "cache_before": before}


def test_ratios_are_per_trial_and_every_arm_has_its_residency() -> None:
    """naive's run over the arm's run of the SAME trial and cache, in trial order, beside
    the ratio of the medians; residency of data and runtime for naive too."""
    runs = [
        _trial("naive", "warm", 0, 30.0, 100.0, 99.0),
        _trial("naive", "warm", 1, 20.0, 98.0, 97.0),
        _trial("naive", "warm", 2, 40.0, 100.0, 100.0),
        _trial("patched", "warm", 2, 2.0, 100.0, 100.0),
        _trial("patched", "warm", 0, 1.0, 99.0, 100.0),
        _trial("patched", "warm", 1, 4.0, 100.0, 98.0),
        _trial("plain-criu", "warm", 0, 3.0, 100.0, 100.0),
        _trial("plain-criu", "warm", 1, 3.0, 100.0, 100.0),
        _trial("plain-criu", "warm", 2, 6.0, 100.0, 100.0),
    ]
    s = bench_local.summarize(runs)
    patched = s["patched/warm"]
    assert patched["speedup_per_trial"] == [30.0, 5.0, 20.0]
    assert patched["speedup_vs_naive"] == 30.0 / 2.0
    assert patched["speedup_vs_plain_criu"] == 3.0 / 2.0
    assert s["plain-criu/warm"]["speedup_per_trial"] == [10.0, 6.67, 6.67]
    assert "speedup_vs_plain_criu" not in s["plain-criu/warm"]
    naive = s["naive/warm"]
    assert naive["residency_before_percent"] == {"median": 100.0, "min": 98.0, "max": 100.0}
    assert naive["runtime_residency_percent"] == {"median": 99.0, "min": 97.0, "max": 100.0}
    row = next(ln for ln in bench_local.table(s).splitlines() if ln.startswith("| patched"))
    assert "| 15.0 (30.0/5.0/20.0) | 1.50 | 100.0 (99.0-100.0) | 100.0 (98.0-100.0) |" in row


def test_each_arm_warms_what_it_reads(tmp_path: Path) -> None:
    from rekindle_dev.plain_criu import PlainImage

    model, ckpt = tmp_path / "model", tmp_path / "ckpt"
    plain = PlainImage(
        tmp_path / "images", tmp_path / "shm", tmp_path / "log", tmp_path / "log.0", 1, "tiny"
    )
    assert bench_local.data_paths("naive", model, ckpt, plain) == [model]
    assert bench_local.data_paths("patched", model, ckpt, plain) == [ckpt]
    assert bench_local.data_paths("stock", model, ckpt, None) == [ckpt]
    assert bench_local.data_paths("plain-criu", model, ckpt, plain) == [
        tmp_path / "images",
        tmp_path / "shm",
        tmp_path / "log.0",
    ]
    runtime = bench_local.runtime_paths()
    import rekindle_agent
    import vllm

    for module in (rekindle_agent, vllm):  # the agent's code and what vLLM imports
        path = Path(str(module.__file__)).resolve()
        assert any(path.is_relative_to(p) for p in runtime), (path, runtime)
    for p in runtime:  # none inside another (nothing read twice)
        assert not any(p != q and p.is_relative_to(q) for q in runtime)


def test_residency_of_sums_its_paths(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"x" * 8192)
    doc = bench_local.residency_of([tmp_path / "a", tmp_path / "b"])
    assert doc["bytes"] == 2 * 8192
    assert 0 <= doc["resident_bytes"] <= doc["bytes"]


def test_arms_order_rotates_per_trial() -> None:
    order = ["naive", "plain-criu", "patched"]
    assert bench_local.rotated(order, 0) == order
    assert bench_local.rotated(order, 1) == ["plain-criu", "patched", "naive"]
    assert bench_local.rotated(order, 3) == order


def _phased(variant: str, ttft: float, **phases: float) -> dict[str, Any]:
    return {"variant": variant, "cache": "warm", "ttft": ttft, "phases": phases, "mmap": False}


PHASED = [
    _phased("naive", 30.0, agent_start=0.5, vllm_boot=29.0, first_request=0.5),
    _phased("naive", 34.0, agent_start=0.5, vllm_boot=33.0, first_request=0.5),
    _phased("naive", 31.0, agent_start=0.5, vllm_boot=30.0, first_request=0.5),
    _phased("patched", 1.5, agent_start=0.5, criu_restore=0.9, first_request=0.1),
    _phased("patched", 1.4, agent_start=0.4, criu_restore=0.9, first_request=0.1),
    _phased("patched", 2.0, agent_start=0.5, criu_restore=1.4, first_request=0.1),
]


def test_summary_medians_spread_and_speedup() -> None:
    s = bench_local.summarize(PHASED)
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
    s = bench_local.summarize(PHASED)
    text = bench_local.table(s)
    assert "| patched | warm | 3 | 1.50 | 1.50, 1.40, 2.00 | 20.7 | - | - | - |" in text
    bench_local.plot(s, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
