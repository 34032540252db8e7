"""`rekindle-dev bench ladder`: naive boot vs restore at 0.5B, 1.5B and 3B parameters.

For each size of the ladder (rekindle_dev.ladder: real architectures, random
bf16 weights) in one run: the model is generated (cached), one agent boots it
and makes a signed checkpoint, then trials interleave a naive boot and a
restore (patched CRIU, prefetch, the signature and BLAKE3 of every file
checked: the restore users get), each with a warm page cache (the checkpoint
read once just before, untimed) and a cold one
(`echo 3 > /proc/sys/vm/drop_caches`). Every run is the real agent as PID 1 of
a fresh PID+mount namespace (rekindle_dev.harness), timed from launch to the
answer of a one-token completion through the agent's proxy, with the agent's
own phase timings (bench_local.one_run), the checkpoint's page-cache
residency just before each restore and each naive boot's split from its own
vLLM log. The weight reload's rate is the weight dump's bytes over the agent's
reload_weights phase.
Results: docs/bench/ladder/results.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rekindle_agent.immutable import remove_tree
from rekindle_contract.manifest import WEIGHTS_SUBDIR

from rekindle_dev.bench_common import host_facts, residency_cell
from rekindle_dev.bench_local import RESTORE_PHASES, drop_caches, log, one_run, summarize
from rekindle_dev.bench_weights import read_file_gbps
from rekindle_dev.harness import AgentFactory
from rekindle_dev.ladder import SIZES, generate_ladder_model, param_count, spec_for

RESTORE = "patched-signed"  # bench_local's variant: mmap restore, prefetch, signed + BLAKE3
VARIANTS = ("naive", RESTORE)


def checkpoint_sizes(files: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Bytes of the checkpoint's files: all, CRIU images, the weight dump, the /dev/shm copies."""
    out = {"total": 0, "images": 0, "weights": 0, "shm": 0}
    for f in files:
        size = int(f["size"])
        out["total"] += size
        top = str(f["path"]).split("/", 1)[0]
        if top in out:
            out[top] += size
    return out


def summarize_size(runs: list[dict[str, Any]], weights_bytes: int) -> dict[str, Any]:
    """Medians per (variant, cache); restore/naive ratios and the reload rate."""
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        for cache in ("warm", "cold"):
            rs = [r for r in runs if r["variant"] == variant and r["cache"] == cache]
            if not rs:
                continue
            ttfts = [r["ttft"] for r in rs]
            names = list(dict.fromkeys(p for r in rs for p in r["phases"]))
            s: dict[str, Any] = {
                "trials": len(rs),
                "ttft_median": statistics.median(ttfts),
                "ttft_min": min(ttfts),
                "ttft_max": max(ttfts),
                "phases_median": {
                    p: statistics.median(r["phases"].get(p, 0.0) for r in rs) for p in names
                },
                "mmap": any(r["mmap"] for r in rs),
            }
            # Residency before the restores, the naive boots' own vLLM split: bench_local's.
            local = summarize(rs)[f"{variant}/{cache}"]
            for k in ("residency_before_percent", "vllm_split_median", "vllm_split_trials"):
                if k in local:
                    s[k] = local[k]
            reload = [r["phases"]["reload_weights"] for r in rs if "reload_weights" in r["phases"]]
            if reload:
                s["reload_seconds_median"] = statistics.median(reload)
                s["reload_gb_per_s_median"] = statistics.median(
                    weights_bytes / t / 1e9 for t in reload
                )
            out[f"{variant}/{cache}"] = s
    for cache in ("warm", "cold"):
        naive, restore = out.get(f"naive/{cache}"), out.get(f"{RESTORE}/{cache}")
        if naive and restore:
            restore["fraction_of_naive"] = restore["ttft_median"] / naive["ttft_median"]
            restore["speedup_vs_naive"] = naive["ttft_median"] / restore["ttft_median"]
    return out


def bench_size(size: str, args: argparse.Namespace, criu: Path, key_file: Path) -> dict[str, Any]:
    """Checkpoint one ladder model, then the interleaved trials; this size's results."""
    spec = spec_for(size)
    model = generate_ladder_model(size, progress=lambda m: log(m))
    work = Path(args.work) / size
    work.mkdir(parents=True, exist_ok=True)
    factory = AgentFactory(work, model, criu)
    ckpt = factory.checkpoints / f"ladder-{size}-{int(time.time())}"
    log(f"{size}: booting once to make the checkpoint (signed)")
    agent = factory.start(name="make-checkpoint", signing_key_file=str(key_file))
    try:
        boot = agent.wait_ready(1800)
        man = agent.client.checkpoint(str(ckpt), timeout=1800)
    finally:
        agent.stop()
    sizes = checkpoint_sizes(man["files"])
    log(f"{size}: checkpoint {sizes['total'] / 2**30:.2f} GiB ({sizes})")
    runs: list[dict[str, Any]] = []
    reads: list[dict[str, float]] = []
    criu_for = {RESTORE: criu}
    try:
        for trial in range(args.trials):
            for cache in ("warm", "cold"):
                for variant in VARIANTS:
                    if cache == "cold":
                        drop_caches()
                    name = f"{variant}-{cache}-{trial}"
                    r = one_run(
                        factory, variant, ckpt, criu_for, name, key_file, warm=cache == "warm"
                    )
                    r.update(cache=cache, trial=trial, load_avg=os.getloadavg())
                    runs.append(r)
                    log(f"{size} trial {trial} {variant:14s} {cache}: first token {r['ttft']:.2f}s")
            reads.append(best_read(ckpt / WEIGHTS_SUBDIR / "weights-rank0.bin"))
            log(f"{size} trial {trial} page-cache read of the dump: {reads[-1]['best']:.2f} GB/s")
    finally:
        remove_tree(ckpt)  # its pages images are immutable once proven: rm -rf cannot
    return {
        "size": size,
        "architecture": spec.architecture,
        "shape_of": spec.name,
        "params": param_count(spec),
        "model_dir": str(model),
        "first_boot_timings": boot.timings.get("boot", {}),
        "checkpoint_bytes": sizes,
        "checkpoint_timings": man["timings"],
        "summary": with_read_baseline(summarize_size(runs, sizes["weights"]), reads),
        "runs": runs,
        "weights_read_gbps": reads,
    }


def best_read(path: Path) -> dict[str, float]:
    """The reload's baseline, same run: the best page-cache read of the dump (1 and 2
    threads, after one read that makes it resident), GB/s."""
    read_file_gbps(path, 2)
    one, two = read_file_gbps(path, 1), read_file_gbps(path, 2)
    return {"threads_1": one, "threads_2": two, "best": max(one, two)}


def with_read_baseline(summary: dict[str, Any], reads: list[dict[str, float]]) -> dict[str, Any]:
    """Each restore's reload rate against the median best page-cache read, twice: the
    reload alone, and with the dump's check (weights_check_wait) it waited for first."""
    if not reads:
        return summary
    best = statistics.median(r["best"] for r in reads)
    spread = (min(r["best"] for r in reads), max(r["best"] for r in reads))
    for key, s in summary.items():
        s["read_best_gbps_median"] = best
        s["read_best_gbps_range"] = spread
        if s.get("reload_gb_per_s_median") and key.startswith(RESTORE):
            s["reload_vs_best_read"] = s["reload_gb_per_s_median"] / best
            wait = s["phases_median"].get("weights_check_wait", 0.0)
            secs = s["reload_seconds_median"] + wait
            s["reload_checked_vs_best_read"] = (
                s["reload_gb_per_s_median"] * (s["reload_seconds_median"] / secs) / best
            )
    return summary


def vs_read_cell(r: dict[str, Any]) -> str:
    """The reload against the same run's best page-cache read ("-" where not recorded)."""
    if "reload_vs_best_read" not in r:
        return "-"
    lo, hi = r["read_best_gbps_range"]
    return (
        f"{r['reload_vs_best_read']:.2f} / {r['reload_checked_vs_best_read']:.2f} "
        f"(read {r['read_best_gbps_median']:.2f} GB/s, {lo:.2f}-{hi:.2f})"
    )


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| size | params | checkpoint (GiB) | weights (GiB) | cache | naive (s) | restore (s) "
        "| restore / naive | reload (s) | reload GB/s | ÷ best page-cache read "
        "(reload / with its check) | page cache before restore (%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        s, cb = res["summary"], res["checkpoint_bytes"]
        for cache in ("warm", "cold"):
            n, r = s.get(f"naive/{cache}"), s.get(f"{RESTORE}/{cache}")
            if not (n and r):
                continue
            lines.append(
                f"| {res['size']} | {res['params'] / 1e9:.2f}B | {cb['total'] / 2**30:.2f} "
                f"| {cb['weights'] / 2**30:.2f} | {cache} "
                f"| {n['ttft_median']:.2f} ({n['ttft_min']:.2f}-{n['ttft_max']:.2f}) "
                f"| {r['ttft_median']:.2f} ({r['ttft_min']:.2f}-{r['ttft_max']:.2f}) "
                f"| 1/{r['speedup_vs_naive']:.1f} | {r.get('reload_seconds_median', 0):.2f} "
                f"| {r.get('reload_gb_per_s_median', 0):.2f} | {vs_read_cell(r)} "
                f"| {residency_cell({'variant': RESTORE, **r})} |"
            )
    lines += ["", "Median restore phases (s):", ""]
    for res in results:
        for cache in ("warm", "cold"):
            r = res["summary"].get(f"{RESTORE}/{cache}")
            if r:
                parts = ", ".join(f"{k} {v:.3f}" for k, v in r["phases_median"].items())
                lines.append(f"- {res['size']} {cache}: {parts}")
    splits = [
        f"- {res['size']} {cache} (median of {n['vllm_split_trials']}): "
        + ", ".join(f"{k} {v:.2f}" for k, v in n["vllm_split_median"].items())
        for res in results
        for cache in ("warm", "cold")
        if (n := res["summary"].get(f"naive/{cache}")) and n.get("vllm_split_median")
    ]
    if splits:
        lines += ["", "Naive boot split from each boot's own vLLM log (this run, s):", "", *splits]
    lines += ["", "Checkpoint phases (s, the agent's own timings):", ""]
    for res in results:
        parts = ", ".join(
            f"{k} {float(v):.2f}"
            for k, v in res["checkpoint_timings"].items()
            if isinstance(v, int | float)
        )
        lines.append(f"- {res['size']}: {parts}")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    keys = [(res["size"], cache) for res in results for cache in ("warm", "cold")]
    labels = [f"{s}\n{c}" for s, c in keys]
    by = {res["size"]: res["summary"] for res in results}
    x = range(len(keys))
    for off, variant, color in ((-0.2, "naive", "tab:gray"), (0.2, RESTORE, "tab:blue")):
        meds = [by[s].get(f"{variant}/{c}", {}).get("ttft_median", 0.0) for s, c in keys]
        ax1.bar([i + off for i in x], meds, width=0.4, color=color, label=variant)
    ax1.set_xticks(list(x), labels)
    ax1.set_ylabel("seconds, launch to first token (median)")
    ax1.set_title("naive boot vs restore")
    ax1.legend()
    phases = [p for p in ("agent_start", *RESTORE_PHASES, "first_request")]
    cmap = plt.get_cmap("tab20")
    bottom = [0.0] * len(keys)
    for i, ph in enumerate(phases):
        vals = [
            by[s].get(f"{RESTORE}/{c}", {}).get("phases_median", {}).get(ph, 0.0) for s, c in keys
        ]
        ax2.bar(labels, vals, bottom=bottom, color=cmap(i % 20), label=ph)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set_title("restore phases (median)")
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("rekindle-dev bench ladder (vLLM CPU, random-weight models of real shapes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(out: Path, doc: dict[str, Any]) -> str:
    text = f"Command: `{doc['command']}`\n\n" + table(doc["results"])
    (out / "results.md").write_text(text)
    plot(doc["results"], out / "results.png")
    return text


def command_line(args: argparse.Namespace) -> str:
    return (
        f"rekindle-dev bench ladder --criu-prefix {args.criu_prefix} --sizes {args.sizes} "
        f"--trials {args.trials} --work {args.work} --out {args.out}"
    )


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.replot:
        print(render(out, json.loads((out / "results.json").read_text())))
        return 0
    if os.geteuid() != 0:
        print(
            "rekindle-dev bench ladder: needs root (CRIU, namespaces, drop_caches)", file=sys.stderr
        )
        return 2
    criu = Path(args.criu_prefix) / "patched" / "criu"
    if not args.criu_prefix or not os.access(criu, os.X_OK):
        print(
            f"no CRIU at {criu}: pass scripts/build-criu's output as --criu-prefix", file=sys.stderr
        )
        return 2
    sizes = [s for s in args.sizes.split(",") if s]
    if not sizes:
        print(f"--sizes: name at least one of {', '.join(SIZES)}", file=sys.stderr)
        return 2
    for s in sizes:
        spec_for(s)  # an unknown size fails before anything runs
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    key_file = work / "signing-key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    key_file.chmod(0o600)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "command": command_line(args),
        "host": host_facts(load_avg_at_start=os.getloadavg()),
        "variants": {"naive": "restore_policy never", RESTORE: "mmap auto, prefetch, signed"},
        "results": [],
    }
    for size in sizes:
        doc["results"].append(bench_size(size, args, criu, key_file))
        doc["host"]["load_avg_at_end"] = os.getloadavg()
        (out / "results.json").write_text(json.dumps(doc, indent=2))  # after every size
        text = render(out, doc)
    print(text)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--criu-prefix", default="", help="scripts/build-criu's output directory")
    p.add_argument("--sizes", default="0.5b,1.5b", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--work", default="/var/tmp/rekindle-bench-ladder", help="scratch (on disk)")
    p.add_argument("--out", default="docs/bench/ladder")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
