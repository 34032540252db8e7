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
each with a warm and a cold page cache (`echo 3 > /proc/sys/vm/drop_caches`),
for N trials, interleaved. Time to first token = agent launch to the answer of
a one-token completion through the agent's proxy. Results: JSON, a Markdown
table and a PNG of stacked phase bars.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from rekindle_agent.immutable import remove_tree
from rekindle_contract.api import PATH_READYZ

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
) -> dict[str, Any]:
    settings = dict(VARIANTS[variant])
    if settings.pop("signed", False):
        settings["signing_key_file"] = str(key_file)
    if variant != "naive":
        settings.update(checkpoint=str(ckpt), criu=str(criu[variant]))
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
    return {
        "variant": variant,
        "ttft": ttft,
        "ready": ready,
        "phases": phases,
        "mmap": bool(st.raw.get("restored_with_mmap")),
        "prefetch_total": flow.get("prefetch_total"),
    }


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
    for cache in ("warm", "cold"):
        naive = out.get(f"naive/{cache}")
        for v in ("stock", "stock+prefetch", "patched", "patched-size", "patched-signed"):
            s = out.get(f"{v}/{cache}")
            if naive and s:
                s["speedup_vs_naive"] = naive["ttft_median"] / s["ttft_median"]
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| variant | cache | trials | TTFT median (s) | min-max (s) | x faster than naive |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        speed = f"{s['speedup_vs_naive']:.1f}" if "speedup_vs_naive" in s else "1.0"
        lines.append(
            f"| {s['variant']}{' (mmap)' if s['mmap'] else ''} | {s['cache']} | {s['trials']} | "
            f"{s['ttft_median']:.2f} | {s['ttft_min']:.2f}-{s['ttft_max']:.2f} | {speed} |"
        )
    lines += ["", "Median phase seconds:", ""]
    for s in summary.values():
        parts = ", ".join(f"{k} {v:.3f}" for k, v in s["phases_median"].items())
        lines.append(f"- {s['variant']}/{s['cache']}: {parts}")
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
    return " ".join([*parts, f"--out {args.out}"])


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
    for cache in ("warm", "cold"):
        for verify in ("size", "crc32", "blake3"):
            secs = []
            for _ in range(trials):
                if cache == "cold":
                    drop_caches()
                else:
                    prefetch.Prefetcher(ckpt, files, threads, "size").result()  # type: ignore[arg-type]
                t0 = time.monotonic()
                res = prefetch.Prefetcher(ckpt, files, threads, verify).result()  # type: ignore[arg-type]
                secs.append(time.monotonic() - t0)
                assert not res.bad, res.bad
            out[f"{verify}/{cache}"] = statistics.median(secs)
            log(f"verify {verify:6s} {cache}: {out[f'{verify}/{cache}']:.3f}s")
    return out


def run(args: argparse.Namespace) -> int:
    if args.replot:
        out = Path(args.out)
        doc = json.loads((out / "results.json").read_text())
        print(render(out, summarize(doc["runs"])))
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
    agent = factory.start(name="make-checkpoint", signing_key_file=str(key_file))
    try:
        agent.wait_ready(900)
        man = agent.client.checkpoint(str(ckpt), timeout=900)
    finally:
        agent.stop()
    size = sum(int(f["size"]) for f in man["files"])
    log(f"checkpoint {ckpt}: {size / 2**30:.2f} GiB")
    verify = verify_cost(ckpt, 8, args.trials) if args.verify_cost else None
    runs: list[dict[str, Any]] = []
    order = [v for v in args.variants.split(",") if v]
    for trial in range(args.trials):
        for cache in ("warm", "cold"):
            for variant in order:
                if cache == "cold":
                    drop_caches()
                r = one_run(factory, variant, ckpt, criu, f"{variant}-{cache}-{trial}", key_file)
                r.update(cache=cache, trial=trial)
                runs.append(r)
                log(f"trial {trial} {variant:8s} {cache}: first token {r['ttft']:.2f}s")
    remove_tree(ckpt)  # its pages images are immutable once proven: rm -rf cannot
    summary = summarize(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": command_line(args),
        "host": {
            "node": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(),
        },
        "checkpoint_bytes": size,
        "verify_cost_seconds": verify,
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
    p.add_argument("--variants", default="naive,stock,stock+prefetch,patched")
    p.add_argument("--work", default="/var/tmp/rekindle-bench", help="scratch (on disk)")
    p.add_argument("--out", default="docs/bench/local")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
    p.add_argument(
        "--verify-cost",
        action="store_true",
        help="also time the restore's content check alone (size, crc32, blake3; warm, cold)",
    )
