"""`rekindle-dev bench local`: naive boot vs CRIU restore, on this machine, launch to first token.

Every agent variant runs the real agent as PID 1 of a fresh PID+mount
namespace with an empty /dev/shm (rekindle_dev.harness), like a new pod:
  naive    no checkpoint: vLLM boots
  plain-criu  no agent and none of Rekindle: stock CRIU dumped the whole
           vLLM server (weights and KV cache in the image, no sleep) and
           restores it, /dev/shm copied back (rekindle_dev.plain_criu): the
           simplest alternative a user could script, so each of Rekindle's
           parts shows its own gain
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

Warm and cold are the same for every arm. Warm: just before the launch
(untimed) `vmtouch -t` reads everything the arm reads at start into the page
cache: the runtime (the interpreter's standard library, the Python env with
torch and vLLM, the project) plus the arm's data (the model for naive, the
checkpoint for a restore, the whole-server image for plain-criu). Cold:
`echo 3 > /proc/sys/vm/drop_caches` just before the launch (the guest's page
cache only: a virtual disk may still be cached by the host; results record the
disk-read floor and what the kernel says of the disk). Every run records how
much of its runtime and of its data were in the page cache just before it
started (rekindle_agent.restoring.residency), so each row's label is proven. Trials
interleave every arm, warm and cold, with the arms' order rotated per trial;
the cold disk-read floor (every checkpoint file read once, in parallel) is
measured once per trial before the cold runs. Ratios are per trial (naive's
run over the arm's run of the same trial and cache) and their median, beside
the ratio of the medians. Time to first token = launch to the answer of a
one-token completion (through the agent's proxy; plain-criu: vLLM's port).
Every naive boot's split into phases comes from its own vLLM log
(bench_common.parse_vllm_log). Results: JSON (with provenance), a Markdown
table and a PNG of stacked phase bars.
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

from rekindle_agent.mapped_files.immutable import remove_tree
from rekindle_agent.restoring import residency
from rekindle_contract.api import PATH_READYZ
from rekindle_store import resident_lock

from rekindle_dev import plain_criu
from rekindle_dev.bench_common import parse_vllm_log, provenance
from rekindle_dev.harness import AgentFactory, AgentProc
from rekindle_dev.ports import free_port

# The agent's settings per variant (AgentArgs fields).
VARIANTS: dict[str, dict[str, Any]] = {
    "naive": {"restore_policy": "never"},
    # Not the agent: stock CRIU over the whole server (rekindle_dev.plain_criu).
    "plain-criu": {},
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
# Parts of reload_weights the agent records beside it (reading or mapping the dump, then
# the CPU GEMM repack): kept per run, never stacked on top of reload_weights in a plot.
RELOAD_PARTS = ("reload_weights.read", "reload_weights.repack")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def runtime_paths() -> list[Path]:
    """What every arm's processes read at start, whatever they restore: this interpreter's
    standard library and site directories (the checkout's .venv and, through its .pth,
    the shared env with torch and vLLM) and the project's packages (installed editable,
    so not on sys.path). The agent, vLLM and a restored tree all run this interpreter."""
    import rekindle_agent
    import rekindle_contract
    import rekindle_weights

    found = [Path(p).resolve() for p in sys.path if p and Path(p).is_dir()]
    packages = (rekindle_agent, rekindle_contract, rekindle_weights)
    found += [Path(str(m.__file__)).resolve().parent for m in packages]
    found.append(Path(sys.executable).resolve())
    unique = sorted(set(found), key=lambda p: len(p.parts))
    out: list[Path] = []
    for p in unique:  # drop paths inside one already listed (the stdlib's lib-dynload)
        if not any(p.is_relative_to(q) for q in out):
            out.append(p)
    return sorted(out)


def warm_paths(paths: list[Path]) -> None:
    """Read paths (files or trees) into the page cache: `vmtouch -t`, the tool for it (no
    check is wanted here, unlike a restore's prefetch, which hashes what it reads).

    Twice: pages read once sit on the kernel's inactive list and are the first it evicts
    when memory runs short (a 3B arm's data and runtime fill most of this VM), so a
    single pass left some rows partly cold; a second touch marks them in use, as the
    files of a node that served before are."""
    vmtouch = resident_lock.vmtouch_binary()
    if vmtouch is None:
        raise RuntimeError("vmtouch is not installed: apt-get install vmtouch")
    for _ in range(2):
        subprocess.run([vmtouch, "-t", "-q", *map(str, paths)], check=True, timeout=1800)


def residency_of(paths: list[Path]) -> dict[str, Any]:
    """residency() summed over paths: bytes, resident_bytes, percent."""
    total = resident = 0
    for p in paths:
        r = residency.residency(p)
        total += int(r["bytes"])
        resident += int(r["resident_bytes"])
    pct = round(100.0 * resident / total, 1) if total else 100.0
    return {"bytes": total, "resident_bytes": resident, "percent": pct}


def data_paths(
    variant: str, model: Path, ckpt: Path, plain: plain_criu.PlainImage | None
) -> list[Path]:
    """The arm's own data, read at start: the model (naive), the whole-server image
    (plain-criu) or the checkpoint (every agent restore)."""
    if variant == "naive":
        return [model]
    if variant == "plain-criu":
        assert plain is not None, "plain-criu needs its whole-server image"
        return plain.paths()
    return [ckpt]


def prepare_cache(cache: str, runtime: list[Path], data: list[Path]) -> dict[str, Any]:
    """Make the page cache what the row says (warm: runtime and data read; cold: dropped),
    then measure it: {"runtime": residency, "data": residency} just before the launch."""
    if cache == "cold":
        drop_caches()
    else:
        warm_paths([*runtime, *data])
    return {"runtime": residency_of(runtime), "data": residency_of(data)}


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
) -> dict[str, Any]:
    """One agent launch to first token, with the page cache as the caller left it."""
    settings = dict(VARIANTS[variant])
    if tp != 1:  # vLLM's tensor-parallel ranks (on CPU, one worker process each)
        settings["tensor_parallel_size"] = tp
    if settings.pop("signed", False):
        settings["signing_key_file"] = str(key_file)
    if variant != "naive":
        settings.update(restore_from=str(ckpt), criu=str(criu[variant]))
    for stale in (CRIU_STATS, CRIU_LOG, VLLM_LOG):  # the run writes them anew
        (factory.run_dir / stale).unlink(missing_ok=True)
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
        for p in (*RESTORE_PHASES, *RELOAD_PARTS):
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
    return out


def plain_run(criu: Path, image: plain_criu.PlainImage, work: Path) -> dict[str, Any]:
    """One plain-criu restore to first token (rekindle_dev.plain_criu), in one_run's shape."""
    r = plain_criu.restore_once(criu, image, work)
    phases = {"criu_restore": r.criu_s or 0.0, "to_first_token": r.ttft - (r.criu_s or 0.0)}
    return {
        "variant": "plain-criu",
        "ttft": r.ttft,
        "phases": phases,
        "mmap": False,
        "criu": criu_profile(work, stats="stats-restore", log_name="restore.log"),
        "load_avg": os.getloadavg(),
    }


CRIU_STATS, CRIU_LOG, VLLM_LOG = "stats-restore", "restore.log", "vllm.log"


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


def criu_profile(
    run_dir: Path, stats: str = "stats-restore", log_name: str = "restore.log"
) -> dict[str, float]:
    """Inside the criu_restore phase, from CRIU's own stats and -v4 log.

    Parsed by rekindle_agent.checkpointing.criu."""
    from rekindle_agent.checkpointing import criu as criu_mod

    out: dict[str, float] = {}
    try:
        stats_doc = criu_mod.parse_restore_stats((run_dir / stats).read_bytes())
        out["forking_s"] = stats_doc.get("forking_us", 0) / 1e6
        out["restore_s"] = stats_doc.get("restore_us", 0) / 1e6
        out["pages_restored"] = float(stats_doc.get("pages_restored", 0))
    except (OSError, ValueError) as e:
        log(f"no CRIU stats: {e}")
    try:
        prof = criu_mod.restore_log_profile((run_dir / log_name).read_text(errors="replace"))
        out.update({f"log_{k}": v for k, v in prof.items()})
    except OSError as e:
        log(f"no CRIU log: {e}")
    return out


RESTORE_VARIANTS = ("plain-criu", "stock", "stock+prefetch", "patched", "patched-size",
                    "patched-signed")  # fmt: skip


def _range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def per_trial_ratios(runs: list[dict[str, Any]], variant: str, cache: str) -> list[float]:
    """naive's first token over variant's, trial by trial (same trial, same cache), in trial
    order: the spread a skeptic wants beside the ratio of the medians."""
    numbered = [r for r in runs if r.get("trial") is not None]  # older results: none
    by_trial = {(r["variant"], r["cache"], r["trial"]): r["ttft"] for r in numbered}
    out = []
    for r in sorted(numbered, key=lambda r: r["trial"]):
        if (r["variant"], r["cache"]) != (variant, cache):
            continue
        naive = by_trial.get(("naive", cache, r.get("trial")))
        if naive is not None:
            out.append(round(naive / r["ttft"], 2))
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({(r["variant"], r["cache"]) for r in runs}):
        rs = [r for r in runs if (r["variant"], r["cache"]) == key]
        ttfts = [r["ttft"] for r in rs]
        phase_names = list(dict.fromkeys(p for r in rs for p in r["phases"]))
        row: dict[str, Any] = {
            "variant": key[0],
            "cache": key[1],
            "trials": len(rs),
            "ttft_median": statistics.median(ttfts),
            "ttft_min": min(ttfts),
            "ttft_max": max(ttfts),
            "ttft_trials": [round(t, 3) for t in ttfts],
            "phases_median": {
                p: statistics.median(r["phases"].get(p, 0.0) for r in rs) for p in phase_names
            },
            "mmap": any(r["mmap"] for r in rs),
        }
        out[f"{key[0]}/{key[1]}"] = row
        readies = [r["ready"] for r in rs if "ready" in r]
        if readies:
            row["ready_median"] = statistics.median(readies)
        # Residency just before each run: the arm's data (model, checkpoint or image) and the
        # runtime. Older results have residency_before (the checkpoint only, restores only).
        data = [r["cache_before"]["data"]["percent"] for r in rs if r.get("cache_before")]
        runtime = [r["cache_before"]["runtime"]["percent"] for r in rs if r.get("cache_before")]
        if not data:
            data = [r["residency_before"]["percent"] for r in rs if r.get("residency_before")]
        if data:
            row["residency_before_percent"] = _range(data)
        if runtime:
            row["runtime_residency_percent"] = _range(runtime)
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
            row["criu_median"] = {
                k: statistics.median(r.get("criu", {}).get(k, 0.0) for r in rs) for k in criu_keys
            }
    for cache in ("warm", "cold"):
        naive = out.get(f"naive/{cache}")
        for v in RESTORE_VARIANTS:
            s = out.get(f"{v}/{cache}")
            if naive and s:
                s["speedup_vs_naive"] = naive["ttft_median"] / s["ttft_median"]
                s["speedup_per_trial"] = per_trial_ratios(runs, v, cache)
        plain = out.get(f"plain-criu/{cache}")
        for v in RESTORE_VARIANTS[1:]:
            s = out.get(f"{v}/{cache}")
            if plain and s:
                s["speedup_vs_plain_criu"] = plain["ttft_median"] / s["ttft_median"]
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


def percent_cell(r: dict[str, Any] | None) -> str:
    """A residency range as a table cell: "median (min-max)", "-" when not recorded."""
    if not r:
        return "-"
    if r["min"] == r["max"]:
        return f"{r['median']:.1f}"
    return f"{r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f})"


def speed_cell(s: dict[str, Any]) -> str:
    """x naive as the ratio of the medians, with the per-trial ratios beside it."""
    if "speedup_vs_naive" not in s:
        return "-"
    trials = "/".join(f"{x:.1f}" for x in s.get("speedup_per_trial", []))
    return f"{s['speedup_vs_naive']:.1f}" + (f" ({trials})" if trials else "")


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| variant | cache | trials | TTFT median (s) | per trial (s) "
        "| x naive, median (per trial) | x plain CRIU | data in page cache before (%) "
        "| runtime in page cache before (%) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(summary.values(), key=lambda s: (s["cache"] != "warm", s["variant"] != "naive"))
    for s in rows:
        trials = ", ".join(f"{t:.2f}" for t in s.get("ttft_trials", []))
        vs_plain = f"{s['speedup_vs_plain_criu']:.2f}" if "speedup_vs_plain_criu" in s else "-"
        speed = speed_cell(s)
        if "vs_disk_floor" in s:
            speed += f"; {s['vs_disk_floor']:.2f}x the disk-read floor"
        lines.append(
            f"| {s['variant']}{' (mmap)' if s['mmap'] else ''} | {s['cache']} | {s['trials']} | "
            f"{s['ttft_median']:.2f} | {trials} | {speed} | {vs_plain} "
            f"| {percent_cell(s.get('residency_before_percent'))} "
            f"| {percent_cell(s.get('runtime_residency_percent'))} |"
        )
    lines += ["", "Median phase seconds:", ""]
    for s in rows:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in s["phases_median"].items())
        lines.append(f"- {s['variant']}/{s['cache']}: {parts}")
    lines += naive_split_lines(summary)
    criu_rows = [s for s in rows if s.get("criu_median")]
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
    parts = set(RELOAD_PARTS)  # inside reload_weights already
    phases = [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER) - parts)
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
    from rekindle_agent.restoring import prefetch

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
    from rekindle_agent.restoring import prefetch
    from rekindle_store import digests, manifest_io

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


def rotated(order: list[str], trial: int) -> list[str]:
    """The arms' order for a trial: rotated by one each trial, so no arm always runs first
    (after a drop, after the floor) or last."""
    k = trial % len(order) if order else 0
    return order[k:] + order[:k]


def make_checkpoint(factory: AgentFactory, ckpt: Path, key_file: Path, tp: int) -> dict[str, Any]:
    """Boot once and make the (signed) checkpoint every agent restore arm restores."""
    log("booting once to make the checkpoint (signed)")
    agent = factory.start(
        name="make-checkpoint", signing_key_file=str(key_file), tensor_parallel_size=tp
    )
    try:
        agent.wait_ready(900)
        return dict(agent.client.checkpoint(str(ckpt), timeout=900))
    finally:
        agent.stop()


def check_setup(args: argparse.Namespace) -> dict[str, Path] | str:
    """The CRIU binaries per variant, or why the bench cannot run here."""
    if os.geteuid() != 0:
        return "rekindle-dev bench local: needs root (CRIU, namespaces, drop_caches)"
    if not args.criu_prefix:
        return "--criu-prefix is required: pass scripts/build-criu's output"
    if resident_lock.vmtouch_binary() is None:
        return "vmtouch is not installed (warms and measures every arm): apt-get install vmtouch"
    prefix = Path(args.criu_prefix)
    criu = {"stock": prefix / "stock" / "criu", "patched": prefix / "patched" / "criu"}
    criu["stock+prefetch"] = criu["plain-criu"] = criu["stock"]
    criu["patched-size"] = criu["patched-signed"] = criu["patched"]
    for p in criu.values():
        if not os.access(p, os.X_OK):
            return f"no CRIU at {p}: run scripts/build-criu and pass its output"
    unknown = [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if unknown:
        return f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}"
    if "naive" not in args.variants.split(","):
        return "--variants must include naive: every ratio is against it"
    return criu


MEASURED = (
    "scripts/rekindle_dev/bench_local.py",
    "scripts/rekindle_dev/plain_criu.py",
    "scripts/rekindle_dev/models.py",
)


def run(args: argparse.Namespace) -> int:
    if args.replot:
        out = Path(args.out)
        doc = json.loads((out / "results.json").read_text())
        summary = summarize(doc["runs"])
        if doc.get("disk_floor_seconds"):
            summary["disk-floor/cold"] = floor_row(doc["disk_floor_seconds"]["median"], summary)
        print(render(out, summary))
        return 0
    criu = check_setup(args)
    if isinstance(criu, str):
        print(criu, file=sys.stderr)
        return 2
    load_start, started = os.getloadavg(), time.time()
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
    man = make_checkpoint(factory, ckpt, key_file, args.tp)
    size = sum(int(f["size"]) for f in man["files"])
    log(f"checkpoint {ckpt}: {size / 2**30:.2f} GiB")
    order = [v for v in args.variants.split(",") if v]
    plain = None
    if "plain-criu" in order:
        log("booting vLLM plainly and dumping the whole server with stock CRIU")
        plain = plain_criu.dump_whole_server(
            criu["plain-criu"], model, factory.served_name, free_port(), work / "plain"
        )
        log(f"whole-server image: {plain.bytes() / 2**30:.2f} GiB")
    verify = verify_cost(ckpt, 8, args.trials) if args.verify_cost else None
    runtime = runtime_paths()
    runs: list[dict[str, Any]] = []
    floors: list[float] = []
    for trial in range(args.trials):
        for cache in ("warm", "cold"):
            if cache == "cold":
                floors.append(disk_floor(ckpt, man["files"]))
                log(f"trial {trial} disk-read floor (cold, parallel): {floors[-1]:.2f}s")
            for variant in rotated(order, trial):
                before = prepare_cache(cache, runtime, data_paths(variant, model, ckpt, plain))
                if variant == "plain-criu":
                    assert plain is not None
                    r = plain_run(criu[variant], plain, work / "plain")
                else:
                    name = f"{variant}-{cache}-{trial}"
                    r = one_run(factory, variant, ckpt, criu, name, key_file, args.tp)
                r.update(cache=cache, trial=trial, cache_before=before)
                runs.append(r)
                log(
                    f"trial {trial} {variant:14s} {cache}: first token {r['ttft']:.2f}s "
                    f"(page cache before: data {before['data']['percent']:.1f}%, "
                    f"runtime {before['runtime']['percent']:.1f}%)"
                )
    remove_tree(ckpt)  # its pages images are immutable once proven: rm -rf cannot
    summary = summarize(runs)
    floor = {"seconds": floors, "median": statistics.median(floors)} if floors else None
    if floors:
        summary["disk-floor/cold"] = floor_row(statistics.median(floors), summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        **provenance(command_line(args), MEASURED, load_start, started, scratch=str(work)),
        "cold_means": COLD_MEANS,
        "runtime_paths": [str(p) for p in runtime],
        "checkpoint_bytes": size,
        "plain_criu_image_bytes": plain.bytes() if plain else None,
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


COLD_MEANS = (
    "the guest's page cache dropped (echo 3 > /proc/sys/vm/drop_caches) just before the "
    "launch; on a virtual machine the host may still cache the disk image, so compare the "
    "disk-read floor measured in the same run (GB/s) with what the disk really does"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--criu-prefix", default="", help="scripts/build-criu's output directory")
    p.add_argument("--model", help="model directory (default: generate the tiny model)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument(
        "--tp", type=int, default=1, help="vLLM tensor-parallel ranks (CPU: a worker process each)"
    )
    p.add_argument(
        "--variants",
        default="naive,plain-criu,stock,patched-signed",
        help=f"comma-separated, naive first; of {', '.join(VARIANTS)}",
    )
    p.add_argument("--work", default="/var/tmp/rekindle-bench", help="scratch (on disk)")
    p.add_argument("--out", default="docs/bench/local")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
    p.add_argument(
        "--verify-cost",
        action="store_true",
        help="also time the restore's content check alone (size, crc32, blake3; warm, cold)",
    )
