"""CRIU's kdat cache: restores with and without it, interleaved (docs/agent.md, kdat cache).

Two parts, both against the same CRIU binary, each trial running "off" and
"on" back to back in alternating order:
  small    a `sleep` process dumped once and restored many times: CRIU's setup
           (start to first fork, from its -v4 log) and the restore's wall time;
           "off" deletes /run/criu.kdat first, "on" runs kdat_cache.prepare
  agent    (--agent-trials > 0) the real agent restoring the tiny vLLM model,
           `patched-signed`, warm (rekindle_dev.bench_local.one_run):
           REKINDLE_KDAT_CACHE=off vs the default
Results: results.json (every trial, medians, load averages, the command),
results.md and results.png in --out.

    rekindle-dev bench kdat --criu-prefix $(scripts/build-criu | tail -1) \\
        --trials 10 --agent-trials 3 --out docs/bench/kdat
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rekindle_agent.checkpointing import criu as criu_mod
from rekindle_agent.mapped_files.immutable import remove_tree
from rekindle_agent.restoring import kdat_cache
from rekindle_agent.restoring.early import KDAT_CACHE_ENV

from rekindle_dev.bench_common import provenance
from rekindle_dev.bench_provenance import MEASURED_BY, provenance_line

MODES = ("off", "on")


def log(msg: str) -> None:
    print(f"[bench kdat {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def set_mode(mode: str, binary: Path, cache_root: Path) -> None:
    """off: no cache file where CRIU looks; on: the agent's cache step."""
    dest = Path(kdat_cache.rundir_of(binary.read_bytes())) / kdat_cache.KDAT_NAME
    if mode == "off":
        dest.unlink(missing_ok=True)
    else:
        out = kdat_cache.prepare(str(binary), str(cache_root))
        if out.action == "skipped":
            raise RuntimeError(f"kdat cache step skipped: {out.detail}")


def wait_gone(pid: int) -> None:
    for _ in range(1000):
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.01)
    raise RuntimeError(f"pid {pid} did not go away")


def small_trials(binary: Path, trials: int, work: Path) -> list[dict[str, Any]]:
    images = work / "images"
    images.mkdir(parents=True)
    # No inherited files: CRIU checks a regular file's size, and a log grows.
    quiet = subprocess.DEVNULL
    sleeper = subprocess.Popen(
        ["setsid", "sleep", "100000"], stdin=quiet, stdout=quiet, stderr=quiet
    )
    time.sleep(0.3)
    dump = [str(binary), "dump", "-t", str(sleeper.pid), "-D", str(images)]
    res = subprocess.run(
        [*dump, "-o", "dump.log", "-v4", "--shell-job"], capture_output=True, check=False
    )
    if res.returncode != 0:
        sleeper.kill()
        raise RuntimeError((images / "dump.log").read_text()[-2000:])
    sleeper.wait()
    pidfile = work / "pid"
    restore = [str(binary), "restore", "-d", "-D", str(images), "-o", "restore.log", "-v4"]
    restore += ["--shell-job", "--pidfile", str(pidfile)]
    runs: list[dict[str, Any]] = []
    for t in range(trials):
        for mode in MODES if t % 2 == 0 else MODES[::-1]:
            set_mode(mode, binary, work / "root")
            pidfile.unlink(missing_ok=True)
            t0 = time.monotonic()
            res = subprocess.run(restore, capture_output=True, check=False)
            wall = time.monotonic() - t0
            text = (images / "restore.log").read_text(errors="replace")
            if res.returncode != 0:
                raise RuntimeError(text[-2000:])
            pid = int(pidfile.read_text())
            os.kill(pid, signal.SIGKILL)
            wait_gone(pid)
            prof = criu_mod.restore_log_profile(text)
            r = {
                "mode": mode,
                "trial": t,
                "criu_setup_s": prof["setup_s"],
                "restore_wall_s": wall,
                "kdat_loaded": "Loaded kdat cache" in text,
                "load_avg": os.getloadavg(),
            }
            runs.append(r)
            log(f"small trial {t} {mode}: setup {r['criu_setup_s']:.4f}s wall {wall:.3f}s")
    return runs


def agent_trials(prefix: Path, trials: int, work: Path) -> list[dict[str, Any]]:
    from rekindle_dev import bench_local
    from rekindle_dev.harness import AgentFactory
    from rekindle_dev.models import generate_tiny_model

    binary = prefix / "patched" / "criu"
    criu = {"patched-signed": binary}
    factory = AgentFactory(work, generate_tiny_model(work / "tiny"), binary)
    key = work / "signing-key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    ckpt = factory.checkpoints / f"bench-{int(time.time())}"
    log("booting once to make the checkpoint (signed)")
    agent = factory.start(name="make-checkpoint", signing_key_file=str(key))
    try:
        agent.wait_ready(900)
        agent.client.checkpoint(str(ckpt), timeout=900)
    finally:
        agent.stop()
    runs: list[dict[str, Any]] = []
    try:
        for t in range(trials):
            for mode in MODES if t % 2 == 0 else MODES[::-1]:
                factory.env[KDAT_CACHE_ENV] = mode
                if mode == "off":
                    set_mode(mode, binary, factory.checkpoints)
                r = bench_local.one_run(factory, "patched-signed", ckpt, criu, f"{mode}-{t}", key)
                text = (factory.run_dir / "restore.log").read_text(errors="replace")
                r.update(mode=mode, trial=t, kdat_loaded="Loaded kdat cache" in text)
                runs.append(r)
                log(
                    f"agent trial {t} {mode}: setup {r['criu'].get('log_setup_s', 0):.3f}s "
                    f"agent_start {r['phases']['agent_start']:.3f}s ttft {r['ttft']:.3f}s"
                )
    finally:
        remove_tree(ckpt)
    return runs


def medians(runs: list[dict[str, Any]], keys: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        m: {k: statistics.median(get(r) for r in runs if r["mode"] == m) for k, get in keys.items()}
        for m in MODES
        if any(r["mode"] == m for r in runs)
    }


AGENT_KEYS = {
    "criu_setup_s": lambda r: r["criu"].get("log_setup_s", 0.0),
    "criu_restore": lambda r: r["phases"].get("criu_restore", 0.0),
    "agent_start": lambda r: r["phases"]["agent_start"],
    "prefetch_wait": lambda r: r["phases"].get("prefetch_wait", 0.0),
    "ttft": lambda r: r["ttft"],
}
SMALL_KEYS = {
    "criu_setup_s": lambda r: r["criu_setup_s"],
    "restore_wall_s": lambda r: r["restore_wall_s"],
}


def table(doc: dict[str, Any]) -> str:
    lines = [
        f"Command: `{doc['command']}`",
        "",
        provenance_line(doc),
        "",
    ]
    for part in ("small", "agent"):
        med = doc["summary"].get(part) or {}
        if not med:
            continue
        keys = list(next(iter(med.values())))
        lines += [f"### {part} (median of {doc['trials'][part]} interleaved trials, seconds)", ""]
        lines += ["| kdat cache | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for mode, vals in med.items():
            lines.append(f"| {mode} | " + " | ".join(f"{vals[k]:.3f}" for k in keys) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("small", "agent") if doc["summary"].get(p)]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        med = doc["summary"][part]
        keys = list(next(iter(med.values())))
        width = 0.8 / len(med)
        for i, (mode, vals) in enumerate(med.items()):
            xs = [j + i * width for j in range(len(keys))]
            ax.bar(xs, [vals[k] for k in keys], width, label=f"kdat cache {mode}")
        ax.set_xticks([j + width / 2 for j in range(len(keys))], keys, rotation=15)
        ax.set_ylabel("seconds (median)")
        ax.set_title(part)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench kdat: needs root (CRIU)", file=sys.stderr)
        return 2
    prefix = Path(args.criu_prefix)
    binary = prefix / "patched" / "criu"
    if not os.access(binary, os.X_OK):
        print(f"no CRIU at {binary}: pass scripts/build-criu's output", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-kdat-", dir=args.work))
    started, load_start = time.time(), os.getloadavg()
    try:
        runs = {"small": small_trials(binary, args.trials, work / "small")}
        runs["agent"] = (
            agent_trials(prefix, args.agent_trials, work / "agent") if args.agent_trials else []
        )
    finally:
        remove_tree(work)  # the images CRIU wrote (a checkpoint's may be immutable)
    cmd = f"rekindle-dev bench kdat --criu-prefix {args.criu_prefix} "
    cmd += f"--trials {args.trials} --agent-trials {args.agent_trials} --out {args.out}"
    doc = {
        **provenance(cmd, MEASURED_BY["kdat"], load_start, started, args.work),
        "trials": {"small": args.trials, "agent": args.agent_trials},
        "summary": {
            "small": medians(runs["small"], SMALL_KEYS),
            "agent": medians(runs["agent"], AGENT_KEYS),
        },
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    text = table(doc)
    (out / "results.md").write_text(text + "\n")
    plot(doc, out / "results.png")
    print(text)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--criu-prefix", required=True, help="scripts/build-criu's output directory")
    p.add_argument("--trials", type=int, default=10, help="small-process restores per mode")
    p.add_argument("--agent-trials", type=int, default=3, help="tiny-model agent restores per mode")
    p.add_argument("--work", default="/var/tmp", help="scratch directory (on disk)")
    p.add_argument("--out", default="docs/bench/kdat")
