"""Whether a results file still describes the code: its recorded commit against HEAD.

Every results file carries bench_common.provenance(): the commit it was made from,
whether that tree had uncommitted changes, and the repository paths whose code its
numbers depend on (measured_paths). `rekindle-dev bench report` names the file behind
each figure and marks it STALE when it cannot prove the numbers still hold: no
commit recorded, a commit this repository lacks, measured code changed between that
commit and HEAD, or measured code changed in the working tree now. A file made from
a dirty tree is marked so too: no commit holds the code it measured.

Files written before the benches recorded a commit get one recovered from git
history (recover()): the commit that last wrote the file, which holds the file as
it is, marked "provenance": "recovered from git history". Their numbers were
measured from a tree at or before that commit, so the check is an approximation,
and the report says so.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rekindle_dev.bench_common import MEASURED_ALWAYS, REPO

RECOVERED = "recovered from git history"
_SHOW = 4  # changed paths named in a reason; the rest are counted

_DEV = "scripts/rekindle_dev/"
# What each bench measures besides MEASURED_ALWAYS: its own module and what it drives.
# The benches pass theirs to provenance(); the report assumes them for a file that
# records none, and recover() writes them.
MEASURED_BY: dict[str, tuple[str, ...]] = {
    "local": (_DEV + "bench_local.py", _DEV + "models.py", _DEV + "smollm2.py"),
    "ladder": (_DEV + "bench_ladder.py", _DEV + "bench_local.py", _DEV + "ladder.py"),
    "criu": ("scripts/bench-criu",),
    "density": ("scripts/bench-criu", _DEV + "bench_density.py"),
    "weights": (_DEV + "bench_weights.py", _DEV + "vllm_runner.py", _DEV + "models.py"),
    "warm": (_DEV + "bench_warm.py",),
    "kdat": (_DEV + "bench_kdat.py", _DEV + "bench_local.py", _DEV + "models.py"),
    "kv": (_DEV + "bench_kv.py", _DEV + "smollm2.py"),
    "mm": (_DEV + "bench_mm.py", _DEV + "vlm.py"),
    "naive": (_DEV + "bench_report.py", _DEV + "models.py"),
    "cluster": (
        "operator/rekindle_operator",
        "charts/rekindle",
        "images/runtime",
        "images/operator",
        "examples/smollm2-cpu.yaml",
        "scripts/build-image",
        "scripts/demo",
    ),
    "cluster-up": ("scripts/local-cluster", "scripts/build-kubernetes", "scripts/bench-cluster-up"),
    "store": (_DEV + "bench_store.py", _DEV + "seaweedfs.py", "scripts/build-seaweedfs"),
    "proxy": (
        _DEV + "bench_proxy.py",
        _DEV + "harness.py",
        _DEV + "models.py",
        "images/runtime/rekindle_agent/serving",
    ),
    "gpu": (
        _DEV + "gpu_probe.py",
        _DEV + "cuda_checkpoint_cli.py",
        "images/runtime/rekindle_node/nvidia_fds.py",
        "images/runtime/rekindle_agent/checkpointing/criu.py",
        "criu-patches",
    ),
    "scale-from-zero": (
        "operator/rekindle_operator",
        "charts/rekindle",
        "images/runtime",
        "scripts/local-cluster",
        _DEV + "bench_scale_from_zero.py",
    ),
    "load-step": (
        "operator/rekindle_operator",
        "charts/rekindle",
        "images/runtime",
        "scripts/local-cluster",
        _DEV + "bench_load_step.py",
        _DEV + "bench_scale_from_zero.py",
    ),
    "scale-out": (
        "operator/rekindle_operator",
        "charts/rekindle",
        "images/runtime",
        "scripts/local-cluster",
        _DEV + "bench_scale_out.py",
        _DEV + "local_s3.py",
    ),
}


def bench_of(rel: str) -> str:
    """Which bench wrote a results file, from its path under docs/bench ("" if unknown)."""
    if rel == "cluster-up.json":
        return "cluster-up"
    if "density" in rel:
        return "density"
    top = rel.split("/", 1)[0]
    if top == "local-tp2":
        return "local"
    if top == "report":
        return "naive"
    return top if top in MEASURED_BY else ""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60, check=False
    )


def is_commit(repo: Path, commit: str) -> bool:
    """True if commit names a commit of repo."""
    return bool(commit) and _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


# Documentation inside a measured directory (criu-patches/README.md) measures nothing.
NOT_CODE = (":(exclude)*.md",)


def changed_since(repo: Path, commit: str, paths: Sequence[str]) -> list[str]:
    """Files under paths that differ between commit and HEAD (git diff COMMIT HEAD),
    Markdown left out."""
    res = _git(repo, "diff", "--name-only", commit, "HEAD", "--", *paths, *NOT_CODE)
    if res.returncode != 0:
        raise RuntimeError(f"git diff {commit} HEAD failed: {res.stderr.strip()}")
    return [ln for ln in res.stdout.splitlines() if ln]


def uncommitted(repo: Path, paths: Sequence[str]) -> list[str]:
    """Files under paths with changes not committed yet (modified, staged, or new)."""
    res = _git(repo, "status", "--porcelain", "--", *paths, *NOT_CODE)
    if res.returncode != 0:
        raise RuntimeError(f"git status failed: {res.stderr.strip()}")
    return [ln[3:].split(" -> ")[-1] for ln in res.stdout.splitlines() if ln]


def _named(files: list[str]) -> str:
    more = f" (+{len(files) - _SHOW} more)" if len(files) > _SHOW else ""
    return ", ".join(files[:_SHOW]) + more


@dataclass(frozen=True)
class Status:
    """What the report says about one results file."""

    path: str  # as the reader finds it, e.g. docs/bench/kv/results.json
    commit: str = ""
    date: str = ""
    stale: tuple[str, ...] = ()  # why its numbers may no longer hold
    dirty: bool = False  # made from a tree with uncommitted changes to measured code
    recovered: bool = False  # commit and date recovered from git history
    measured: tuple[str, ...] = field(default=(), compare=False)

    @property
    def label(self) -> str:
        if self.stale:
            return "STALE"
        return "DIRTY TREE" if self.dirty else "current"

    @property
    def current(self) -> bool:
        return self.label == "current"

    def cite(self) -> str:
        """The file with its commit and date, and a visible mark unless it is current."""
        what = [f"commit {self.commit[:10]}" if self.commit else "no commit recorded"]
        if self.date:
            what.append(self.date)
        if self.recovered:
            what.append("provenance recovered from git history")
        mark = "" if self.current else f"; **{self.label}**"
        return f"`{self.path}` ({', '.join(what)}{mark})"

    def why(self) -> str:
        """One sentence for a non-current file: every reason it is marked."""
        reasons = list(self.stale)
        if self.dirty:
            reasons.append("made from a working tree with uncommitted changes to its measured code")
        return "; ".join(reasons)


def check(
    doc: dict[str, Any], shown: str, repo: Path = REPO, default: Sequence[str] = ()
) -> Status:
    """The Status of one results file: doc its JSON, shown its path for the reader,
    default the measured paths to assume where the file records none."""
    commit = str(doc.get("commit") or "")
    date = str(doc.get("date") or (doc.get("meta") or {}).get("date") or doc.get("started") or "")
    paths = tuple(doc.get("measured_paths") or sorted({*MEASURED_ALWAYS, *default}))

    def status(*stale: str) -> Status:
        return Status(
            path=shown,
            commit=commit,
            date=date,
            stale=stale,
            dirty=bool(doc.get("dirty")),
            recovered=doc.get("provenance") == RECOVERED,
            measured=paths,
        )

    if not commit:
        return status("no commit recorded: nothing shows which code it measured")
    if not is_commit(repo, commit):
        return status(f"commit {commit[:10]} is not in this repository")
    reasons = []
    changed = changed_since(repo, commit, paths)
    if changed:
        reasons.append(f"measured code changed since {commit[:10]}: {_named(changed)}")
    local = uncommitted(repo, paths)
    if local:
        reasons.append(f"measured code has uncommitted changes now: {_named(local)}")
    return status(*reasons)


# -- files made before the benches recorded a commit ------------------------------------


def last_commit(repo: Path, rel: str) -> tuple[str, str]:
    """(hash, committer date ISO) of the last commit that wrote rel; ("", "") if none."""
    res = _git(repo, "log", "-1", "--format=%H %cI", "--", rel)
    parts = res.stdout.split()
    return (parts[0], parts[1]) if res.returncode == 0 and len(parts) == 2 else ("", "")


def recover(path: Path, measured: Sequence[str], repo: Path = REPO) -> bool:
    """Give a results file without a commit the one that last wrote it, from git history.

    Keeps a date the file recorded itself (when it was measured) and takes the
    commit's date otherwise; writes measured_paths (MEASURED_ALWAYS plus measured)
    and "provenance": RECOVERED. Returns False, changing nothing, where the file
    has a commit already or git has no commit of it.
    """
    doc: dict[str, Any] = json.loads(path.read_text())
    if doc.get("commit"):
        return False
    rel = str(path.resolve().relative_to(repo.resolve()))
    commit, committed = last_commit(repo, rel)
    if not commit:
        return False
    own = doc.get("date") or (doc.get("meta") or {}).get("date")
    doc.update(
        commit=commit,
        date=own or committed,
        date_source="recorded by the bench" if own else "the commit's date",
        provenance=RECOVERED,
        measured_paths=sorted({*MEASURED_ALWAYS, *measured}),
    )
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return True


def provenance_line(doc: dict[str, Any]) -> str:
    """One line for a bench's own results.md: the commit, the date and the loads it recorded."""
    commit = str(doc.get("commit") or "")
    parts = [f"commit {commit[:10]}" if commit else "commit not recorded"]
    if doc.get("dirty"):
        parts[0] += " (with uncommitted changes to the measured code)"
    if doc.get("provenance") == RECOVERED:
        parts[0] += f" ({RECOVERED}: the commit that last wrote this file)"
    if doc.get("date"):
        parts.append(str(doc["date"]))
    host = doc.get("host") or {}
    start, end = host.get("load_avg_at_start"), host.get("load_avg_at_end")
    if start and end:
        parts.append(
            f"load average {float(start[0]):.1f} at the start, {float(end[0]):.1f} at the end"
        )
    if host.get("disk"):
        parts.append(f"disk {host['disk']}")
    return "Made from " + ", ".join(parts) + "."
