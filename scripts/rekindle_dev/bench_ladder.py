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
vLLM log. The weight reload's rate is the weight dump's bytes over the reload
proper (reading or mapping the dump); the CPU GEMM repack that follows it
inside reload_weights is its own column.
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

from rekindle_agent.mapped_files.immutable import remove_tree
from rekindle_contract.manifest import WEIGHTS_SUBDIR

from rekindle_dev import plain_criu
from rekindle_dev.bench_common import provenance
from rekindle_dev.bench_local import (
    RESTORE_PHASES,
    data_paths,
    log,
    make_checkpoint,
    one_run,
    per_trial_ratios,
    percent_cell,
    plain_run,
    prepare_cache,
    rotated,
    runtime_paths,
    summarize,
)
from rekindle_dev.bench_weights import read_file_gbps
from rekindle_dev.harness import AgentFactory
from rekindle_dev.ladder import SIZES, generate_ladder_model, param_count, spec_for
from rekindle_dev.ports import free_port

RESTORE = "patched-signed"  # bench_local's variant: mmap restore, prefetch, signed + BLAKE3
PLAIN = "plain-criu"  # stock CRIU over the whole server (rekindle_dev.plain_criu)
VARIANTS = ("naive", PLAIN, RESTORE)


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


def reload_read_seconds(phases: Mapping[str, float]) -> float | None:
    """The reload proper: reading or mapping the dump (reload_weights.read), without the
    CPU GEMM repack that follows it; the whole reload_weights where a run has no split."""
    if "reload_weights.read" in phases:
        return phases["reload_weights.read"]
    return phases.get("reload_weights")


def summarize_size(runs: list[dict[str, Any]], weights_bytes: int) -> dict[str, Any]:
    """bench_local's summary per (variant, cache), plus the reload's rate: the weight dump's
    bytes over the reload proper (reload_read_seconds), alone and plus the wait for the
    dump's check (weights_check_wait: its BLAKE3, which the reload waits for), and the
    CPU GEMM repack after it (reload_weights.repack)."""
    out: dict[str, Any] = summarize(runs)
    for key, s in out.items():
        variant, _, cache = key.partition("/")
        rs = [r for r in runs if r["variant"] == variant and r["cache"] == cache]
        pairs = [
            (t, r["phases"].get("weights_check_wait", 0.0))
            for r in rs
            if (t := reload_read_seconds(r["phases"])) is not None
        ]
        if pairs:
            s["reload_seconds_median"] = statistics.median(t for t, _ in pairs)
            s["reload_gb_per_s_median"] = statistics.median(
                weights_bytes / t / 1e9 for t, _ in pairs
            )
            s["reload_checked_gb_per_s_median"] = statistics.median(
                weights_bytes / (t + w) / 1e9 for t, w in pairs
            )
        repack = [
            r["phases"]["reload_weights.repack"]
            for r in rs
            if "reload_weights.repack" in r["phases"]
        ]
        if repack:
            s["repack_seconds_median"] = statistics.median(repack)
        if "speedup_vs_naive" in s:
            s["fraction_of_naive"] = 1.0 / s["speedup_vs_naive"]
            s["fraction_per_trial"] = [
                round(1.0 / x, 3) for x in per_trial_ratios(runs, variant, cache)
            ]
    return out


def bench_size(
    size: str, args: argparse.Namespace, criu: dict[str, Path], key_file: Path
) -> dict[str, Any]:
    """Checkpoint one ladder model (and dump it whole for plain-criu), then the
    interleaved trials, every arm warmed or dropped alike (bench_local.prepare_cache)."""
    spec = spec_for(size)
    model = generate_ladder_model(size, progress=lambda m: log(m))
    work = Path(args.work) / size
    work.mkdir(parents=True, exist_ok=True)
    factory = AgentFactory(work, model, criu[RESTORE])
    ckpt = factory.checkpoints / f"ladder-{size}-{int(time.time())}"
    log(f"{size}: booting once to make the checkpoint (signed)")
    man = make_checkpoint(factory, ckpt, key_file, 1)
    sizes = checkpoint_sizes(man["files"])
    log(f"{size}: checkpoint {sizes['total'] / 2**30:.2f} GiB ({sizes})")
    order = [v for v in args.variants.split(",") if v]
    plain = None
    plain_bytes = None
    runs: list[dict[str, Any]] = []
    reads: list[dict[str, float]] = []
    runtime = runtime_paths()
    try:
        if PLAIN in order:
            log(f"{size}: booting vLLM plainly and dumping the whole server with stock CRIU")
            plain = plain_criu.dump_whole_server(
                criu[PLAIN], model, factory.served_name, free_port(), work / "plain"
            )
            plain_bytes = plain.bytes()
        for trial in range(args.trials):
            for cache in ("warm", "cold"):
                for variant in rotated(order, trial):
                    data = data_paths(variant, model, ckpt, plain)
                    before = prepare_cache(cache, runtime, data)
                    if variant == PLAIN:
                        assert plain is not None
                        r = plain_run(criu[PLAIN], plain, work / "plain")
                    else:
                        name = f"{variant}-{cache}-{trial}"
                        r = one_run(factory, variant, ckpt, criu, name, key_file)
                    r.update(cache=cache, trial=trial, cache_before=before)
                    runs.append(r)
                    log(
                        f"{size} trial {trial} {variant:14s} {cache}: first token "
                        f"{r['ttft']:.2f}s (page cache before: data "
                        f"{before['data']['percent']:.1f}%, runtime "
                        f"{before['runtime']['percent']:.1f}%)"
                    )
            reads.append(best_read(ckpt / WEIGHTS_SUBDIR / "weights-rank0.bin"))
            log(f"{size} trial {trial} page-cache read of the dump: {reads[-1]['best']:.2f} GB/s")
    finally:
        remove_tree(ckpt)  # its pages images are immutable once proven: rm -rf cannot
        if plain is not None:
            remove_tree(work / "plain")
    return {
        "size": size,
        "architecture": spec.architecture,
        "shape_of": spec.name,
        "params": param_count(spec),
        "model_dir": str(model),
        "checkpoint_bytes": sizes,
        "plain_criu_image_bytes": plain_bytes,
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
            s["reload_checked_vs_best_read"] = s["reload_checked_gb_per_s_median"] / best
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


def reload_cell(r: dict[str, Any], cache: str) -> str:
    """Reload GB/s alone / with the wait for its check; a cold row says where the bytes
    came from: the prefetch had read the dump into the page cache before the reload."""
    if "reload_gb_per_s_median" not in r:
        return "-"
    cell = f"{r['reload_gb_per_s_median']:.2f} / {r['reload_checked_gb_per_s_median']:.2f}"
    cell += " (page cache: prefetched)" if cache == "cold" else ""
    if "repack_seconds_median" in r:
        cell += f"; then CPU GEMM repack {r['repack_seconds_median']:.2f} s"
    return cell


def trials_cell(r: dict[str, Any] | None) -> str:
    """median (per-trial values) of a row's first token."""
    if not r:
        return "-"
    per = ", ".join(f"{t:.2f}" for t in r.get("ttft_trials", []))
    return f"{r['ttft_median']:.2f} ({per})"


def fraction_cell(r: dict[str, Any]) -> str:
    per = ", ".join(f"1/{1 / f:.1f}" for f in r.get("fraction_per_trial", []))
    return f"1/{r['speedup_vs_naive']:.1f}" + (f" ({per})" if per else "")


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| size | params | checkpoint (GiB) | weights (GiB) | cache | naive (s) | plain CRIU (s) "
        "| restore (s) | restore / naive | reload GB/s (alone / with its check) "
        "| ÷ best page-cache read (alone / with its check) "
        "| page cache before: data, runtime (%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        s, cb = res["summary"], res["checkpoint_bytes"]
        for cache in ("warm", "cold"):
            n, r = s.get(f"naive/{cache}"), s.get(f"{RESTORE}/{cache}")
            if not (n and r):
                continue
            resid = "; ".join(
                f"{name} {percent_cell(row.get('residency_before_percent'))}, "
                f"{percent_cell(row.get('runtime_residency_percent'))}"
                for name, row in (("naive", n), ("restore", r))
            )
            lines.append(
                f"| {res['size']} | {res['params'] / 1e9:.2f}B | {cb['total'] / 2**30:.2f} "
                f"| {cb['weights'] / 2**30:.2f} | {cache} | {trials_cell(n)} "
                f"| {trials_cell(s.get(f'{PLAIN}/{cache}'))} | {trials_cell(r)} "
                f"| {fraction_cell(r)} | {reload_cell(r, cache)} | {vs_read_cell(r)} | {resid} |"
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
        f"--variants {args.variants} --trials {args.trials} --work {args.work} --out {args.out}"
    )


MEASURED = (
    "scripts/rekindle_dev/bench_ladder.py",
    "scripts/rekindle_dev/bench_local.py",
    "scripts/rekindle_dev/plain_criu.py",
    "scripts/rekindle_dev/ladder.py",
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
    prefix = Path(args.criu_prefix)
    criu = {RESTORE: prefix / "patched" / "criu", PLAIN: prefix / "stock" / "criu"}
    for path in criu.values():
        if not args.criu_prefix or not os.access(path, os.X_OK):
            print(
                f"no CRIU at {path}: pass scripts/build-criu's output as --criu-prefix",
                file=sys.stderr,
            )
            return 2
    order = [v for v in args.variants.split(",") if v]
    if "naive" not in order or any(v not in VARIANTS for v in order):
        print(f"--variants: naive and any of {', '.join(VARIANTS[1:])}", file=sys.stderr)
        return 2
    sizes = [s for s in args.sizes.split(",") if s]
    if not sizes:
        print(f"--sizes: name at least one of {', '.join(SIZES)}", file=sys.stderr)
        return 2
    for s in sizes:
        spec_for(s)  # an unknown size fails before anything runs
    load_start, started = os.getloadavg(), time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    key_file = work / "signing-key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    key_file.chmod(0o600)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    text = ""
    for size in sizes:
        results.append(bench_size(size, args, criu, key_file))
        doc = {
            **provenance(command_line(args), MEASURED, load_start, started, scratch=str(work)),
            "variants": {
                "naive": "restore_policy never",
                PLAIN: "stock CRIU of the whole server, no agent (rekindle_dev.plain_criu)",
                RESTORE: "mmap auto, prefetch, signed",
            },
            "results": results,
        }
        (out / "results.json").write_text(json.dumps(doc, indent=2))  # after every size
        text = render(out, doc)
    print(text)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--criu-prefix", default="", help="scripts/build-criu's output directory")
    p.add_argument(
        "--sizes", default="0.5b,1.5b,3b", help=f"comma-separated, of {', '.join(SIZES)}"
    )
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"naive first; of {', '.join(VARIANTS)}"
    )
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--work", default="/var/tmp/rekindle-bench-ladder", help="scratch (on disk)")
    p.add_argument("--out", default="docs/bench/ladder")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
