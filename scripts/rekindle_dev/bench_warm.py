"""`rekindle-dev bench warm`: warming a cold checkpoint, vmtouch -t vs the agent's prefetcher.

Every method starts from a dropped page cache (`echo 3 > /proc/sys/vm/drop_caches`)
and ends when the checkpoint's files are in it; the methods run interleaved, in
a rotated order per trial, so a load change hits all of them alike:
  prefetch         the agent's Prefetcher (rekindle_agent.restoring.prefetch), N threads,
                   reading only (verify "size")
  prefetch+blake3  the same read with the BLAKE3 check a restore runs on it
  vmtouch -t       one vmtouch touching every page (mmap, one byte a page)
  vmtouch -t xN    N vmtouch processes, the files dealt out by size
  mmap touch       vmtouch's way in Python: map each file (N threads), MADV_WILLNEED,
                   touch a byte a page: nothing is copied out of the page cache
  mmap+blake3      the restore's BLAKE3 check hashed straight from such a mapping
                   (no copy into a read buffer), to see whether the check gains too
Residency (rekindle_agent.restoring.residency) is measured before (proves the cache cold)
and after (proves it warm) each trial. The checkpoint is a real one (--dir, with
its manifest.json) or, by default, a synthetic tree of the same shape as the
tiny model's (small CRIU images, a few large pages-*.img, the weight dump).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rekindle_agent.restoring import prefetch, residency
from rekindle_contract.manifest import IMAGES_SUBDIR, FileEntry
from rekindle_store import digests, resident_lock

from rekindle_dev.bench_common import provenance
from rekindle_dev.bench_provenance import MEASURED_BY, provenance_line

MiB = 1 << 20
METHODS = (
    "prefetch",
    "prefetch+blake3",
    "vmtouch -t",
    "vmtouch -t xN",
    "mmap touch",
    "mmap+blake3",
)
# The synthetic checkpoint: (path, share of the total size); the rest is small images.
LAYOUT = (
    (f"{IMAGES_SUBDIR}/pages-1.img", 0.40),
    (f"{IMAGES_SUBDIR}/pages-2.img", 0.18),
    (f"{IMAGES_SUBDIR}/pages-3.img", 0.06),
    (f"{IMAGES_SUBDIR}/pages-4.img", 0.03),
    ("weights/weights.bin", 0.32),
)
SMALL_IMAGES = 40


def log(msg: str) -> None:
    print(f"[bench warm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _write(path: Path, size: int) -> str:
    """Random bytes (no file system can compress them); their BLAKE3."""
    path.parent.mkdir(parents=True, exist_ok=True)
    h = digests.new("blake3")
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(left, 8 * MiB))
            h.update(block)
            f.write(block)
            left -= len(block)
    return h.hexdigest()


def synthetic_checkpoint(root: Path, total: int) -> list[FileEntry]:
    """A checkpoint-shaped tree of about total bytes under root; its manifest entries."""
    files: list[FileEntry] = []
    small = [4096 * (1 + 8 * (i % 16)) for i in range(SMALL_IMAGES)]
    for i, size in enumerate(small):
        rel = f"{IMAGES_SUBDIR}/img-{i}.img"
        files.append({"path": rel, "size": size, "blake3": _write(root / rel, size)})
    for rel, share in LAYOUT:
        size = int(total * share) // 4096 * 4096
        files.append({"path": rel, "size": size, "blake3": _write(root / rel, size)})
    os.sync()
    return files


def manifest_files(root: Path) -> list[FileEntry]:
    """The files of a real checkpoint, from its manifest.json."""
    man = json.loads((root / "manifest.json").read_text())
    return list(man["files"])


def deal(files: list[FileEntry], n: int) -> list[list[str]]:
    """Split files into n groups of about equal bytes, largest first (each to the lightest)."""
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(max(1, n))]
    for f in sorted(files, key=lambda f: -int(f["size"])):
        k = min(range(len(groups)), key=lambda i: groups[i][0])
        groups[k] = (groups[k][0] + int(f["size"]), [*groups[k][1], f["path"]])
    return [g for _, g in groups if g]


def warm_prefetch(root: Path, files: list[FileEntry], threads: int, verify: str) -> None:
    res = prefetch.Prefetcher(root, files, threads, verify).result()
    if res.bad:
        raise RuntimeError(f"prefetch found bad files: {res.bad[:3]}")


def warm_vmtouch(binary: str, root: Path, groups: list[list[str]]) -> None:
    """vmtouch -t over each group, one process per group, all at once."""
    procs = [
        subprocess.Popen(
            [binary, "-t", "-q", *[str(root / p) for p in g]],
            stdout=subprocess.DEVNULL,
        )
        for g in groups
    ]
    bad = [p.args for p in procs if p.wait() != 0]
    if bad:
        raise RuntimeError(f"vmtouch failed: {bad[:1]}")


def _mmap_file(path: Path, check: bool) -> None:
    """Fault path's pages in through a read-only mapping; hash them from it when check."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        mm.madvise(mmap.MADV_WILLNEED)
        if check:
            h = digests.new("blake3")
            view = memoryview(mm)
            for off in range(0, size, prefetch.CHUNK):
                h.update(view[off : off + prefetch.CHUNK])
            view.release()
            return
        touched = 0  # one byte a page: the page fault is the point
        for off in range(0, size, mmap.PAGESIZE):
            touched += mm[off]


def warm_mmap(root: Path, files: list[FileEntry], threads: int, check: bool) -> None:
    """_mmap_file over files on threads, largest first (as the prefetcher orders them)."""
    order = sorted(files, key=lambda f: -int(f["size"]))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda f: _mmap_file(root / f["path"], check), order))


def methods(
    binary: str, root: Path, files: list[FileEntry], threads: int
) -> dict[str, Callable[[], None]]:
    whole = [[f["path"] for f in files]]
    return {
        "prefetch": lambda: warm_prefetch(root, files, threads, "size"),
        "prefetch+blake3": lambda: warm_prefetch(root, files, threads, "blake3"),
        "vmtouch -t": lambda: warm_vmtouch(binary, root, whole),
        "vmtouch -t xN": lambda: warm_vmtouch(binary, root, deal(files, threads)),
        "mmap touch": lambda: warm_mmap(root, files, threads, check=False),
        "mmap+blake3": lambda: warm_mmap(root, files, threads, check=True),
    }


def summarize(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """Per method: median/min/max seconds, GB/s at the median, ratio to the prefetcher."""
    out: dict[str, Any] = {}
    for m in dict.fromkeys(r["method"] for r in runs):
        secs = [r["seconds"] for r in runs if r["method"] == m]
        med = statistics.median(secs)
        out[m] = {
            "trials": len(secs),
            "median_s": med,
            "min_s": min(secs),
            "max_s": max(secs),
            "gbps": nbytes / med / 1e9,
            "resident_after_pct": min(r["after"]["percent"] for r in runs if r["method"] == m),
        }
    base = out.get("prefetch", {}).get("median_s")
    for s in out.values():
        if base:
            s["vs_prefetch"] = s["median_s"] / base
    return out


def verdict(summary: dict[str, Any]) -> str:
    """Which warms faster, and what the agent keeps, from the numbers of this run."""
    p = summary.get("prefetch")
    vms = [m for m in ("vmtouch -t", "vmtouch -t xN") if m in summary]
    if not p or not vms:
        return "not enough methods ran to compare"
    best = min(vms, key=lambda m: summary[m]["median_s"])
    v = summary[best]
    if v["median_s"] < p["median_s"]:
        out = (
            f"for warming alone {best} is faster: {v['median_s']:.2f} s vs the prefetcher's "
            f"{p['median_s']:.2f} s ({p['median_s'] / v['median_s']:.2f}x; it faults pages "
            "in through a mapping, copying nothing out of the page cache)"
        )
    else:
        out = (
            f"the prefetcher warms faster: {p['median_s']:.2f} s vs {best}'s {v['median_s']:.2f} s"
        )
    check, mcheck = summary.get("prefetch+blake3"), summary.get("mmap+blake3")
    if check:
        out += (
            ". But a restore must check every byte it uses (BLAKE3 against the manifest), "
            f"which vmtouch cannot: the prefetcher reads and checks in one pass in "
            f"{check['median_s']:.2f} s, and vmtouch in front of it would be a second pass "
            "over the same bytes on the same cores, so the agent keeps its prefetcher"
        )
        if mcheck and mcheck["median_s"] < check["median_s"]:
            out += (
                f". Hashing straight from a mapping (vmtouch's way in, plus the check) took "
                f"{mcheck['median_s']:.2f} s here: mapping instead of reading is the "
                "prefetcher's candidate, not vmtouch"
            )
        elif mcheck:
            out += (
                f"; hashing straight from a mapping instead took {mcheck['median_s']:.2f} s, "
                "slower than reading"
            )
        out += (
            ". vmtouch is used where it is the right tool: residency (mincore) and keeping "
            "a checkpoint locked (-l)"
        )
    return out


def table(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    host = doc.get("host") or doc["machine"]  # "machine": results made before provenance
    end = host.get("load_avg_at_end") or host["load_avg"]
    lines = [
        "# Warming a cold checkpoint: vmtouch -t vs the prefetcher",
        "",
        f"Checkpoint: {doc['checkpoint']} ({doc['bytes'] / 2**30:.2f} GiB, "
        f"{doc['files']} files); {doc['threads']} threads/processes; "
        f"machine: {host['cpu']}, {host['cpus']} CPUs, "
        f"{host['memory_gib']} GiB, kernel {host['kernel']}, "
        f"disk {host['disk']}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in end)}. {provenance_line(doc)}",
        "",
        "Cold: the guest's page cache dropped before each method (the residency before "
        "proves it); the host may still cache the virtual disk, so GB/s here is the "
        "guest's read path, not the storage's.",
        "",
        "| method | trials | median s | min-max s | GB/s | x prefetcher | resident after |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in s.items():
        lines.append(
            f"| {m} | {r['trials']} | {r['median_s']:.2f} | {r['min_s']:.2f}-{r['max_s']:.2f} | "
            f"{r['gbps']:.2f} | {r.get('vs_prefetch', 1.0):.2f} | {r['resident_after_pct']:.0f}% |"
        )
    lines += ["", f"Verdict: {doc['verdict']}.", "", f"Command: `{doc['command']}`", ""]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["summary"]
    names = list(s)
    med = [s[m]["median_s"] for m in names]
    err = [
        [s[m]["median_s"] - s[m]["min_s"] for m in names],
        [s[m]["max_s"] - s[m]["median_s"] for m in names],
    ]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = ["C0" if m.startswith("prefetch") else "C1" if "vmtouch" in m else "C2" for m in names]
    ax.bar(names, med, yerr=err, capsize=4, color=colors)
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_ylabel("seconds to warm (median, min-max)")
    ax.set_title(f"Cold checkpoint of {doc['bytes'] / 2**30:.2f} GiB into the page cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(args: argparse.Namespace) -> str:
    parts = ["rekindle-dev bench warm", f"--trials {args.trials}", f"--threads {args.threads}"]
    parts.append(f"--dir {args.dir}" if args.dir else f"--size-gb {args.size_gb:g}")
    return " ".join([*parts, f"--work {args.work}", f"--out {args.out}"])


def render(out: Path, doc: dict[str, Any]) -> str:
    text = table(doc)
    (out / "results.md").write_text(text)
    plot(doc, out / "results.png")
    return text


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.replot:  # redraw, and word the verdict again, from the stored trials
        doc = json.loads((out / "results.json").read_text())
        doc["verdict"] = verdict(doc["summary"])
        (out / "results.json").write_text(json.dumps(doc, indent=2))
        print(render(out, doc))
        return 0
    binary = resident_lock.vmtouch_binary()
    if os.geteuid() != 0 or binary is None:
        print("rekindle-dev bench warm: needs root (drop_caches) and vmtouch", file=sys.stderr)
        return 2
    work = Path(args.work)
    made = args.dir is None
    if made:
        root = work / "synthetic-checkpoint"
        shutil.rmtree(root, ignore_errors=True)
        log(f"writing a synthetic checkpoint of {args.size_gb:g} GB under {root}")
        files = synthetic_checkpoint(root, int(args.size_gb * 1e9))
    else:
        root = Path(args.dir)
        files = manifest_files(root)
    nbytes = sum(int(f["size"]) for f in files)
    todo = methods(binary, root, files, args.threads)
    runs: list[dict[str, Any]] = []
    started, load_start = time.time(), os.getloadavg()
    try:
        for trial in range(args.trials):
            order = list(METHODS[trial % len(METHODS) :] + METHODS[: trial % len(METHODS)])
            for m in order:
                drop_caches()
                before = residency.residency(root)
                t0 = time.monotonic()
                todo[m]()
                secs = time.monotonic() - t0
                after = residency.residency(root)
                runs.append(
                    {
                        "method": m,
                        "trial": trial,
                        "seconds": secs,
                        "before": before,
                        "after": after,
                        "load_avg": list(os.getloadavg()),
                    }
                )
                log(
                    f"trial {trial} {m:16s} {secs:6.2f}s ({nbytes / secs / 1e9:.2f} GB/s), "
                    f"resident {before['percent']:.0f}% -> {after['percent']:.0f}%"
                )
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(runs, nbytes)
    doc = {
        # scratch: the disk under the files
        **provenance(
            command_line(args),
            MEASURED_BY["warm"],
            load_start,
            started,
            str(work if made else root),
        ),
        "checkpoint": str(args.dir) if args.dir else f"synthetic, {args.size_gb:g} GB",
        "bytes": nbytes,
        "files": len(files),
        "threads": args.threads,
        "summary": summary,
        "verdict": verdict(summary),
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    print(render(out, doc))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--threads", type=int, default=8, help="prefetch threads / vmtouch processes")
    p.add_argument("--dir", default=None, help="a real checkpoint (with manifest.json)")
    p.add_argument("--size-gb", type=float, default=2.0, help="size of the synthetic checkpoint")
    p.add_argument("--work", default="/var/tmp/rekindle-bench-warm", help="scratch (on disk)")
    p.add_argument("--out", default="docs/bench/warm")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
