"""The density and CRIU benches' pure parts: sandbox argv, kernel-number parsing, summaries,
tables, provenance keys (`rekindle-dev bench density`, scripts/bench-criu). Nothing timed."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from rekindle_dev import bench_common
from rekindle_dev import bench_density as dens
from rekindle_dev import commands as cli

REPO = Path(__file__).resolve().parents[2]


def bench_criu() -> ModuleType:
    """scripts/bench-criu (a script without .py) as a module."""
    loader = importlib.machinery.SourceFileLoader("bench_criu", str(REPO / "scripts/bench-criu"))
    spec = importlib.util.spec_from_loader("bench_criu", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


# -- rekindle-dev bench density --------------------------------------------------------


def test_cli_has_bench_density_with_its_defaults() -> None:
    args = cli.build_parser().parse_args(["bench", "density", "--criu-prefix", "/c"])
    assert args.func is dens.run
    assert (args.replicas, args.modes, args.caches, args.trials) == (
        "1,2,4",
        "stock,mmap",
        "cold",
        3,
    )
    assert dens.command_line(args) == (
        "rekindle-dev bench density --criu-prefix /c --replicas 1,2,4 --modes stock,mmap "
        "--caches cold --trials 3 --prompts 4 --max-tokens 32 --work /var/tmp/rekindle-density "
        "--out docs/bench/density"
    )


def test_modes_set_the_agents_mmap_switch() -> None:
    assert dens.MODES == {"stock": {"mmap_restore": "off"}, "mmap": {"mmap_restore": "auto"}}


def test_preflight_names_every_bad_option(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(
        ["bench", "density", "--criu-prefix", str(tmp_path), "--modes", "mmap,lazy",
         "--caches", "hot", "--prompts", "0"]
    )  # fmt: skip
    problems = "\n".join(dens.preflight(args))
    assert f"no CRIU at {tmp_path}/stock/criu" in problems
    assert f"no CRIU at {tmp_path}/patched/criu" in problems
    assert "--modes ['lazy']" in problems
    assert "--caches ['hot']" in problems
    assert f"--prompts must be 1-{len(dens.PROMPTS)}" in problems


def test_replica_argv_joins_the_memcg_first_then_its_own_namespaces() -> None:
    argv = dens.replica_argv(
        ["python", "-m", "agent", "--model", "/m"], Path("/cg/r0/cgroup.procs"),
        Path("/w/replicas/r0"), Path("/w/run"), Path("/w"), shm_size="2g",
    )  # fmt: skip
    # The outer shell writes its own pid into the memcg, then execs unshare: the whole
    # tree is charged to the replica from its first page.
    assert argv[:5] == ["sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh",
                        "/cg/r0/cgroup.procs"]  # fmt: skip
    unshare = argv[5 : argv.index("--") + 1]
    assert unshare == ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--mount", "--"]
    inner = argv[argv.index("--") + 3]
    assert inner.startswith("ip link set lo up && ")
    assert 'mount --bind "$1" "$2"' in inner
    assert "mount -t tmpfs -o size=2g,mode=1777 shm /dev/shm" in inner
    assert inner.endswith('cd "$3" && shift 3 && exec "$@"')
    rest = argv[argv.index("--") + 4 :]
    assert rest == [
        "sh",
        "/w/replicas/r0",
        "/w/run",
        "/w",
        "python",
        "-m",
        "agent",
        "--model",
        "/m",
    ]


MEMINFO = """MemTotal:       24000000 kB
MemFree:         9000000 kB
MemAvailable:   20000000 kB
Cached:          8000000 kB
AnonPages:       1000000 kB
Shmem:             50000 kB
"""
ZONEINFO = """Node 0, zone   Normal
  pagesets
    cpu: 0
              count: 100
              high:  500
    cpu: 1
              count: 28
"""


def test_node_memory_counts_the_per_cpu_free_lists_as_free() -> None:
    m = dens.node_memory(MEMINFO, ZONEINFO, page_kb=4)
    assert m == {
        "used": 4000000,
        "used_pcp": 4000000 - 128 * 4,
        "pcp_free": 512,
        "AnonPages": 1000000,
        "Cached": 8000000,
        "Shmem": 50000,
    }


def test_memcg_numbers_v1_and_v2_under_v1_names() -> None:
    v1 = "cache 4194304\nrss 2097152\nrss_huge 0\nshmem 1048576\nmapped_file 3145728\n"
    v1 += "total_cache 99999999\n"
    assert dens.memcg_numbers(v1, 1, usage=7 << 20, peak=9 << 20) == {
        "rss": 2048, "cache": 4096, "mapped_file": 3072, "shmem": 1024,
        "usage": 7168, "peak": 9216,
    }  # fmt: skip
    v2 = "anon 2097152\nfile 4194304\nkernel 1\nfile_mapped 3145728\nshmem 1048576\n"
    assert dens.memcg_numbers(v2, 2, usage=1 << 20, peak=2 << 20) == {
        "rss": 2048, "cache": 4096, "mapped_file": 3072, "shmem": 1024,
        "usage": 1024, "peak": 2048,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"memory.stat \(cgroup v2\) lacks \['file_mapped'\]"):
        dens.memcg_numbers("anon 1\nfile 1\nshmem 1\n", 2, 0, 0)


def test_sum_rollups_adds_every_process_of_a_tree() -> None:
    a = {"Rss": 10, "Pss": 8, "Pss_Anon": 5, "Pss_File": 2, "Pss_Shmem": 1}
    b = {"Rss": 4, "Pss": 3, "Pss_Anon": 1, "Pss_File": 2}  # an older kernel's missing field
    assert dens.sum_rollups([a, b]) == {
        "Rss": 14, "Pss": 11, "Pss_Anon": 6, "Pss_File": 4, "Pss_Shmem": 1,
    }  # fmt: skip
    rollup = "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss: 100 kB\nPss: 60 kB\nPss_Anon: 40 kB\n"
    assert dens.kb_fields(rollup) == {"Rss": 100, "Pss": 60, "Pss_Anon": 40}


def _replica(pss: int, anon: int, file: int, shm: int, usage: int, rss: int) -> dict[str, Any]:
    return {
        "smaps_kb": {"Rss": pss, "Pss": pss, "Pss_Anon": anon, "Pss_File": file, "Pss_Shmem": shm},
        "memcg_kb": {"rss": rss, "cache": usage - rss, "mapped_file": 0, "shmem": shm,
                     "usage": usage, "peak": usage + 1},
    }  # fmt: skip


def _group(mode: str, n: int, trial: int, pss: int, usages: list[int]) -> dict[str, Any]:
    reps = [_replica(pss, pss // 2, pss // 2, 0, u, u // 2) for u in usages]
    delta = {k: 10 * (trial + 1) for k in dens.MEMINFO_KEYS}
    return {
        "mode": mode, "cache": "cold", "replicas": n, "trial": trial,
        "residency_before_percent": 0.5 + trial,
        "ready_s": [1.0 + trial] * n,
        "per_replica": [{"ready": r, "workload": r} for r in reps],
        "node_delta_kb": {"ready": delta, "workload": delta},
    }  # fmt: skip


def test_summarize_takes_medians_over_trials_and_spreads_over_replicas() -> None:
    groups = [
        _group("stock", 2, 0, 1000, [1000, 1000]),
        _group("mmap", 2, 0, 400, [900, 100]),
        _group("stock", 2, 1, 1200, [1200, 1200]),
        _group("mmap", 2, 1, 600, [700, 300]),
        _group("mmap", 2, 2, 500, [800, 200]),
    ]
    s = dens.summarize(groups)
    assert sorted(s) == ["cold/mmap/2", "cold/stock/2"]
    mmap = s["cold/mmap/2"]
    assert (mmap["trials"], mmap["replicas"], mmap["mode"]) == (3, 2, "mmap")
    w = mmap["workload"]
    assert w["pss_per_replica_Pss_kb"] == {"median": 500, "min": 400, "max": 600,
                                           "values": [400, 600, 500]}  # fmt: skip
    assert w["pss_total_Pss_kb"]["values"] == [800, 1200, 1000]
    # memcg: the mean over the replicas, and who paid most and least (first toucher).
    assert w["memcg_usage_kb"]["values"] == [500, 500, 500]
    assert w["memcg_usage_kb_max"]["values"] == [900, 700, 800]
    assert w["memcg_usage_kb_min"]["values"] == [100, 300, 200]
    assert w["node_delta_used_pcp_kb"]["values"] == [10, 20, 30]
    assert mmap["ready_s"]["values"] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert mmap["residency_before_percent"]["median"] == 1.5
    # Against stock's median PSS total at the same N: 1000 / 2200.
    assert w["pss_total_vs_stock"] == pytest.approx(1000 / 2200)
    assert "pss_total_vs_stock" in s["cold/stock/2"]["workload"]
    assert s["cold/stock/2"]["workload"]["pss_total_vs_stock"] == 1.0


def test_table_rows_put_stock_first_and_show_the_memcg_spread() -> None:
    s = dens.summarize(
        [_group("mmap", 2, 0, 2048, [3072, 1024]), _group("stock", 2, 0, 4096, [4096, 4096])]
    )
    text = dens.table(s, "workload")
    lines = text.splitlines()
    assert lines[0].startswith("| cache | replicas | restore | checkpoint in page cache before (%)")
    assert lines[2].startswith("| cold | 2 | stock CRIU (copy) | 0.5 | 4: 2 + 2 + 0 | 8 | 100% |")
    assert lines[3].startswith("| cold | 2 | `--mmap-restore` | 0.5 | 2: 1 + 1 + 0 | 4 | 50% |")
    assert "| 2: 1 + 1 | 0, 0 | 1-3 | 3 |" in lines[3]  # usage mean: rss + cache; min-max; peak


def test_markdown_says_what_was_measured_and_where() -> None:
    s = dens.summarize([_group("mmap", 1, 0, 2048, [2048]), _group("stock", 1, 0, 4096, [4096])])
    doc = {
        "command": "rekindle-dev bench density ...", "commit": "abc", "dirty": False,
        "date": "2026-11-25T00:00:00Z",
        "host": {"node": "vm", "cpus": 2, "load_avg_at_start": [1.0, 1.0, 1.0],
                 "load_avg_at_end": [2.0, 1.0, 1.0]},
        "meta": {"checkpoint_bytes": 2 << 30, "trials": 1, "prompts": ["a", "b"],
                 "max_tokens": 8, "cgroup_version": 1},
        "boot": {"smaps_kb": {"Pss": 2048, "Pss_Anon": 1024, "Pss_File": 1024, "Pss_Shmem": 0},
                 "memcg_kb": {"usage": 4096, "rss": 1024, "cache": 3072, "peak": 5120}},
        "summary": s,
    }  # fmt: skip
    text = dens.markdown(doc)
    assert "one checkpoint of 2.00 GiB" in text
    assert "every replica answers 2 different prompts, 8 tokens each" in text
    assert "## After the workload" in text and "## Right after Ready" in text
    assert "booted, no restore" in text and "its memcg 4 MiB (1 rss + 3 cache), peak 5 MiB" in text
    assert "Commit: abc. Date: 2026-11-25T00:00:00Z" in text
    assert "at start 1.00, 1.00, 1.00, at end 2.00, 1.00, 1.00" in text
    assert "docs/memory.md" in text


def test_memcg_root_fails_naming_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dens, "CGROUP_ROOT", tmp_path)
    with pytest.raises(RuntimeError, match="no memory cgroup controller"):
        dens.memcg_root()
    (tmp_path / "cgroup.subtree_control").write_text("cpu io memory pids\n")
    assert dens.memcg_root() == (tmp_path, 2)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.stat").write_text("cache 0\n")
    assert dens.memcg_root() == (tmp_path / "memory", 1)


# -- scripts/bench-criu ---------------------------------------------------------------


def test_bench_criu_parses_the_churn_mix() -> None:
    bc = bench_criu()
    assert bc.parse_churn("70,20,10") == {"read": 70, "rewrite": 20, "free": 10}
    assert bc.parse_churn("100,0,0") == {"read": 100, "rewrite": 0, "free": 0}
    for bad in ("70,20", "70,20,11", "80,20,10", "a,b,c", "110,-5,-5"):
        with pytest.raises(ValueError, match="--churn"):
            bc.parse_churn(bad)


def test_bench_criu_reads_the_holders_answer() -> None:
    bc = bench_criu()
    assert bc.parse_done("1795647047123543692 0 16384 6144 3072\n") == {
        "stamp_ns": 1795647047123543692, "bad": 0, "read": 16384, "written": 6144,
        "fresh": 3072,
    }  # fmt: skip


def test_bench_criu_alternates_which_criu_goes_first() -> None:
    bc = bench_criu()
    flavors = {"stock": 1, "patched": 2}
    assert bc.flavor_order(flavors, 0) == ["stock", "patched"]
    assert bc.flavor_order(flavors, 1) == ["patched", "stock"]


def _row(size: float, cache: str, flavor: str, op: str, done: list[float]) -> dict[str, Any]:
    bc = bench_criu()
    restore = [0.05 if flavor == "patched" else d for d in done]
    trials = [{"op": op, "restore_s": r, "done_s": d} for r, d in zip(restore, done, strict=True)]
    return {
        "size_gib": size, "cache": cache, "flavor": flavor, "op": op, "trials": trials,
        "restore_s": bc.summarize(restore), "done_s": bc.summarize(done),
    }  # fmt: skip


def test_bench_criu_ratios_are_paired_per_trial() -> None:
    bc = bench_criu()
    stock = _row(1, "warm", "stock", "read", [1.0, 2.0, 3.0])
    patched = _row(1, "warm", "patched", "read", [0.5, 0.5, 1.0])
    assert bc.paired_ratios(stock, patched, "done_s") == [2.0, 4.0, 3.0]
    assert bc.summarize([1.0, 3.0, 2.0]) == {
        "median": 2.0, "min": 1.0, "max": 3.0, "stdev": 1.0, "values": [1.0, 3.0, 2.0],
    }  # fmt: skip


def test_bench_criu_table_leads_with_like_for_like_and_labels_restore_returned() -> None:
    bc = bench_criu()
    results = [
        _row(2, "warm", "stock", "read", [1.0, 2.0, 3.0]),
        _row(2, "warm", "patched", "read", [0.5, 0.5, 1.0]),
        _row(2, "warm", "stock", "write", [1.0, 1.0, 1.0]),
        _row(2, "warm", "patched", "write", [2.0, 2.0, 2.0]),
    ]
    doc = {"meta": {"trials": 3, "churn": {"read": 70, "rewrite": 20, "free": 10}},
           "command": "scripts/bench-criu", "commit": "abc", "host": {"node": "vm"}}  # fmt: skip
    text = bc.timing_markdown(results, doc)
    head = next(line for line in text.splitlines() if line.startswith("| size | cache"))
    assert head.startswith(
        "| size | cache | all read: stock (s) | `--mmap-restore` (s) | stock ÷ mmap "
        "| all written: stock (s) |"
    )
    assert "| 2 GiB | warm | 2.000 (1.000–3.000) | 0.500 (0.500–1.000) | 3.0x (2.0–4.0) " in text
    assert "| 1.000 (1.000–1.000) | 2.000 (2.000–2.000) | 0.5x (0.5–0.5) |" in text
    assert "## Restore returned (no page read yet with mmap)" in text
    assert text.index("all read") < text.index("## Restore returned")
    # Pooled over both workloads: stock's restores 1, 2, 3, 1, 1, 1; patched's all 0.05.
    assert "| 2 GiB | warm | 1.000 (1.000–3.000) | 0.050 (0.050–0.050) | 20.0x |" in text
    assert "70 % only read, 20 % read and rewritten, 10 % freed" in text


def test_bench_criu_provenance_has_the_common_keys(tmp_path: Path) -> None:
    bc = bench_criu()
    assert bench_common.MEASURED_ALWAYS == bc.MEASURED_ALWAYS
    common = bench_common.provenance("cmd", bc.MEASURED, (1.0, 2.0, 3.0), 0.0, str(tmp_path))
    own = bc.own_provenance("cmd", bc.MEASURED, (1.0, 2.0, 3.0), 0.0, str(tmp_path))
    assert own.keys() == common.keys()
    assert own["host"].keys() == common["host"].keys()
    for key in ("commit", "dirty", "date", "command", "measured_paths"):
        assert own[key] == common[key], key
    assert "scripts/bench-criu" in own["measured_paths"]
    assert own["host"]["load_avg_at_start"] == [1.0, 2.0, 3.0]
