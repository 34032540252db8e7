"""The cold-start report: vLLM's log split into phases, sections from results, warm verdict."""

# ruff: noqa: E501 (the log lines are vLLM's, whole)
from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from rekindle_dev import bench_report, bench_warm
from rekindle_dev import commands as cli

# The lines a vLLM 0.32 naive boot logs, in its own formats (paths shortened).
BOOT_LOG = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(APIServer pid=10) INFO 11-24 04:07:10 [api_utils.py:347]  version 0.32.0
(APIServer pid=10) WARNING 11-24 04:07:44 [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs
(EngineCore pid=23) INFO 11-24 04:08:05 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m'
(Worker pid=37) INFO 11-24 04:08:53 [cpu_model_runner.py:68] Starting to load model /m...
(Worker pid=37) INFO 11-24 04:08:55 [base_loader.py:82] Initializing model took 1.782946 seconds
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:15<00:00, 15.54s/it]
(Worker pid=37) INFO 11-24 04:09:11 [default_loader.py:501] Loading weights took 15.61 seconds
(EngineCore pid=23) INFO 11-24 04:09:32 [core.py:402] init engine (profile, create kv cache, warmup model) took 6.91 s
(APIServer pid=10) INFO 11-24 04:09:36 [entry.py:140] Starting vLLM server on http://127.0.0.1:1
INFO:     Application startup complete.
"""


def ts(hms: str) -> float:
    return datetime.strptime(f"2026-11-24 {hms}", "%Y-%m-%d %H:%M:%S").timestamp()


def test_naive_boot_phases_from_the_log() -> None:
    doc = bench_report.parse_vllm_log(BOOT_LOG, ts("04:07:08"), ts("04:09:38"), year=2026)
    ph = doc["phases"]
    assert ph["interpreter + vLLM imports"] == 2.0
    assert ph["config + engine process start"] == 55.0  # 04:07:10 -> 04:08:05
    assert ph["worker process start"] == 48.0
    assert ph["model init"] == pytest.approx(1.783, abs=1e-3)
    assert ph["weights load"] == 15.61
    # 04:09:32 - 6.91 s = engine init start; minus load start (04:08:53), model init, weights.
    assert ph["load, other"] == pytest.approx(32.09 - 1.783 - 15.61, abs=1e-3)
    assert ph["profile, KV cache, warm-up"] == 6.91
    assert ph["API server start"] == 4.0
    assert ph["routes up to Ready"] == 2.0
    assert sum(ph.values()) == pytest.approx(ts("04:09:38") - ts("04:07:08"), abs=1e-3)
    assert doc["eager"] is True
    assert any("Loading weights took" in ln for ln in doc["lines"])


def test_an_incomplete_log_names_what_is_missing() -> None:
    cut = BOOT_LOG.split("(EngineCore pid=23) INFO 11-24 04:09:32")[0]
    with pytest.raises(ValueError, match="engine_init"):
        bench_report.parse_vllm_log(cut)


def _write(bench: Path, rel: str, doc: dict[str, object]) -> None:
    (bench / rel).parent.mkdir(parents=True, exist_ok=True)
    (bench / rel).write_text(json.dumps(doc))


def test_report_collects_what_is_there_and_names_commands_for_the_rest(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    phases = {"agent_start": 0.5, "criu_restore": 1.0, "first_request": 0.1}
    _write(
        bench,
        "local/results.json",
        {
            "command": "rekindle-dev bench local --trials 3",
            "host": {"node": "vm", "cpus": 2, "load_avg_at_end": [1.0, 2.0, 3.0]},
            "summary": {
                "naive/warm": {
                    "variant": "naive",
                    "cache": "warm",
                    "ttft_median": 30.0,
                    "phases_median": {"vllm_boot": 30.0},
                },
                "patched/warm": {
                    "variant": "patched",
                    "cache": "warm",
                    "ttft_median": 1.6,
                    "phases_median": phases,
                    "mmap": True,
                    "speedup_vs_naive": 18.75,
                },
            },
        },
    )
    _write(
        bench,
        "cluster/demo/bench.json",
        {
            "command": "kubectl rekindle bench tiny",
            "date": "d",
            "summary": {
                arm: {
                    "ready_s": {"n": 3, "median": v},
                    "first_token_s": {"n": 3, "median": v + 1},
                }
                for arm, v in (("naive", 41.0), ("restore", 1.0))
            },
        },
    )
    (bench / "kv").mkdir()
    (bench / "kv" / "results.md").write_text("# KV table\n\n| a |\n|---|\n| 1 |\n")
    text = bench_report.report(bench, "rekindle-dev bench report --collect")
    assert "| patched (mmap) | warm | 1.60 | - | 18.8x |" in text
    assert "**18.8x**; the target is 30x: misses it (it needs 1.00 s, 0.60 s less)" in text
    assert "load average 1.0, 2.0, 3.0" in text
    assert "Command: `rekindle-dev bench local --trials 3`" in text
    assert "speedup within the run (median naive / median restore): 21.0x" in text
    assert "### KV table" in text  # a benchmark's own table, headings demoted
    # Missing results: the section says which command writes them.
    assert "`scripts/bench-criu --sizes 0.5,1,2,4 --trials 5` writes" in text
    assert "`rekindle-dev bench report --run naive` writes" in text
    assert "## Fair comparison" in text and "PR #3022" in text
    assert bench_report.cold_start_plot(bench, bench / "report" / "cold-start.png")
    assert (bench / "report" / "cold-start.png").stat().st_size > 0
    assert not bench_report.cold_start_plot(tmp_path / "empty", tmp_path / "x.png")


def test_warm_deal_balances_bytes() -> None:
    files = [{"path": f"f{i}", "size": s} for i, s in enumerate([100, 60, 50, 10, 5])]
    groups = bench_warm.deal(files, 2)  # type: ignore[arg-type]
    sizes = {f["path"]: f["size"] for f in files}
    loads = sorted(sum(sizes[p] for p in g) for g in groups)
    assert loads == [110, 115]  # largest first, each to the lighter group
    assert sorted(p for g in groups for p in g) == sorted(sizes)
    assert bench_warm.deal(files[:1], 8) == [["f0"]]  # no empty groups


def _runs(method: str, secs: list[float]) -> list[dict[str, object]]:
    return [{"method": method, "seconds": s, "after": {"percent": 100.0}} for s in secs]


def test_warm_summary_and_verdict_follow_the_numbers() -> None:
    runs = _runs("prefetch", [1.0, 2.0, 1.2]) + _runs("vmtouch -t", [0.8, 0.7, 3.0])
    runs += _runs("prefetch+blake3", [2.5, 2.4, 2.6])
    s = bench_warm.summarize(runs, 2_000_000_000)  # type: ignore[arg-type]
    assert s["prefetch"]["median_s"] == 1.2 and s["vmtouch -t"]["median_s"] == 0.8
    assert s["vmtouch -t"]["vs_prefetch"] == pytest.approx(0.8 / 1.2)
    v = bench_warm.verdict(s)
    assert v.startswith("for warming alone vmtouch -t is faster: 0.80 s")
    assert "one pass in 2.50 s" in v and "keeps its prefetcher" in v
    assert "slower than reading" not in v  # no mmap+blake3 trial: nothing said about it
    s["mmap+blake3"] = {"median_s": 1.5}
    assert "took 1.50 s here: mapping instead of reading" in bench_warm.verdict(s)
    s["mmap+blake3"] = {"median_s": 3.0}
    assert "took 3.00 s, slower than reading" in bench_warm.verdict(s)
    slow = bench_warm.summarize(
        _runs("prefetch", [1.0]) + _runs("vmtouch -t", [2.0]),  # type: ignore[arg-type]
        1,
    )
    assert bench_warm.verdict(slow).startswith("the prefetcher warms faster")


def test_naive_boot_median_per_phase() -> None:
    def trial(a: float, b: float, ready: float) -> dict[str, object]:
        return {
            "phases": {"x": a, "y": b},
            "ready_s": ready,
            "first_token_s": ready + 1,
            "eager": True,
            "lines": [],
        }

    m = bench_report.median_boot([trial(1, 5, 10), trial(3, 4, 30), trial(2, 6, 20)])
    assert m["phases"] == {"x": 2, "y": 5}
    assert (m["ready_s"], m["first_token_s"], m["eager"]) == (20, 21, True)


def _local(split: bool, resident: bool) -> dict[str, object]:
    naive: dict[str, object] = {
        "variant": "naive",
        "cache": "cold",
        "ttft_median": 31.0,
        "phases_median": {"vllm_boot": 30.0},
    }
    restore: dict[str, object] = {
        "variant": "patched-signed",
        "cache": "cold",
        "ttft_median": 3.1,
        "phases_median": {"criu_restore": 1.0},
        "speedup_vs_naive": 10.0,
    }
    if split:
        naive.update(
            vllm_split_median={"interpreter + vLLM imports": 12.0, "weights load": 3.0},
            vllm_split_trials=2,
            ready_median=30.5,
            eager=True,
        )
    if resident:
        restore["residency_before_percent"] = {"median": 0.5, "min": 0.0, "max": 1.0}
    return {
        "command": "rekindle-dev bench local --trials 2",
        "date": "2026-11-24 07:00 UTC",
        "host": {"node": "vm"},
        "summary": {"naive/cold": naive, "patched-signed/cold": restore},
        "runs": [{"variant": "naive", "vllm_split": {"phases": {}, "lines": ["INFO 11-24 x"]}}],
    }


def test_naive_split_and_residency_come_from_bench_locals_run(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    _write(bench, "local/results.json", _local(split=True, resident=True))
    _write(bench, "report/naive_boot.json", {"phases": {"weights load": 99.0}, "command": "x"})
    text = bench_report.report(bench, "rekindle-dev bench report --collect")
    naive = text.split("## Naive boot")[1].split("## Restore paths")[0]
    assert "the same run as the restore paths below (`rekindle-dev bench local --trials 2`" in naive
    assert "| weights load | 3.00 | vLLM's 'Loading weights took' |" in naive
    assert "| **launch to Ready** | **30.50** |" in naive
    assert "99.00" not in naive  # the separate run is not used when the same run has it
    assert "INFO 11-24 x" in naive
    assert "| patched-signed | cold | 3.10 | - | 10.0x | 0.5 (0.0-1.0) |" in text
    assert "Residency before restore, over the restore paths' medians: cold 0.5-0.5 %." in text
    assert "page cache before that restore: 0.5 (0.0-1.0) %." in text
    assert bench_report.cold_start_plot(bench, tmp_path / "c.png")


def test_results_without_the_new_fields_say_not_recorded(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    _write(bench, "local/results.json", _local(split=False, resident=False))
    _write(
        bench,
        "ladder/results.json",
        {
            "command": "rekindle-dev bench ladder",
            "results": [
                {"size": "0.5b", "summary": {"patched-signed/warm": {"ttft_median": 5.0}}},
            ],
        },
    )
    text = bench_report.report(bench, "rekindle-dev bench report --collect")
    assert "predate the per-boot split: not recorded there" in text
    assert "| patched-signed | cold | 3.10 | - | 10.0x | not recorded |" in text
    assert "Residency before restore: not recorded in this run." in text
    assert "- 0.5b: Residency before restore: not recorded in this run. Naive split: not" in text
    assert "page cache before that restore: not recorded." in text


# -- provenance, per-trial values, what cold means, the off switches --------------------


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _local_runs() -> dict[str, object]:
    """bench local's results for two trials: naive and patched-signed, warm and cold."""
    ttft = {("naive", "warm"): [30.0, 33.0], ("patched-signed", "warm"): [1.0, 1.1]}
    ttft |= {("naive", "cold"): [32.0, 31.0], ("patched-signed", "cold"): [2.0, 2.5]}
    runs = [
        {"variant": v, "cache": c, "trial": t, "ttft": x}
        for (v, c), xs in ttft.items()
        for t, x in enumerate(xs)
    ]
    summary = {
        f"{v}/{c}": {
            "variant": v,
            "cache": c,
            "ttft_median": sum(xs) / 2,
            "phases_median": {},
            **({"speedup_vs_naive": 1.0} if v != "naive" else {}),
        }
        for (v, c), xs in ttft.items()
    }
    return {
        "command": "rekindle-dev bench local --trials 2",
        "checkpoint_bytes": 2_000_000_000,
        "disk_floor_seconds": {"seconds": [0.8, 0.8], "median": 0.8},
        "host": {
            "node": "vm",
            "cpus": 2,
            "disk": "vda (rotational per the kernel)",
            "load_avg_at_start": [1.0, 1.0, 1.0],
            "load_avg_at_end": [2.0, 1.0, 1.0],
        },
        "summary": summary,
        "runs": runs,
    }


def _mm() -> dict[str, object]:
    rps = {"shm": [12.0, 11.0], "lru": [10.0, 11.0], "off": [8.0, 10.0]}
    return {
        "command": "rekindle-dev bench mm",
        "summary": {c: {"config": c, "requests_per_s": sum(v) / 2} for c, v in rps.items()},
        "runs": [
            {"config": c, "trial": t, "requests_per_s": x}
            for c, v in rps.items()
            for t, x in enumerate(v)
        ],
    }


def _kv() -> dict[str, object]:
    ttft = {"reuse": [1.0, 2.0], "no-reuse": [4.0, 5.0]}
    summary: dict[str, object] = {
        f"{v}/1": {
            "variant": v,
            "turn": 1,
            "prompt_tokens": 600,
            "hits_median": 512,
            "ttft_median": sum(x) / 2,
        }
        for v, x in ttft.items()
    }
    summary["reuse/1"]["speedup"] = 3.0  # type: ignore[index]
    runs = [
        {"variant": v, "trial": t, "turn": 1, "ttft": x}
        for v, xs in ttft.items()
        for t, x in enumerate(xs)
    ]
    return {"command": "rekindle-dev bench kv", "summary": summary, "runs": runs}


def _ladder() -> dict[str, object]:
    """The ladder's results for one size: naive and a restore, warm and cold, two trials."""
    ttft = {("naive", "warm"): [40.0, 44.0], ("patched-signed", "warm"): [8.0, 8.0]}
    ttft |= {("naive", "cold"): [46.0, 46.0], ("patched-signed", "cold"): [10.0, 9.2]}
    # Plain CRIU faster warm: it is shown beside the restore, never taken as the restore.
    ttft |= {("plain-criu", "warm"): [6.0, 6.0]}
    summary: dict[str, dict[str, object]] = {
        f"{v}/{c}": {"ttft_median": sum(x) / 2} for (v, c), x in ttft.items()
    }
    summary["patched-signed/warm"] |= {
        "reload_gb_per_s_median": 18.4,
        "reload_checked_gb_per_s_median": 3.4,
        "repack_seconds_median": 4.5,
    }
    summary["patched-signed/cold"] |= {"reload_gb_per_s_median": 15.8}
    runs = [
        {"variant": v, "cache": c, "trial": t, "ttft": x}
        for (v, c), xs in ttft.items()
        for t, x in enumerate(xs)
    ]
    return {
        "command": "rekindle-dev bench ladder --sizes 3b",
        "results": [{"size": "3b", "summary": summary, "runs": runs}],
    }


def _cluster() -> dict[str, object]:
    ft = {"naive": [40.0, 50.0], "restore": [2.0, 2.5]}
    return {
        "command": "kubectl rekindle bench smollm2",
        "date": "2026-11-25T10:00:00Z",
        "node": {"name": "vm", "kernel": "6.18", "cpus": "2", "kubelet": "v1.35.4"},
        "summary": {
            a: {
                "ready_s": {"n": 2, "median": sum(v) / 2},
                "first_token_s": {"n": 2, "median": sum(v) / 2},
            }
            for a, v in ft.items()
        },
        "trials": [
            {"arm": a, "trial": t, "first_token_s": x}
            for a, v in ft.items()
            for t, x in enumerate(v)
        ],
    }


def _weights() -> dict[str, object]:
    def entry(gbps: float, cached: float) -> dict[str, float]:
        return {"gbps_median": gbps, "cached_median": cached}

    runs = [
        {"set": "1GiB", "method": m, "cache": "warm", "trial": t, "gbps": g}
        for m, gs in (
            ("rekindle_fresh_map", [17.0, 18.0]),
            ("rekindle_fresh_map_checked", [3.0, 3.4]),
        )
        for t, g in enumerate(gs)
    ]
    return {
        "command": "rekindle-dev bench weights --sizes 1 --map",
        "runs": runs,
        "summary": {
            "1GiB": {
                "warm": {
                    "rekindle_fresh_map": entry(18.0, 1.0),
                    "rekindle_fresh_map_checked": entry(3.4, 1.0),
                },
                "cold": {
                    "pagecache": entry(2.8, 0.0),
                    "rekindle_fresh_map": entry(2.0, 0.4),  # was cached: not cold
                },
            }
        },
    }


@pytest.fixture
def bench_repo(tmp_path: Path) -> Path:
    """A git checkout whose docs/bench holds results from its HEAD, measuring src/."""
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "measured.py").write_text("v = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "code")
    head = _git(repo, "rev-parse", "HEAD")
    bench = repo / "docs" / "bench"
    prov = {"commit": head, "date": "2026-11-25T10:00:00Z", "measured_paths": ["src"]}
    for rel, doc in (
        ("local/results.json", _local_runs()),
        ("mm/results.json", _mm()),
        ("kv/results.json", _kv()),
        ("cluster/demo/bench.json", _cluster()),
        ("weights/results.json", _weights()),
        ("ladder/3b/results.json", _ladder()),
    ):
        _write(bench, rel, {**doc, **prov})
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "results")
    return bench


def test_every_figure_names_its_file_with_per_trial_values(bench_repo: Path) -> None:
    text = bench_report.report(bench_repo, "rekindle-dev bench report --collect")
    head = text.split("## Headline")[1].split("\n## ")[0]
    assert (
        "naive 31.50 s, best restore (patched-signed) 1.05 s to the first token: **30.0x** "
        "(per trial 30.0/30.0x: naive 30.00/33.00 s, restore 1.00/1.10 s)" in head
    )
    # The file, the load it ran under; current, so no mark.
    assert "From `docs/bench/local/results.json` (load average 1.0 at the start, 2.0 at" in head
    assert "From `docs/bench/kv/results.json` (load not recorded)." in head
    assert "**STALE**" not in text.split("## Headline")[1]
    assert "(per trial 20.0/20.0x: naive 40.0/50.0 s, restore 2.00/2.50 s)" in head
    assert "first token answered through the Service, asked once the pod is Ready" in head
    # Claims against vLLM's own off switch say so, and against its default LRU cache too.
    assert (
        "vLLM's own feature measured against vLLM's own off switch (`--mm-processor-cache-gb 0`)"
        ": the shm cache the operator turns on gives 1.28x the throughput of off (per trial "
        "1.50/1.10x), and 1.10x that of vLLM's default LRU cache (per trial 1.20/1.00x); LRU "
        "against off: 1.17x. From `docs/bench/mm/results.json` (load not recorded)." in head
    )
    assert (
        "vLLM's own automatic prefix caching measured against vLLM's own off switch "
        "(`--no-enable-prefix-caching`)" in head
    )
    assert "**3.0x** (per trial 4.0/2.5x). From `docs/bench/kv/results.json`" in head
    # Reload with and without the check; the "cold" row that was cached is left out.
    assert (
        "18.00 GB/s without the dump's BLAKE3 check (per trial 17.00/18.00), 3.40 GB/s with it "
        "(per trial 3.00/3.40)" in head
    )
    assert "cold (guest page cache dropped)" not in head
    # Cold: the guest's page cache, the disk floor's speed, the kernel's rotational flag.
    assert "(the run's disk floor read 2.50 GB/s from vda (rotational per the kernel))" in head
    # The ladder, each size: the fraction, per trial, and the reload with and without its
    # check; a cold trial's reload is said not to be cold.
    assert (
        "- Size ladder, 3b, warm page cache (`rekindle-dev bench ladder`): naive 42.00 s, "
        "restore (patched-signed) 8.00 s: **1/5.2** (per trial 1/5.0, 1/5.5); plain CRIU of "
        "the whole server (stock CRIU, no agent) 6.00 s: **plain CRIU is 1.33x faster**; "
        "weight reload 18.4 GB/s without the wait for the dump's BLAKE3 check, 3.4 GB/s with "
        "it, then 4.50 s of CPU GEMM repack. From "
        "`docs/bench/ladder/3b/results.json` (load not recorded)." in head
    )
    assert "this file does not split off the CPU GEMM repack" in head  # the cold row
    assert "with it: not recorded in this file (the reload reads what the prefetcher" in head
    local = text.split("## Restore paths")[1].split("\n## ")[0]
    assert "Source: `docs/bench/local/results.json` (commit " in local
    assert "| patched-signed | warm | 1.05 | 1.00/1.10 | 1.0x |" in local
    assert "The same run read the checkpoint cold at 2.50 GB/s from vda (rotational" in local
    assert (
        "A disk the kernel calls rotational does not deliver that: the host's cache did." in local
    )
    weights = text.split("## Weight reload")[1].split("\n## ")[0]
    assert "A cold read of" not in weights and "cold at 2.80 GB/s" in weights
    files = text.split("## Results files")[1].split("\n## ")[0]
    assert "6 results files; 0 not current" in files
    assert "| `docs/bench/kv/results.json` | " in files and "| current | yes |" in files


def test_changed_code_marks_its_results_stale_everywhere_they_are_cited(bench_repo: Path) -> None:
    repo = bench_repo.parent.parent
    (repo / "src" / "measured.py").write_text("v = 2\n")
    text = bench_report.report(bench_repo, "x")
    assert "From `docs/bench/kv/results.json` (load not recorded), **STALE**." in text
    assert "measured code has uncommitted changes now: src/measured.py" in text
    assert "6 results files; 6 not current" in text
    _git(repo, "commit", "-q", "-am", "change")
    text = bench_report.report(bench_repo, "x")
    assert "measured code changed since" in text and "src/measured.py" in text
    out = str(repo / "out.md")
    args = cli.build_parser().parse_args(
        ["bench", "report", "--collect", "--strict", "--bench-dir", str(bench_repo), "--out", out]
    )
    assert bench_report.run(args) == 1 and not (repo / "out.md").exists()


def test_stamp_cluster_adds_the_commit_to_fresh_results_only(tmp_path: Path) -> None:
    fresh = {
        "command": "kubectl rekindle bench s",
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "summary": {},
        "trials": [],
    }
    path = tmp_path / "out" / "bench.json"
    _write(tmp_path, "out/bench.json", fresh)
    (tmp_path / "out" / "bench.png").write_bytes(b"png")
    assert bench_report.run_stamp_cluster(path, str(tmp_path / "saved")) == 0
    doc = json.loads((tmp_path / "saved" / "bench.json").read_text())
    assert len(doc["commit"]) == 40 and isinstance(doc["dirty"], bool)
    assert "operator/rekindle_operator" in doc["measured_paths"]
    assert (tmp_path / "saved" / "bench.png").read_bytes() == b"png"
    assert bench_report.run_stamp_cluster(path, None) == 2  # a commit already
    _write(tmp_path, "old.json", {**fresh, "finished": "2026-01-01T00:00:00Z"})
    assert bench_report.run_stamp_cluster(tmp_path / "old.json", None) == 2
    assert "commit" not in json.loads((tmp_path / "old.json").read_text())
