"""`rekindle-dev bench suite`: time `make test` target by target, with provenance.

"make test fits its budget" is a claim like any other number in the README: this
runs the targets `make test` runs, in its order, in this checkout, and records
each one's wall time, exit status, pytest's summary line and its slowest tests
(the `--durations` table every suite prints), with the commit, the machine and
its load, into docs/bench/test-suite/results.{json,md}. It stops at the first
failing target, as make does, and says which. Run it on a clean clone with warm
caches (what CI does) to measure what CI will take.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rekindle_dev.bench_common import REPO, md_table, provenance

# What `make test` runs, in its order (the Makefile's test target).
TARGETS = (
    "test-preflight",
    "lint",
    "test-unit",
    "test-packaging",
    "test-criu",
    "test-vllm",
    "test-cluster",
)
BUDGET_S = 40 * 60
MEASURED = ("tests", "Makefile", "scripts", "operator", "images", "charts", "pyproject.toml")
# pytest's last line ("== 12 passed, 1 skipped in 30.1s ==") and its --durations rows.
_SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed|error|errors).*) in [\d.]+s")
_DURATION = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(\S+)")


@dataclass
class TargetRun:
    name: str
    seconds: float
    returncode: int
    summary: str = ""  # pytest's counts, "" for targets that run no pytest
    slowest: list[dict[str, Any]] = field(default_factory=list)


def parse_output(text: str, top: int = 10) -> tuple[str, list[dict[str, Any]]]:
    """pytest's summary counts and its slowest durations rows (seconds, phase, test)."""
    summary = ""
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        if m := _SUMMARY.match(line.strip()):
            summary = m.group(1)
        elif m := _DURATION.match(line.strip()):
            rows.append({"seconds": float(m.group(1)), "phase": m.group(2), "test": m.group(3)})
    rows.sort(key=lambda r: -r["seconds"])
    return summary, rows[:top]


def run_target(name: str, log: Path) -> TargetRun:
    """make NAME in the checkout, its output streamed to the terminal and appended to log."""
    t0 = time.monotonic()
    out: list[str] = []
    with log.open("a") as f:
        f.write(f"\n===== make {name}\n")
        proc = subprocess.Popen(
            ["make", "-C", str(REPO), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
            out.append(line)
        rc = proc.wait()
    summary, slowest = parse_output("".join(out))
    return TargetRun(name, round(time.monotonic() - t0, 1), rc, summary, slowest)


def table(doc: dict[str, Any]) -> str:
    rows = [
        [r["name"], f"{r['seconds'] / 60:.1f}", str(r["returncode"]), r["summary"] or "-"]
        for r in doc["targets"]
    ]
    total = doc["total_seconds"]
    verdict = "within" if total <= BUDGET_S and doc["passed"] else "NOT within"
    text = [
        f"`make test`, target by target: {total / 60:.1f} min in all, {verdict} the "
        f"{BUDGET_S // 60}-minute budget; {'every target passed' if doc['passed'] else 'FAILED'}."
        f" Made from commit {doc['commit'][:10]} on {doc['date']}.",
        "",
        md_table(["target", "minutes", "exit", "pytest"], rows),
        "Slowest tests per target (pytest --durations):",
        "",
    ]
    for r in doc["targets"]:
        for s in r["slowest"][:5]:
            text.append(f"- {r['name']}: {s['seconds']:.1f} s {s['phase']} {s['test']}")
    return "\n".join(text) + "\n"


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.replot:
        doc = json.loads((out / "results.json").read_text())
        print(table(doc))
        (out / "results.md").write_text(table(doc))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    log = Path(args.log)
    log.write_text("")
    load_start, started = os.getloadavg(), time.time()
    runs: list[TargetRun] = []
    for name in args.targets.split(","):
        runs.append(run_target(name, log))
        print(f"[bench suite] make {name}: {runs[-1].seconds:.0f} s, exit {runs[-1].returncode}")
        if runs[-1].returncode != 0:
            break
    doc = {
        **provenance(f"rekindle-dev bench suite --out {args.out}", MEASURED, load_start, started),
        "budget_seconds": BUDGET_S,
        "total_seconds": round(sum(r.seconds for r in runs), 1),
        "passed": all(r.returncode == 0 for r in runs)
        and len(runs) == len(args.targets.split(",")),
        "targets": [asdict(r) for r in runs],
        "log": str(log),
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    text = table(doc)
    (out / "results.md").write_text(text)
    print(text)
    return 0 if doc["passed"] else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default=",".join(TARGETS), help="make targets, in order")
    p.add_argument("--out", default="docs/bench/test-suite")
    p.add_argument("--log", default="/var/tmp/rekindle-make-test.log", help="make's whole output")
    p.add_argument("--replot", action="store_true", help="only rewrite results.md from the JSON")
