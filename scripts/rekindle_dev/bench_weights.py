"""`rekindle-dev bench weights`: reload throughput against the limits and loaders around it.

For synthetic weight sets (default 1, 4 and 8 GiB of bf16 tensors shaped like
a Llama's layers) and, on CPU, the tiny model served by a real vLLM, with a
warm and a cold page cache (`echo 3 > /proc/sys/vm/drop_caches`), it times:

  pagecache        reading the dump file itself into reused buffers with the
                   reloader's N threads: the physical limit of a file-based reload
  pagecache_1thread  the same with one thread (what `cat` or dd would see)
  h2d_pinned       (cuda) pinned host-to-device copies: the other limit
  rekindle         reload_tensors into the existing tensors (verify off)
  rekindle_verify  the same with the reloader's own per-block CRC-32 checked (what a
                   restore uses only with --verify-checksums size; not the BLAKE3 check)
  rekindle_fresh   (cpu) after release: storages shrunk to 0 and re-grown
                   (fresh memory, page faults included), as a restored worker does
  rekindle_fresh_map  (cpu, --map) the same by mapping the dump (the default on CPU)
  dump_check_blake3   the check a restore runs on the dump before it reloads: the
                   agent's prefetcher reading every dump file with BLAKE3 against
                   its digest (rekindle_agent.restoring.prefetch, the agent's thread count)
  *_checked        that check, then the reload: the restore's whole cost of the
                   weights when nothing else runs beside it (in a restore the check
                   overlaps CRIU's restore, so this is the upper bound)
  vllm_iterator    vLLM's default safetensors iterator (mmap) copying into the
                   same tensors: what DefaultModelLoader does for plain weights
  safetensors      safetensors.torch.load_file of the same tensors, copied into
                   the tensors (load_file alone only maps the file lazily)
  tiny model:      vLLM `reload_weights` vs `rekindle_reload_weights`, both
                   called through POST /collective_rpc on a real vLLM CPU server,
                   timed around the HTTP call and inside the worker

Each number is the median of --trials runs, all in one run of this command.
"cold" drops the guest's page cache first, and each row records how much of its
file was still cached before it: a cold row with more than 1% cached is marked
not cold. The host may cache the virtual disk even so; the cold `pagecache` row
(a plain read of the dump) says how fast this machine's "storage" answered.
Needs only torch (and safetensors) for the synthetic sets; vLLM for the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rekindle_agent.restoring import prefetch
from rekindle_contract import rpc
from rekindle_contract.agent_args import AgentArgs
from rekindle_contract.manifest import FileEntry
from rekindle_store import digests
from rekindle_weights import format as fmt
from rekindle_weights.dump import dump_tensors
from rekindle_weights.reload import (
    ReloadOptions,
    release_staging_buffers,
    reload_tensors,
    unmap_ranges,
)

from rekindle_dev.bench_common import provenance
from rekindle_dev.bench_provenance import MEASURED_BY, provenance_line

if TYPE_CHECKING:
    import torch

GiB = 1 << 30
MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[bench weights {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------- synthetic weights


def layer_shapes(hidden: int = 2048, inter: int = 5632, kv: int = 256) -> list[tuple[int, ...]]:
    """One Llama-style decoder layer (fused qkv, fused gate/up), norms included."""
    return [
        (hidden + 2 * kv, hidden),
        (hidden, hidden),
        (2 * inter, hidden),
        (hidden, inter),
        (hidden,),
        (hidden,),
    ]


def synthetic_weights(total_bytes: int, device: str) -> dict[str, torch.Tensor]:
    """Deterministic bf16 tensors adding up to about total_bytes (cheap to fill)."""
    import torch

    shapes = layer_shapes()
    per_layer = sum(2 * int(torch.Size(s).numel()) for s in shapes)
    layers = max(1, round(total_bytes / per_layer))
    out = {}
    for i in range(layers):
        for j, s in enumerate(shapes):
            t = torch.empty(s, dtype=torch.bfloat16, device=device)
            t.view(torch.int16).fill_(i * 7 + j)  # any bytes read at the same speed
            out[f"model.layers.{i}.w{j}"] = t
    return out


# ---------------------------------------------------------------- measurements


def read_file_gbps(path: Path, threads: int, chunk: int = 8 * MiB) -> float:
    """Page-cache (or disk) read bandwidth of path: N threads pread into reused buffers."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    lock = threading.Lock()
    state = {"next": 0}

    def worker() -> None:
        buf = memoryview(bytearray(chunk))
        while True:
            with lock:
                off = state["next"]
                state["next"] = off + chunk
            if off >= size:
                return
            os.preadv(fd, [buf], off)

    try:
        t0 = time.perf_counter()
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return size / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def cached_fraction(path: Path) -> float:
    """Share of path's pages in the page cache (mincore), to show how warm "warm" was."""
    from rekindle_agent.restoring.residency import mincore_pages

    try:
        resident, total = mincore_pages(path)
    except OSError:
        return float("nan")
    return resident / total if total else 1.0


def h2d_pinned_gbps(total: int, device: str) -> float:
    """Pinned host-to-device copy bandwidth (the ceiling for a GPU reload)."""
    import torch

    n = min(total, GiB)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    reps = max(1, total // n)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return reps * n / (time.perf_counter() - t0) / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed_gbps(nbytes: int, fn: Callable[[], object], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return nbytes / (time.perf_counter() - t0) / 1e9


def vllm_iterator_load(st_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """vLLM's default loader path for plain weights: its safetensors iterator, then copy_."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    for name, w in safetensors_weights_iterator([str(st_path)], False):
        tensors[name].copy_(w)


def release_and_regrow(tensors: dict[str, torch.Tensor]) -> None:
    """What a CPU worker's release + reload does to memory: fresh, unfaulted storages."""
    sizes = [(t.untyped_storage(), t.untyped_storage().nbytes()) for t in tensors.values()]
    for s, _ in sizes:
        s.resize_(0)
    gc.collect()
    for s, n in sizes:
        s.resize_(n)


def fresh_touch_gbps(nbytes: int) -> float:
    """First write to freshly allocated memory (page faults and zeroing, no file at all).

    The floor under any reload into fresh memory: where this is far below the
    page-cache read, fresh memory, not the reader, limits the reload.
    """
    import torch

    gc.collect()
    t0 = time.perf_counter()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)
    secs = time.perf_counter() - t0
    del buf
    return nbytes / secs / 1e9


def fresh_map_gbps(
    d: Path, tensors: dict[str, torch.Tensor], opts: ReloadOptions, verify: bool
) -> float:
    """Reload into fresh memory by mapping the dump (ReloadOptions.map_file), every page
    then faulted in once (without verify) or every block CRC-checked through the mapping.

    The mappings are undone before returning (released memory must not stay mapped).
    """
    import torch

    release_and_regrow(tensors)
    release_staging_buffers()
    t0 = time.perf_counter()
    res = reload_tensors(
        d, tensors, options=dataclasses.replace(opts, map_file=True, verify=verify)
    )
    if not verify:  # map alone is lazy: count the page faults the model's first use pays
        for t in tensors.values():
            flat = t.reshape(-1).view(torch.uint8)
            int(flat[:: mmap_page()].sum())
    secs = time.perf_counter() - t0
    unmap_ranges(res.mapped)
    if res.mapped_bytes < res.bytes // 2:
        log(f"only {res.mapped_bytes / max(1, res.bytes):.0%} mapped (storages not page-aligned)")
    return res.bytes / secs / 1e9


def dump_entries(d: Path) -> list[FileEntry]:
    """The dump's files with their BLAKE3 digests, as a checkpoint's manifest records them."""
    out: list[FileEntry] = []
    for f in sorted(p for p in d.iterdir() if p.is_file() and p.suffix != ".safetensors"):
        h = digests.new("blake3")
        with f.open("rb") as fh:
            while chunk := fh.read(8 * MiB):
                h.update(chunk)
        out.append({"path": f.name, "size": f.stat().st_size, "blake3": h.hexdigest()})
    return out


def check_dump_seconds(d: Path, files: list[FileEntry]) -> float:
    """The restore's check of the dump: the agent's prefetcher, BLAKE3, its thread count."""
    t0 = time.perf_counter()
    res = prefetch.Prefetcher(d, files, AGENT_PREFETCH_THREADS, "blake3").result()
    secs = time.perf_counter() - t0
    if res.bad:
        raise RuntimeError(f"the dump failed its own check: {res.bad}")
    return secs


# The agent's default reader threads (--prefetch-threads).
AGENT_PREFETCH_THREADS = AgentArgs().prefetch_threads


def mmap_page() -> int:
    import mmap

    return mmap.PAGESIZE


# ---------------------------------------------------------------- one weight set


def bench_set(
    label: str,
    tensors: dict[str, torch.Tensor],
    work: Path,
    args: argparse.Namespace,
    opts: ReloadOptions,
) -> list[dict[str, Any]]:
    """All methods on one weight set, warm and cold, args.trials times; one row per run."""
    import torch

    device = args.device
    d = work / label
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    log(f"{label}: dumping {len(tensors)} tensors")
    res = dump_tensors(((n, "param", t) for n, t in tensors.items()), d, 0)
    nbytes = fmt.read_index(d, 0).data_bytes
    log(f"{label}: dump {res.bytes / GiB:.2f} GiB in {res.seconds:.1f} s")
    st_path = d / "model.safetensors"
    has_st = _importable("safetensors")
    has_vllm = has_st and device == "cpu" and not args.no_vllm and _importable("vllm")
    if has_st:
        from safetensors.torch import load_file, save_file

        save_file({n: t.cpu() for n, t in tensors.items()}, str(st_path))
    else:
        log("safetensors is not installed: its baselines are skipped")
    threads = opts.resolved_threads()

    def reload(o: ReloadOptions) -> float:
        release_staging_buffers()  # each run allocates its staging ring, as a restore does
        return reload_tensors(d, tensors, options=o).gbps

    methods: dict[str, Callable[[], float]] = {
        "pagecache": lambda: read_file_gbps(fmt.data_path(d, 0), threads),
        "pagecache_1thread": lambda: read_file_gbps(fmt.data_path(d, 0), 1),
        "rekindle": lambda: reload(opts),
        "rekindle_verify": lambda: reload(dataclasses.replace(opts, verify=True)),
    }
    if device == "cpu":

        def fresh() -> float:
            release_and_regrow(tensors)
            return reload(opts)

        methods["rekindle_fresh"] = fresh

        def fresh_verify() -> float:
            release_and_regrow(tensors)
            return reload(dataclasses.replace(opts, verify=True))

        # The headline: how a restore reloads (fresh memory, every block checked).
        methods["rekindle_fresh_verify"] = fresh_verify
        methods["fresh_touch"] = lambda: fresh_touch_gbps(nbytes)
        entries = dump_entries(d)  # the manifest's digests (not timed)
        dump_bytes = sum(int(f["size"]) for f in entries)
        methods["dump_check_blake3"] = lambda: dump_bytes / check_dump_seconds(d, entries) / 1e9

        def checked(reload_gbps: Callable[[], float]) -> float:
            # The check, then the reload (which then finds the dump in the page cache).
            secs = check_dump_seconds(d, entries)
            return nbytes / (secs + nbytes / (reload_gbps() * 1e9)) / 1e9

        methods["rekindle_fresh_checked"] = lambda: checked(fresh)
        if getattr(args, "map", False):
            methods["rekindle_fresh_map"] = lambda: fresh_map_gbps(d, tensors, opts, False)
            methods["rekindle_fresh_map_checked"] = lambda: checked(
                lambda: fresh_map_gbps(d, tensors, opts, False)
            )
            methods["rekindle_fresh_map_verify"] = lambda: fresh_map_gbps(d, tensors, opts, True)
    else:
        methods["h2d_pinned"] = lambda: h2d_pinned_gbps(nbytes, device)
    if has_vllm:
        import vllm.model_executor.model_loader.weight_utils  # noqa: F401 (not in the timing)

        methods["vllm_iterator"] = lambda: timed_gbps(
            nbytes, lambda: vllm_iterator_load(st_path, tensors), device
        )

    def st_load() -> float:
        # load_file maps the file lazily: copying into the model's tensors is what
        # makes the bytes arrive (and is what a loader does with them).
        t0 = time.perf_counter()
        for name, w in load_file(str(st_path), device=device).items():
            tensors[name].copy_(w)
        _sync(device)
        return nbytes / (time.perf_counter() - t0) / 1e9

    if has_st:
        methods["safetensors"] = st_load
    rows = []
    caches = ["warm"] + ([] if args.no_cold else ["cold"])
    for trial in range(args.trials):
        for cache in caches:
            for method, fn in methods.items():
                if method == "h2d_pinned" and cache == "cold":
                    continue
                src = st_path if method in ("vllm_iterator", "safetensors") else fmt.data_path(d, 0)
                if cache == "warm":
                    read_file_gbps(src, threads)  # bring it into the cache
                else:
                    drop_caches()
                cached = cached_fraction(src)
                gbps = fn()
                rows.append(
                    dict(
                        set=label,
                        method=method,
                        cache=cache,
                        trial=trial,
                        bytes=nbytes,
                        gbps=round(gbps, 3),
                        cached=round(cached, 3),
                    )
                )
                log(
                    f"{label} trial {trial} {cache:4s} {method:17s} {gbps:7.2f} GB/s "
                    f"({cached:.0%} of the file in the page cache before)"
                )
    # Prove the last reload was bit-exact (the runs above only timed it).
    reload_tensors(d, tensors, options=ReloadOptions(verify=True))
    shutil.rmtree(d, ignore_errors=True)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def _importable(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


# ---------------------------------------------------------------- the tiny model on vLLM


def bench_tiny_vllm(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """vLLM's reload_weights vs rekindle_reload_weights on a real vLLM CPU server."""
    from rekindle_dev.models import generate_tiny_model
    from rekindle_dev.vllm_runner import running_vllm

    model = Path(args.model) if args.model else generate_tiny_model(work / "tiny-model")
    dump = work / "tiny-dump"
    shutil.rmtree(dump, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    log("tiny: booting vLLM (CPU) with the Rekindle extension")
    with running_vllm(model, work / "tiny-vllm.log") as s:
        s.rpc(rpc.DUMP_WEIGHTS, str(dump))
        nbytes = fmt.read_index(dump, 0).data_bytes
        files = {"vllm_reload_weights": model, "rekindle_rpc": dump}
        caches = ["warm"] + ([] if args.no_cold else ["cold"])
        for trial in range(args.trials):
            for cache in caches:
                for method, src in files.items():
                    if cache == "cold":
                        drop_caches()
                    else:
                        for f in src.iterdir():
                            f.read_bytes()
                    t0 = time.perf_counter()
                    if method == "vllm_reload_weights":
                        (r,) = s.rpc(rpc.TIME_VLLM_RELOAD)
                        inner = r["seconds"]
                    else:
                        (r,) = s.rpc(rpc.RELOAD_WEIGHTS, str(dump), verify="false")
                        inner = r["seconds"]
                    wall = time.perf_counter() - t0
                    rows.append(
                        dict(
                            set="tiny",
                            method=method,
                            cache=cache,
                            trial=trial,
                            bytes=nbytes,
                            seconds=round(wall, 6),
                            worker_seconds=inner,
                            gbps=round(nbytes / wall / 1e9, 4),
                        )
                    )
                    log(f"tiny trial {trial} {cache:4s} {method:20s} {wall * 1000:8.1f} ms")
        s.post("/reset_prefix_cache")
    return rows


# ---------------------------------------------------------------- report


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["set"], r["cache"], r["method"]), []).append(r)
    out: dict[str, Any] = {}
    for (st, cache, method), rs in groups.items():
        g = [r["gbps"] for r in rs]
        entry: dict[str, Any] = {
            "gbps_median": round(statistics.median(g), 3),
            "gbps_min": min(g),
            "gbps_max": max(g),
            "trials": len(g),
        }
        if "cached" in rs[0]:
            entry["cached_median"] = round(statistics.median(r["cached"] for r in rs), 3)
        if "seconds" in rs[0]:
            entry["seconds_median"] = round(statistics.median(r["seconds"] for r in rs), 6)
        if rs[0].get("worker_seconds") is not None:
            entry["worker_seconds_median"] = round(
                statistics.median(r["worker_seconds"] for r in rs), 6
            )
        out.setdefault(st, {}).setdefault(cache, {})[method] = entry
    for caches in out.values():
        for methods in caches.values():
            best = max(
                (
                    methods[m]["gbps_median"]
                    for m in ("pagecache", "pagecache_1thread")
                    if m in methods
                ),
                default=0.0,
            )
            for m in (
                "rekindle_fresh",
                "rekindle_fresh_verify",
                "rekindle_fresh_checked",
                "rekindle_fresh_map",
                "rekindle_fresh_map_verify",
                "rekindle_fresh_map_checked",
                "rekindle",
                "rekindle_verify",
            ):
                if best and m in methods:
                    methods[m]["vs_best_pagecache"] = round(methods[m]["gbps_median"] / best, 3)
            rk = methods.get("rekindle", {}).get("gbps_median")
            bases = ("pagecache", "pagecache_1thread", "h2d_pinned", "vllm_iterator", "safetensors")
            for base in bases:
                if rk and base in methods:
                    methods["rekindle"][f"vs_{base}"] = round(rk / methods[base]["gbps_median"], 3)
    return out


# A "cold" row whose file had more than this share in the page cache before it is not cold.
COLD_MAX_CACHED = 0.01


def cold_note(summary: dict[str, Any], disk: str | None) -> str:
    """What "cold" means in this run: the guest's page cache only, and how fast the
    cold read of the dump was (the host may cache the virtual disk); "" without cold rows."""
    if not any("cold" in caches for caches in summary.values()):
        return ""
    text = (
        'Cold: the guest\'s page cache dropped before each run ("cached before" shows what '
        "was left; above 1% the row is marked NOT cold); the host may still cache the virtual "
        "disk."
    )
    for name, caches in summary.items():
        read = caches.get("cold", {}).get("pagecache")
        if read:
            text += (
                f" A cold read of the {name} dump ran at {read['gbps_median']:.2f} GB/s"
                + (f" from {disk}" if disk else "")
                + "."
            )
            break
    return text


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| set | cache | method | GB/s (median) | min..max | rekindle ÷ this | cached before "
        "| ÷ best page-cache read |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for st, caches in summary.items():
        for cache, methods in caches.items():
            rk = methods.get("rekindle", {}).get("gbps_median")
            for m, e in methods.items():
                ratio = f"{rk / e['gbps_median']:.2f}" if rk and m != "rekindle" else ""
                extra = ""
                if "seconds_median" in e:
                    extra = f" ({e['seconds_median'] * 1000:.1f} ms via HTTP"
                    if "worker_seconds_median" in e:
                        extra += f"; {e['worker_seconds_median'] * 1000:.1f} ms in the worker"
                    extra += ")"
                cached = f"{e['cached_median']:.0%}" if "cached_median" in e else ""
                if cache == "cold" and e.get("cached_median", 0.0) > COLD_MAX_CACHED:
                    cached += " (NOT cold)"
                lines.append(
                    f"| {st} | {cache} | {m} | {e['gbps_median']:.3f}{extra} | "
                    f"{e['gbps_min']:.3f}..{e['gbps_max']:.3f} | {ratio} | {cached} | "
                    f"{e.get('vs_best_pagecache', '')} |"
                )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caches = sorted({c for s in summary.values() for c in s}, key=["warm", "cold"].index)
    fig, axes = plt.subplots(1, len(caches), figsize=(7 * len(caches), 5), squeeze=False)
    for ax, cache in zip(axes[0], caches, strict=True):
        sets = [s for s in summary if cache in summary[s]]
        methods = list(dict.fromkeys(m for s in sets for m in summary[s][cache]))
        width = 0.8 / max(1, len(methods))
        for k, m in enumerate(methods):
            xs = [i + k * width for i, s in enumerate(sets) if m in summary[s][cache]]
            ys = [summary[s][cache][m]["gbps_median"] for s in sets if m in summary[s][cache]]
            ax.bar(xs, ys, width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (median; log scale)")
        ax.set_title(f"{cache} page cache")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (from the parsed options, whatever the entry)."""
    parts = ["rekindle-dev bench weights", f"--sizes {args.sizes}", f"--trials {args.trials}"]
    parts.append(f"--device {args.device}")
    for opt in ("threads", "chunk_mib", "buffers", "model"):
        if getattr(args, opt) is not None:
            parts.append(f"--{opt.replace('_', '-')} {getattr(args, opt)}")
    parts += [
        f"--{f.replace('_', '-')}"
        for f in ("direct", "no_cold", "no_vllm", "map")
        if getattr(args, f)
    ]
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    if args.replot:  # redraw the table and plot from the stored runs
        suffix = "" if args.device == "cpu" else f"-{args.device.split(':')[0]}"
        path = Path(args.out) / f"results{suffix}.json"
        doc = json.loads(path.read_text())
        doc["summary"] = summarize(doc["runs"])
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(render(Path(args.out), doc, suffix))
        return 0
    if getattr(args, "map", False):
        if "torch" in sys.modules:
            log("--map: set THP_MEM_ALLOC_ENABLE=1 before torch is imported (page-aligned tensors)")
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if not args.no_cold and os.geteuid() != 0:
        log("cold runs need root (drop_caches): run as root or pass --no-cold")
        return 2
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            log("--device cuda: CUDA is not available here")
            return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    opts = ReloadOptions(
        threads=args.threads,
        chunk_bytes=args.chunk_mib * MiB if args.chunk_mib else None,
        buffers=args.buffers,
        verify=False,
        direct=args.direct,
    )
    rows: list[dict[str, Any]] = []
    started, load_start = time.time(), os.getloadavg()
    if args.device == "cpu" and not args.no_vllm and _importable("vllm"):
        rows += bench_tiny_vllm(work, args)
    for gib in [float(x) for x in args.sizes.split(",") if x]:
        need = gib * GiB * 1.2 + GiB
        if mem_available() < need:
            log(f"{gib:g} GiB: skipped, {mem_available() / GiB:.1f} GiB available")
            continue
        log(f"{gib:g} GiB: building synthetic weights on {args.device}")
        tensors = synthetic_weights(int(gib * GiB), args.device)
        rows += bench_set(f"{gib:g}GiB", tensors, work, args, opts)
        del tensors
        gc.collect()
    summary = summarize(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = provenance(command_line(args), MEASURED_BY["weights"], load_start, started, str(work))
    host = doc["host"]
    host["device"] = args.device
    if args.device.startswith("cuda"):
        import torch

        host["gpu"] = torch.cuda.get_device_name()
    doc |= {
        "agent_prefetch_threads": AGENT_PREFETCH_THREADS,
        "options": {
            "threads": opts.resolved_threads(),
            "chunk_bytes": opts.chunk_bytes,
            "buffers": opts.buffers,
            "direct": opts.direct,
        },
        "summary": summary,
        "runs": rows,
    }
    suffix = "" if args.device == "cpu" else f"-{args.device.split(':')[0]}"
    (out / f"results{suffix}.json").write_text(json.dumps(doc, indent=2))
    print(render(out, doc, suffix))
    return 0


def render(out: Path, doc: dict[str, Any], suffix: str = "") -> str:
    """results{suffix}.md and .png from a results document (this run's, or --replot's)."""
    summary, host = doc["summary"], doc["host"]
    device = host.get("device", "cpu")
    text = table(summary)
    where = ", ".join(str(x) for x in (host.get("cpu"), f"{host.get('cpus')} CPUs") if x)
    threads = doc.get("agent_prefetch_threads", AGENT_PREFETCH_THREADS)
    (out / f"results{suffix}.md").write_text(
        f"`{doc['command']}` on {host.get('node')} ({where}, {host.get('gpu', device)}). "
        f"{provenance_line(doc)}\n\n"
        f'{cold_note(summary, host.get("disk"))} "_checked": the restore\'s BLAKE3 check '
        f"of the dump ({threads} threads, the agent's prefetcher), then the "
        "reload; in a restore the check overlaps CRIU's restore, so that figure is its upper "
        'bound. "_verify": the reloader\'s own per-block CRC-32 instead.\n\n' + text
    )
    plot(
        summary,
        out / f"results{suffix}.png",
        f"rekindle-dev bench weights ({device}, "
        f"{host.get('gpu', host.get('node'))}, {host.get('cpus')} CPUs)",
    )
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1,4,8", help="synthetic weight sets, GiB, comma-separated")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (cuda needs only torch)")
    p.add_argument("--threads", type=int, default=None, help="reader threads (default: auto)")
    p.add_argument("--chunk-mib", type=int, default=None, help="read size per chunk")
    p.add_argument("--buffers", type=int, default=None, help="pinned ring size (staged path)")
    p.add_argument("--direct", action="store_true", help="O_DIRECT reads (staged path)")
    p.add_argument("--no-cold", action="store_true", help="skip cold page-cache runs")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM baselines")
    p.add_argument(
        "--map",
        action="store_true",
        help="also reload into fresh memory by mapping the dump (rekindle_fresh_map*); sets "
        "THP_MEM_ALLOC_ENABLE=1 for the whole run so PyTorch's big allocations are page-aligned",
    )
    p.add_argument("--model", default=None, help="model dir for the vLLM part (default: tiny)")
    p.add_argument("--work", default="/var/tmp/rekindle-bench-weights", help="scratch, on disk")
    p.add_argument("--out", default="docs/bench/weights")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
