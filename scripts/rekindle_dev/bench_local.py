"""`rekindle-dev bench local`: naive boot vs CRIU restore, on this machine, launch to first token.

Every variant runs the real agent as PID 1 of a fresh PID+mount namespace with
an empty /dev/shm (rekindle_dev.harness), like a new pod:
  naive    no checkpoint: vLLM boots
  stock    restore with stock CRIU (copying restore), no prefetch; checksums
           verified up front
  stock+prefetch  the same CRIU with the prefetch (separates the two gains)
  patched-size    (only when asked for) patched without the content check
  patched  restore with the patched CRIU (--mmap-restore when it has it) and
           the parallel prefetch, BLAKE3 checked while restoring (the tree
           stays stopped until every file is checked)
  patched-signed  (only when asked for) the same with the signing key: the
           manifest's signature checked too. The checkpoint the bench makes is
           always signed (unsigned agents accept it), so patched-size, patched
           and patched-signed differ only in what the restore checks
each with a warm page cache (the checkpoint read once just before, untimed:
on a shared machine another job's drop_caches could otherwise make a warm row
cold) and a cold one (`echo 3 > /proc/sys/vm/drop_caches`), for N trials,
interleaved. Time to first token = agent launch to the answer of a one-token
completion through the agent's proxy. Every restore records how
much of the checkpoint was in the page cache just before it started
(rekindle_agent.residency: warm should read ~100 %, cold ~0 %), and every
naive boot its own split into phases from its vLLM log
(bench_common.parse_vllm_log), so the report's naive split and ratios come
from the same run. Results: JSON, a Markdown table and a PNG of stacked phase
bars.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from rekindle_agent import residency
from rekindle_agent.immutable import remove_tree
from rekindle_contract.api import PATH_READYZ

from rekindle_dev.bench_common import host_facts, parse_vllm_log, residency_cell
from rekindle_dev.harness import AgentFactory, AgentProc

# The agent's settings per variant (AgentArgs fields).
VARIANTS: dict[str, dict[str, Any]] = {
    "naive": {"restore_policy": "never"},
    "stock": {"mmap_restore": "off", "prefetch": False},
    "stock+prefetch": {"mmap_restore": "off", "prefetch": True},
    "patched": {"mmap_restore": "auto", "prefetch": True},
    # Not run by default: the same without checking file contents (sizes only), to
    # show what the crc32 check costs.
    "patched-size": {"mmap_restore": "auto", "prefetch": True, "verify_checksums": "size"},
    # Not run by default: with the signing key (signature + BLAKE3 of every file).
    "patched-signed": {"mmap_restore": "auto", "prefetch": True, "signed": True},
}
RESTORE_PHASES = (
    "validate",
    "checksums",
    "verify_critical",
    "shm",
    "criu_restore",
    "prefetch_wait",
    "resume",
    "health",
    "weights_check_wait",
    "reload_weights",
    "first_token",
)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def wait_ready_tight(agent: AgentProc, timeout: float) -> float:
    """Poll /readyz every 10 ms; seconds since launch when it first answered 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if agent.proc.poll() is not None:
            raise RuntimeError(f"agent exited:\n{agent.tail()}")
        try:
            with urllib.request.urlopen(agent.admin_url + PATH_READYZ, timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - agent.launched
        except OSError:
            pass
        time.sleep(0.01)
    raise TimeoutError(f"not ready after {timeout}s:\n{agent.tail()}")


def one_run(
    factory: AgentFactory,
    variant: str,
    ckpt: Path,
    criu: dict[str, Path],
    name: str,
    key_file: Path | None = None,
    tp: int = 1,
    warm: bool = False,
) -> dict[str, Any]:
    """One launch to first token; warm: read the checkpoint into the page cache first
    (untimed), so a cache that someone else dropped meanwhile cannot pass for warm."""
    settings = dict(VARIANTS[variant])
    if tp != 1:  # vLLM's tensor-parallel ranks (on CPU, one worker process each)
        settings["tensor_parallel_size"] = tp
    if settings.pop("signed", False):
        settings["signing_key_file"] = str(key_file)
    if variant != "naive":
        settings.update(checkpoint=str(ckpt), criu=str(criu[variant]))
    for stale in (CRIU_STATS, CRIU_LOG, VLLM_LOG):  # the run writes them anew
        (factory.run_dir / stale).unlink(missing_ok=True)
    if warm and variant != "naive":
        warm_checkpoint(ckpt)
    # Before the launch, so asking costs the timed run nothing.
    resident = None if variant == "naive" else residency_before(ckpt)
    launched_wall = time.time()
    agent = factory.start(name=name, **settings)
    try:
        ready = wait_ready_tight(agent, 900)
        agent.complete("The river", max_tokens=1)
        ttft = time.monotonic() - agent.launched
        st = agent.status()
    finally:
        agent.stop()
    if variant != "naive" and st.origin != "restored":
        raise RuntimeError(f"{variant}: fell back to boot: {st.last_fallback}")
    flow = st.timings.get("restore" if variant != "naive" else "boot", {})
    phases: dict[str, float] = {}
    if variant == "naive":
        phases["vllm_boot"] = flow.get("total", 0.0)
    else:
        for p in RESTORE_PHASES:
            if p in flow:
                phases[p] = flow[p]
    phases = {
        "agent_start": max(0.0, ready - flow.get("total", 0.0)),
        **phases,
        "first_request": ttft - ready,
    }
    out: dict[str, Any] = {
        "variant": variant,
        "ttft": ttft,
        "ready": ready,
        "phases": phases,
        "mmap": bool(st.raw.get("restored_with_mmap")),
        "prefetch_total": flow.get("prefetch_total"),
        "criu": criu_profile(factory.run_dir) if variant != "naive" else {},
        "load_avg": os.getloadavg(),
    }
    if variant == "naive":
        out["vllm_split"] = vllm_split(factory.run_dir / VLLM_LOG, launched_wall, ready)
    else:
        out["residency_before"] = resident
    return out


CRIU_STATS, CRIU_LOG, VLLM_LOG = "stats-restore", "restore.log", "vllm.log"


def warm_checkpoint(ckpt: Path, threads: int = 8) -> None:
    """Read every file of the checkpoint once (sizes checked only) into the page cache."""
    from rekindle_agent import manifest_io, prefetch

    res = prefetch.Prefetcher(ckpt, manifest_io.read(ckpt)["files"], threads, "size").result()
    if res.bad:
        raise RuntimeError(f"reading the checkpoint failed: {res.bad[:3]}")


def residency_before(ckpt: Path) -> dict[str, Any] | None:
    """How much of the checkpoint is in the page cache now (None, logged, if asking fails).

    A warm restore should find ~100 %, a cold one ~0 %: the number proves the
    row's label, and a warm row that is not fully cached explains a slow one."""
    try:
        return residency.residency(ckpt)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        log(f"no residency for {ckpt}: {e}")
        return None


def vllm_split(log_path: Path, launched_wall: float, ready: float) -> dict[str, Any]:
    """This naive boot's phases from its own vLLM log (bench_common.parse_vllm_log).

    launched_wall: wall clock of the launch; ready: seconds from launch to Ready.
    A log the parser cannot split gives {"error": why} instead of failing the bench."""
    try:
        text = log_path.read_text(errors="replace")
        doc = parse_vllm_log(text, launched_wall, launched_wall + ready)
    except (OSError, ValueError) as e:
        log(f"naive boot not split: {e}")
        return {"error": str(e)}
    return {"phases": doc["phases"], "eager": doc["eager"], "lines": doc["lines"]}


def criu_profile(run_dir: Path) -> dict[str, float]:
    """Inside the criu_restore phase, from CRIU's own stats and -v4 log (rekindle_agent.criu)."""
    from rekindle_agent import criu as criu_mod

    out: dict[str, float] = {}
    try:
        stats = criu_mod.parse_restore_stats((run_dir / CRIU_STATS).read_bytes())
        out["forking_s"] = stats.get("forking_us", 0) / 1e6
        out["restore_s"] = stats.get("restore_us", 0) / 1e6
        out["pages_restored"] = float(stats.get("pages_restored", 0))
    except (OSError, ValueError) as e:
        log(f"no CRIU stats: {e}")
    try:
        prof = criu_mod.restore_log_profile((run_dir / CRIU_LOG).read_text(errors="replace"))
        out.update({f"log_{k}": v for k, v in prof.items()})
    except OSError as e:
        log(f"no CRIU log: {e}")
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({(r["variant"], r["cache"]) for r in runs}):
        rs = [r for r in runs if (r["variant"], r["cache"]) == key]
        ttfts = [r["ttft"] for r in rs]
        phase_names = list(dict.fromkeys(p for r in rs for p in r["phases"]))
        out[f"{key[0]}/{key[1]}"] = {
            "variant": key[0],
            "cache": key[1],
            "trials": len(rs),
            "ttft_median": statistics.median(ttfts),
            "ttft_min": min(ttfts),
            "ttft_max": max(ttfts),
            "phases_median": {
                p: statistics.median(r["phases"].get(p, 0.0) for r in rs) for p in phase_names
            },
            "mmap": any(r["mmap"] for r in rs),
        }
        row = out[f"{key[0]}/{key[1]}"]
        readies = [r["ready"] for r in rs if "ready" in r]
        if readies:
            row["ready_median"] = statistics.median(readies)
        percents = [r["residency_before"]["percent"] for r in rs if r.get("residency_before")]
        if percents:
            row["residency_before_percent"] = {
                "median": statistics.median(percents),
                "min": min(percents),
                "max": max(percents),
            }
        splits = [r["vllm_split"] for r in rs if "phases" in (r.get("vllm_split") or {})]
        if splits:
            names = list(dict.fromkeys(k for sp in splits for k in sp["phases"]))
            row["vllm_split_median"] = {
                k: round(statistics.median(sp["phases"].get(k, 0.0) for sp in splits), 3)
                for k in names
            }
            row["vllm_split_trials"] = len(splits)
            row["eager"] = all(sp["eager"] for sp in splits)
        criu_keys = list(dict.fromkeys(k for r in rs for k in r.get("criu", {})))
        if criu_keys:
            out[f"{key[0]}/{key[1]}"]["criu_median"] = {
                k: statistics.median(r.get("criu", {}).get(k, 0.0) for r in rs) for k in criu_keys
            }
    for cache in ("warm", "cold"):
        naive = out.get(f"naive/{cache}")
        for v in ("stock", "stock+prefetch", "patched", "patched-size", "patched-signed"):
            s = out.get(f"{v}/{cache}")
            if naive and s:
                s["speedup_vs_naive"] = naive["ttft_median"] / s["ttft_median"]
    return out


def naive_split_lines(summary: dict[str, Any]) -> list[str]:
    """The naive rows' median split from their own vLLM logs, as Markdown lines."""
    lines: list[str] = []
    for s in summary.values():
        split = s.get("vllm_split_median")
        if s["variant"] != "naive" or not split:
            continue
        total = s["phases_median"].get("vllm_boot", 0.0)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in split.items())
        lines.append(
            f"- naive/{s['cache']} (median of {s['vllm_split_trials']}; agent's boot "
            f"{total:.2f} s): {parts}"
        )
    if lines:
        lines = ["", "Naive boot split from each boot's own vLLM log (this run, s):", "", *lines]
    return lines


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| variant | cache | trials | TTFT median (s) | min-max (s) | x faster than naive "
        "| page cache before restore (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        speed = f"{s['speedup_vs_naive']:.1f}" if "speedup_vs_naive" in s else "1.0"
        if "vs_disk_floor" in s:
            speed += f" ({s['vs_disk_floor']:.2f}x the disk-read floor)"
        lines.append(
            f"| {s['variant']}{' (mmap)' if s['mmap'] else ''} | {s['cache']} | {s['trials']} | "
            f"{s['ttft_median']:.2f} | {s['ttft_min']:.2f}-{s['ttft_max']:.2f} | {speed} "
            f"| {residency_cell(s)} |"
        )
    lines += ["", "Median phase seconds:", ""]
    for s in summary.values():
        parts = ", ".join(f"{k} {v:.3f}" for k, v in s["phases_median"].items())
        lines.append(f"- {s['variant']}/{s['cache']}: {parts}")
    lines += naive_split_lines(summary)
    criu_rows = [s for s in summary.values() if s.get("criu_median")]
    if criu_rows:
        lines += [
            "",
            "Inside criu_restore (medians; CRIU's stats-restore and its -v4 log): fork and "
            "restore as CRIU times them, setup = start to first fork (kernel probes, images), "
            "read = the largest task's time in preadv (copying pages), MiB read vs mapped:",
            "",
            "| variant | cache | fork (s) | restore (s) | setup (s) | read (s) | MiB read | "
            "MiB mapped |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in criu_rows:
            c = s["criu_median"]
            lines.append(
                f"| {s['variant']} | {s['cache']} | {c.get('forking_s', 0):.3f} | "
                f"{c.get('restore_s', 0):.3f} | {c.get('log_setup_s', 0):.3f} | "
                f"{c.get('log_read_s', 0):.3f} | {c.get('log_read_bytes', 0) / 2**20:.0f} | "
                f"{c.get('log_mapped_bytes', 0) / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


PHASE_ORDER = ("agent_start", "vllm_boot", *RESTORE_PHASES, "first_request")


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(summary)
    seen = {p for s in summary.values() for p in s["phases_median"]}
    phases = [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))
    cmap = plt.get_cmap("tab20")
    color = {p: cmap(i % 20) for i, p in enumerate(phases)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [1, 2]})
    for ax, keys in ((ax1, labels), (ax2, [k for k in labels if not k.startswith("naive")])):
        bottom = [0.0] * len(keys)
        for ph in phases:
            vals = [summary[k]["phases_median"].get(ph, 0.0) for k in keys]
            ax.bar(keys, vals, bottom=bottom, color=color[ph], label=ph)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for i, k in enumerate(keys):
            s = summary[k]
            lo, hi = s["ttft_median"] - s["ttft_min"], s["ttft_max"] - s["ttft_median"]
            ax.errorbar(i, s["ttft_median"], yerr=[[lo], [hi]], fmt="k.", capsize=4)
        ax.tick_params(axis="x", rotation=30)
    ax1.set_ylabel("seconds, launch to first token")
    ax1.set_title("all variants")
    ax2.set_title("restores only (zoom)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[p]) for p in phases]
    ax2.legend(handles, phases, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(
        "rekindle-dev bench local (vLLM CPU, tiny model): bars = median phases; "
        "dot = median time to first token, whiskers = min-max"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(out: Path, summary: dict[str, Any]) -> str:
    text = table(summary)
    (out / "results.md").write_text(text)
    plot(summary, out / "results.png")
    return text


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (from the parsed options, whatever the entry)."""
    parts = ["rekindle-dev bench local", f"--criu-prefix {args.criu_prefix}"]
    parts += [f"--trials {args.trials}", f"--variants {args.variants}", f"--work {args.work}"]
    if args.model:
        parts.append(f"--model {args.model}")
    if getattr(args, "verify_cost", False):
        parts.append("--verify-cost")
    if getattr(args, "tp", 1) != 1:
        parts.append(f"--tp {args.tp}")
    return " ".join([*parts, f"--out {args.out}"])


def disk_floor(ckpt: Path, files: list[Any], threads: int = 8) -> float:
    """Seconds to read every file of the checkpoint once, in parallel, from a cold page cache.

    The floor for a cold restore: nothing that needs the bytes can finish sooner.
    """
    from rekindle_agent import prefetch

    drop_caches()
    t0 = time.monotonic()
    res = prefetch.Prefetcher(ckpt, files, threads, "size").result()
    if res.bad:
        raise RuntimeError(f"reading the checkpoint failed: {res.bad[:3]}")
    return time.monotonic() - t0


def floor_row(median: float, summary: dict[str, Any]) -> dict[str, Any]:
    """The disk-read floor as a row of the summary (its one phase: disk_read)."""
    row: dict[str, Any] = {
        "variant": "disk-floor",
        "cache": "cold",
        "trials": 0,
        "ttft_median": median,
        "ttft_min": median,
        "ttft_max": median,
        "phases_median": {"disk_read": median},
        "mmap": False,
    }
    for key, s in summary.items():
        if key.endswith("/cold") and not key.startswith("naive"):
            s["vs_disk_floor"] = s["ttft_median"] / median
    return row


def verify_cost(ckpt: Path, threads: int, trials: int) -> dict[str, Any]:
    """The restore's content check alone, on a real checkpoint: read every file with the
    prefetcher (threads as the agent), checking nothing (size), crc32 (what older agents
    checked by default) or BLAKE3 (the default now); median seconds, warm and cold cache."""
    from rekindle_agent import digests, manifest_io, prefetch

    man = manifest_io.read(ckpt)
    files: list[dict[str, Any]] = [dict(f) for f in man["files"]]
    for f in files:  # crc32 as an older agent recorded it (not timed)
        h = digests.new("crc32")
        with open(ckpt / str(f["path"]), "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        f["crc32"] = h.hexdigest()
    out: dict[str, Any] = {"bytes": sum(int(f["size"]) for f in files), "threads": threads}
    # blake3 with the old 8 MiB reads too: the read buffer size matters (cache-resident or not).
    # and with every file hashed on one thread (big files are split over two now).
    one = 1 << 62
    kinds = [
        ("size", prefetch.CHUNK, one),
        ("crc32", prefetch.CHUNK, one),
        ("blake3", prefetch.CHUNK, prefetch.SPLIT_HASH_BYTES),
        ("blake3", prefetch.CHUNK, one),
    ]
    if prefetch.CHUNK != 8 << 20:
        kinds.append(("blake3", 8 << 20, one))
    for cache in ("warm", "cold"):
        secs: dict[str, list[float]] = {}
        for _ in range(trials):  # interleaved: every kind once per trial
            for verify, read_size, split in kinds:
                name = verify if read_size == prefetch.CHUNK else f"{verify}-{read_size >> 20}MiB"
                if verify == "blake3" and split == one and read_size == prefetch.CHUNK:
                    name += "-1thread"
                if cache == "cold":
                    drop_caches()
                else:
                    prefetch.Prefetcher(ckpt, files, threads, "size").result()  # type: ignore[arg-type]
                t0 = time.monotonic()
                res = prefetch.Prefetcher(ckpt, files, threads, verify, read_size, split).result()  # type: ignore[arg-type]
                secs.setdefault(name, []).append(time.monotonic() - t0)
                assert not res.bad, res.bad
        for name, vals in secs.items():
            out[f"{name}/{cache}"] = statistics.median(vals)
            log(f"verify {name:12s} {cache}: {out[f'{name}/{cache}']:.3f}s")
    out["load_avg"] = os.getloadavg()
    return out


def run(args: argparse.Namespace) -> int:
    if args.replot:
        out = Path(args.out)
        doc = json.loads((out / "results.json").read_text())
        summary = summarize(doc["runs"])
        if doc.get("disk_floor_seconds"):
            summary["disk-floor/cold"] = floor_row(doc["disk_floor_seconds"]["median"], summary)
        print(render(out, summary))
        return 0
    if os.geteuid() != 0:
        print(
            "rekindle-dev bench local: needs root (CRIU, namespaces, drop_caches)", file=sys.stderr
        )
        return 2
    if not args.criu_prefix:
        print("--criu-prefix is required: pass scripts/build-criu's output", file=sys.stderr)
        return 2
    prefix = Path(args.criu_prefix)
    criu = {"stock": prefix / "stock" / "criu", "patched": prefix / "patched" / "criu"}
    criu["stock+prefetch"] = criu["stock"]
    criu["patched-size"] = criu["patched-signed"] = criu["patched"]
    for p in criu.values():
        if not os.access(p, os.X_OK):
            print(f"no CRIU at {p}: run scripts/build-criu and pass its output", file=sys.stderr)
            return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else None
    if model is None:
        from rekindle_dev.models import generate_tiny_model

        model = generate_tiny_model(work / "tiny")
    factory = AgentFactory(work, model, criu["patched"])
    key_file = work / "signing-key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    key_file.chmod(0o600)
    ckpt = factory.checkpoints / f"bench-{int(time.time())}"
    log("booting once to make the checkpoint (signed)")
    agent = factory.start(
        name="make-checkpoint", signing_key_file=str(key_file), tensor_parallel_size=args.tp
    )
    try:
        agent.wait_ready(900)
        man = agent.client.checkpoint(str(ckpt), timeout=900)
    finally:
        agent.stop()
    size = sum(int(f["size"]) for f in man["files"])
    log(f"checkpoint {ckpt}: {size / 2**30:.2f} GiB")
    verify = verify_cost(ckpt, 8, args.trials) if args.verify_cost else None
    runs: list[dict[str, Any]] = []
    floors: list[float] = []
    order = [v for v in args.variants.split(",") if v]
    for trial in range(args.trials):
        floors.append(disk_floor(ckpt, man["files"]))
        log(f"trial {trial} disk-read floor (cold, parallel): {floors[-1]:.2f}s")
        for cache in ("warm", "cold"):
            for variant in order:
                if cache == "cold":
                    drop_caches()
                name = f"{variant}-{cache}-{trial}"
                r = one_run(factory, variant, ckpt, criu, name, key_file, args.tp, cache == "warm")
                r.update(cache=cache, trial=trial)
                runs.append(r)
                log(f"trial {trial} {variant:8s} {cache}: first token {r['ttft']:.2f}s")
    remove_tree(ckpt)  # its pages images are immutable once proven: rm -rf cannot
    summary = summarize(runs)
    floor = {"seconds": floors, "median": statistics.median(floors)} if floors else None
    if floors:
        summary["disk-floor/cold"] = floor_row(statistics.median(floors), summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": command_line(args),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": host_facts(load_avg_at_end=os.getloadavg()),
        "checkpoint_bytes": size,
        "verify_cost_seconds": verify,
        "disk_floor_seconds": floor,
        "checkpoint_timings": man["timings"],
        "variants": VARIANTS,
        "summary": summary,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    print(render(out, summary))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--criu-prefix", default="", help="scripts/build-criu's output directory")
    p.add_argument("--model", help="model directory (default: generate the tiny model)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument(
        "--tp", type=int, default=1, help="vLLM tensor-parallel ranks (CPU: a worker process each)"
    )
    p.add_argument("--variants", default="naive,stock,stock+prefetch,patched")
    p.add_argument("--work", default="/var/tmp/rekindle-bench", help="scratch (on disk)")
    p.add_argument("--out", default="docs/bench/local")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
    p.add_argument(
        "--verify-cost",
        action="store_true",
        help="also time the restore's content check alone (size, crc32, blake3; warm, cold)",
    )
