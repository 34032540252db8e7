"""`rekindle-dev bench report`: every benchmark's results in one page, docs/benchmarks.md.

Full mode runs the quick part first (the warming bench on a synthetic
checkpoint), or whatever --run names (naive: boots of the tiny model split into
phases by vLLM's log, which bench local's own naive boots now record; warm,
criu, weights, local), then collects; --collect only collects what docs/bench/
holds. Every figure names the results file it came from, with the commit that
file was made from; a file whose commit is missing, or whose measured code
changed since (bench_provenance), is marked STALE where it is cited and in the
list of results files at the end (--strict refuses to write the report
instead). Headline ratios come with their per-trial values; "cold" says what it
means on the machine that measured it; a vLLM feature measured against its own
off switch says so in the same sentence. Sections whose results are missing say
which command makes them.
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rekindle_dev import bench_provenance as prov
from rekindle_dev.bench_common import NAIVE_PHASES, parse_vllm_log, provenance, residency_cell
from rekindle_dev.docs_release import release_line
from rekindle_dev.machine import machine

# Where each benchmark writes (under docs/bench), and the command that writes it.
SOURCES: dict[str, tuple[str, str]] = {
    "local": ("local/results.json", "rekindle-dev bench local --criu-prefix DIR --trials 3"),
    "local-smollm2": (
        "local/smollm2/results.json",
        "rekindle-dev bench local --criu-prefix DIR --trials 3 "
        "--model $(rekindle-dev model smollm2 --in-cache | tail -1) --out docs/bench/local/smollm2",
    ),
    "criu": ("criu/bench.json", "scripts/bench-criu --sizes 0.5,1,2,4 --trials 5"),
    "density": ("density/results.json", "rekindle-dev bench density"),
    "weights": (
        "weights/results.json",
        "rekindle-dev bench weights --sizes 1 --trials 3 --no-vllm --map",
    ),
    "weights-direct": (
        "weights/direct/results.json",
        "rekindle-dev bench weights --sizes 4 --trials 3 --direct --no-vllm "
        "--out docs/bench/weights/direct",
    ),
    "weights-sizes": (
        "weights/sizes/results.json",
        "rekindle-dev bench weights --sizes 1,4,8 --trials 3 --out docs/bench/weights/sizes",
    ),
    "ladder": ("ladder/results.json", "rekindle-dev bench ladder --criu-prefix DIR"),
    "mm": ("mm/results.json", "rekindle-dev bench mm"),
    "kv": ("kv/results.json", "rekindle-dev bench kv --trials 3 --turns 6 --chunk-tokens 200"),
    "warm": ("warm/results.json", "rekindle-dev bench warm --dir CHECKPOINT --trials 7"),
    "warm-synthetic": (
        "warm/synthetic/results.json",
        "rekindle-dev bench warm --size-gb 2 --trials 5 --out docs/bench/warm/synthetic",
    ),
    "kdat": ("kdat/results.json", "rekindle-dev bench kdat --criu-prefix DIR --trials 10"),
    "tp2": (
        "local-tp2/results.json",
        "rekindle-dev bench local --criu-prefix DIR --tp 2 --out docs/bench/local-tp2",
    ),
    "cluster": ("cluster/demo/bench.json", "DEMO_BENCH_OUT=docs/bench/cluster/demo make demo"),
    "cluster-up": ("cluster-up.json", "scripts/bench-cluster-up 5"),
    "node-agent": ("node-agent/results.json", "rekindle-dev bench node-agent --trials 5"),
    "scale-out": (
        "scale-out/results.json",
        "rekindle-dev bench scale-out --replicas 1 --trials 3",
    ),
    "store": (
        "store/results.json",
        "rekindle-dev bench store --size-mib 1024 --trials 5 --threads 8 --out docs/bench/store",
    ),
    "proxy": ("proxy/results.json", "rekindle-dev bench proxy --trials 3 --out docs/bench/proxy"),
    "scale-from-zero": (
        "scale-from-zero/results.json",
        "rekindle-dev bench scale-from-zero --trials 3 --out docs/bench/scale-from-zero",
    ),
    "load-step": (
        "load-step/results.json",
        "rekindle-dev bench load-step --trials 3 --out docs/bench/load-step",
    ),
    "gpu": (
        "gpu/results.json",
        "python3 -m rekindle_dev.gpu_probe --out DIR "
        "--criu-dir .device/criu --phases facts,criu_map,criu_stopped,driver,nvml,criu,"
        "criu_trials,h2d --trials 3",
    ),
    "suite": ("test-suite/results.json", "rekindle-dev bench suite"),
    "naive": ("report/naive_boot.json", "rekindle-dev bench report --run naive"),
}
# Older places of the same results, read where the current one is absent.
FALLBACK: dict[str, tuple[str, ...]] = {"density": ("criu/bench-density.json",)}
QUICK = ("warm",)


def log(msg: str) -> None:
    print(f"[bench report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the naive boot, from vLLM's own log ---------------------------------------------


def one_naive_boot(factory: Any, trial: int) -> dict[str, Any]:
    """One boot without a checkpoint: its phases from vLLM's log, ready and first token."""
    (factory.run_dir / "vllm.log").unlink(missing_ok=True)
    launched = time.time()
    agent = factory.start(name=f"naive-{trial}", restore_policy="never")
    try:
        agent.wait_ready(900, poll=0.05)
        ready = time.time()
        agent.complete("The river", max_tokens=1)
        first_token = time.time()
    finally:
        agent.stop()
    text = (factory.run_dir / "vllm.log").read_text(errors="replace")
    doc = parse_vllm_log(text, launched, ready)
    doc.update(
        ready_s=ready - launched,
        first_token_s=first_token - launched,
        load_avg=[round(x, 2) for x in os.getloadavg()],
    )
    log(f"naive boot {trial}: ready {doc['ready_s']:.1f}s, load {doc['load_avg'][0]:.1f}")
    return doc


def median_boot(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each phase and total over the trials (each a parse_vllm_log result)."""
    names = list(dict.fromkeys(k for t in trials for k in t["phases"]))
    return {
        "phases": {
            k: round(statistics.median(t["phases"].get(k, 0.0) for t in trials), 3) for k in names
        },
        "ready_s": statistics.median(t["ready_s"] for t in trials),
        "first_token_s": statistics.median(t["first_token_s"] for t in trials),
        "eager": all(t["eager"] for t in trials),
        "lines": trials[-1]["lines"],
    }


def run_naive(args: argparse.Namespace, out: Path) -> None:
    """Boot the model --trials times without a checkpoint; keep the phases (naive_boot.json)."""
    from rekindle_dev.harness import AgentFactory

    work = Path(args.work) / "naive"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = Path(args.model) if args.model else None
    if model is None:
        from rekindle_dev.models import generate_tiny_model

        model = generate_tiny_model(work / "tiny")
    factory = AgentFactory(work, model, Path("criu"))
    started, load_start = time.time(), os.getloadavg()
    trials = [one_naive_boot(factory, i) for i in range(args.trials)]
    doc = median_boot(trials)
    command = f"rekindle-dev bench report --run naive --trials {args.trials} --work {args.work}" + (
        f" --model {args.model}" if args.model else ""
    )
    doc.update(
        provenance(command, prov.MEASURED_BY["naive"], load_start, started, str(work)),
        model=str(args.model or "the tiny model (rekindle-dev model tiny)"),
        trials=trials,
    )
    (out / "report").mkdir(parents=True, exist_ok=True)
    (out / "report" / "naive_boot.json").write_text(json.dumps(doc, indent=2))
    log(f"naive boot, median of {args.trials}: ready {doc['ready_s']:.1f}s")
    shutil.rmtree(work, ignore_errors=True)


def run_part(part: str, args: argparse.Namespace, out: Path) -> None:
    """Run one benchmark the report can run itself; its command goes in the report."""
    if part == "naive":
        run_naive(args, out)
        return
    dev = [sys.executable, "-m", "rekindle_dev.commands", "bench"]
    commands: dict[str, list[str]] = {
        # a synthetic checkpoint: warm/ holds the run on a real one (--dir)
        "warm": [*dev, "warm", "--trials", str(args.trials), "--out", str(out / "warm/synthetic")],
        "weights": [*dev, "weights", "--sizes", "1", "--trials", str(args.trials)],
        "local": [
            *dev,
            "local",
            "--criu-prefix",
            args.criu_prefix,
            "--trials",
            str(args.trials),
            "--out",
            str(out / "local"),
        ],
        "criu": ["scripts/bench-criu", "--sizes", "0.5,1", "--trials", str(args.trials)],
    }
    if part not in commands:
        raise SystemExit(f"--run {part}: the report runs {', '.join(['naive', *commands])}")
    if part == "weights":
        commands[part] += ["--out", str(out / "weights")]
    log(f"running {part}: {' '.join(commands[part])}")
    subprocess.run(commands[part], check=True)


# -- reading what the benchmarks wrote, and whether it still holds ----------------------


def git_root(path: Path) -> Path | None:
    """The git checkout path is in (None outside one: nothing can be proven current)."""
    try:
        res = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return None
    return Path(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip() else None


class Results:
    """The results files under a bench directory, each read once with its provenance.

    repo: the checkout their commits are checked against (default: the one holding
    bench). Every figure the report prints cites one of these files.
    """

    def __init__(self, bench: Path, repo: Path | None = None) -> None:
        self.bench = bench
        self.repo = repo if repo is not None else git_root(bench if bench.exists() else Path())
        self._docs: dict[str, dict[str, Any] | None] = {}
        self._status: dict[str, prov.Status] = {}

    def rel(self, name: str) -> str:
        """Where name's results are (its current place, or an older one that exists)."""
        for rel in (SOURCES[name][0], *FALLBACK.get(name, ())):
            if (self.bench / rel).exists():
                return rel
        return SOURCES[name][0]

    def read(self, rel: str) -> dict[str, Any] | None:
        if rel not in self._docs:
            try:
                data = json.loads((self.bench / rel).read_text())
                self._docs[rel] = data if isinstance(data, dict) else None
            except (OSError, ValueError):
                self._docs[rel] = None
        return self._docs[rel]

    def doc(self, name: str) -> dict[str, Any] | None:
        return self.read(self.rel(name))

    def shown(self, rel: str) -> str:
        """The file's path as a reader of the repository finds it."""
        path = (self.bench / rel).resolve()
        if self.repo is not None and path.is_relative_to(self.repo.resolve()):
            return str(path.relative_to(self.repo.resolve()))
        return f"{self.bench.name}/{rel}"

    def status_of(self, rel: str) -> prov.Status:
        if rel not in self._status:
            doc = self.read(rel) or {}
            default = prov.MEASURED_BY.get(prov.bench_of(rel), ())
            if self.repo is None:
                self._status[rel] = prov.Status(
                    path=self.shown(rel),
                    commit=str(doc.get("commit") or ""),
                    date=str(doc.get("date") or ""),
                    stale=("not in a git checkout: its commit cannot be checked",),
                )
            else:
                self._status[rel] = prov.check(doc, self.shown(rel), self.repo, default)
        return self._status[rel]

    def status(self, name: str) -> prov.Status:
        return self.status_of(self.rel(name))

    def all_files(self) -> list[str]:
        """Every results JSON under the bench directory."""
        if not self.bench.is_dir():
            return []
        return sorted(str(p.relative_to(self.bench)) for p in self.bench.rglob("*.json"))


def source_note(res: Results, name: str, rel: str | None = None) -> str:
    """ "Source: FILE (commit, date)", and why it is marked where it is not current."""
    rel = rel or res.rel(name)
    st = res.status_of(rel)
    text = f"Source: {st.cite()}."
    if not st.current:
        text += f" {st.label}: {st.why()}; regenerate with `{SOURCES[name][1]}`."
    return text


def cite(res: Results, name: str) -> str:
    """A short citation for a figure: the file, the load it ran under, and its mark
    unless it is current."""
    st = res.status(name)
    load = load_span(res.doc(name) or {})
    return f"`{st.path}` ({load})" + ("" if st.current else f", **{st.label}**")


def load_span(doc: dict[str, Any]) -> str:
    """The 1-minute load average a run recorded, at its start and end where it has both."""
    host = doc.get("client") or doc.get("host") or doc.get("machine") or {}
    start, end = host.get("load_avg_at_start"), host.get("load_avg_at_end")
    end = end or host.get("load_avg")
    if start and end:
        return f"load average {float(start[0]):.1f} at the start, {float(end[0]):.1f} at the end"
    if end:
        return f"load average {float(end[0]):.1f} at the end"
    return "load not recorded"


def missing(name: str) -> str:
    return f"_Not measured yet: `{SOURCES[name][1]}` writes `docs/bench/{SOURCES[name][0]}`._\n"


def load_note(doc: dict[str, Any]) -> str:
    """The machine and load a result came from, in one line, from what it recorded."""
    host = doc.get("machine") or doc.get("host") or (doc.get("meta") or {}).get("machine") or {}
    if isinstance(host, str):
        return host
    parts = [str(host.get(k)) for k in ("node", "cpu", "kernel") if host.get(k)]
    if host.get("cpus"):
        parts.append(f"{host['cpus']} CPUs")
    start, end = host.get("load_avg_at_start"), host.get("load_avg_at_end")
    la = host.get("load_avg") or end or doc.get("load_after")
    if start and end:
        parts.append(f"load average {_loads(start)} at the start, {_loads(end)} at the end")
    elif la:
        parts.append(f"load average {_loads(la)}")
    return ", ".join(parts) or "machine not recorded"


def _loads(la: Sequence[float]) -> str:
    return ", ".join(f"{float(x):.1f}" for x in la)


def demote(md: str) -> str:
    """A benchmark's own results.md, its headings two levels down, inside the report."""
    return re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", md, flags=re.M)


def embed(bench: Path, sub: str, md_names: tuple[str, ...] = ("results.md",)) -> str:
    """A benchmark directory's own table (results.md or the named one) and its plot."""
    out = []
    for name in md_names:
        p = bench / sub / name
        if p.exists():
            # A results.md may show its plot by a path relative to itself; the plot is
            # added below by a path relative to this page instead.
            lines = p.read_text().strip().splitlines()
            own_plot = {f"]({png})" for png in ("results.png", "bench.png")}
            kept = [
                ln for ln in lines if not (ln.startswith("![") and ln[ln.rfind("]") :] in own_plot)
            ]
            out.append(demote("\n".join(kept).strip()))
            break
    for png in ("results.png", "bench.png"):
        if (bench / sub / png).exists():
            out.append(f"![{sub}](bench/{sub}/{png})")
            break
    return "\n\n".join(out) + "\n" if out else ""


# -- per-trial values, and what "cold" means -------------------------------------------


def per_trial(runs: Iterable[dict[str, Any]], key: str, **match: Any) -> dict[int, float]:
    """{trial: run[key]} for the runs whose fields equal match (the last run per trial)."""
    out: dict[int, float] = {}
    for r in runs:
        if all(r.get(k) == v for k, v in match.items()) and r.get(key) is not None:
            out[int(r.get("trial", len(out)))] = float(r[key])
    return out


def trial_ratios(num: dict[int, float], den: dict[int, float]) -> list[float]:
    """num/den for every trial both have, in trial order."""
    return [num[t] / den[t] for t in sorted(num) if den.get(t)]


def joined(values: Iterable[float], spec: str = "{:.2f}", unit: str = "") -> str:
    return "/".join(spec.format(v) for v in values) + unit


def disk_gbps(doc: dict[str, Any]) -> float | None:
    """The cold read of the checkpoint in the same run (bench local's disk floor), GB/s."""
    floor = (doc.get("disk_floor_seconds") or {}).get("median")
    size = doc.get("checkpoint_bytes")
    return size / floor / 1e9 if floor and size else None


def cold_meaning(
    doc: dict[str, Any] | None, gbps: float | None = None, what: str = "the checkpoint"
) -> str:
    """What "cold" means for the run that wrote doc, on the machine it ran on.

    The benches drop the guest's page cache; on a virtual machine the host may
    still hold the virtual disk's blocks, so "cold" is not "read from storage".
    gbps: the run's own cold read of what (default: bench local's disk floor)."""
    doc = doc or {}
    gbps = gbps if gbps is not None else disk_gbps(doc)
    disk = (doc.get("host") or doc.get("machine") or {}).get("disk")
    text = (
        "Cold means the guest's page cache was dropped before the run (`echo 3 > "
        "/proc/sys/vm/drop_caches`), not that every byte came from storage: the host "
        "may still cache this machine's virtual disk."
    )
    if gbps is not None:
        text += f" The same run read {what} cold at {gbps:.2f} GB/s"
        text += f" from {disk}" if disk else " (its disk was not recorded"
        now = machine()["disk"]
        text += "." if disk else f"; this machine's now: {now})."
        if "non-rotational" not in str(disk or now) and gbps > 0.5:
            text += (
                " A disk the kernel calls rotational does not deliver that: the host's cache did."
            )
    elif disk:
        text += f" Disk under the files: {disk}."
    return text


# -- sections ---------------------------------------------------------------------------


def local_naive_rows(local: dict[str, Any] | None) -> list[dict[str, Any]]:
    """bench local's naive rows that carry their own vLLM split (results since it is recorded)."""
    if not local:
        return []
    return [
        r
        for r in local["summary"].values()
        if r.get("variant") == "naive" and r.get("vllm_split_median")
    ]


def section_naive(res: Results) -> str:
    """The naive split from bench local's run when it recorded one, else the separate run."""
    local = res.doc("local")
    rows = local_naive_rows(local)
    if local and rows:
        return source_note(res, "local") + "\n\n" + section_naive_same_run(local, rows)
    doc = res.doc("naive")
    note = (
        f"bench local's results (`{local['command']}`) predate the per-boot split: not "
        "recorded there. "
        if local
        else ""
    )
    if doc is None:
        return note + missing("naive")
    return (
        f"{source_note(res, 'naive')}\n\n"
        f"{note}This split comes from a separate run of naive boots (`{doc['command']}`), "
        "not from the run of the restore paths below, whose own naive rows the ratios use: "
        "its load and its seconds differ from theirs.\n\n" + section_naive_separate(doc)
    )


def section_naive_same_run(local: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Table of bench local's naive boots, split by their own vLLM logs (one column per cache)."""
    where = dict(NAIVE_PHASES)
    names = list(dict.fromkeys(k for r in rows for k in r["vllm_split_median"]))
    head = ["| phase |"] + [f" {r['cache']} (median of {r['vllm_split_trials']}) |" for r in rows]
    table = ["".join([*head, " from |"]), "|---|" + "---:|" * len(rows) + "---|"]
    for k in names:
        cells = "".join(f" {r['vllm_split_median'].get(k, 0.0):.2f} |" for r in rows)
        table.append(f"| {k} |{cells} {where.get(k, '')} |")
    ready = "".join(
        f" **{r['ready_median']:.2f}** |" if "ready_median" in r else " - |" for r in rows
    )
    table.append(f"| **launch to Ready** |{ready} measured by the harness |")
    ttft = "".join(f" {r['ttft_median']:.2f} |" for r in rows)
    table.append(f"| launch to first token |{ttft} measured by the harness |")
    first = rows[0]
    starts = sum(first["vllm_split_median"].get(k, 0.0) for k, _ in NAIVE_PHASES[:3])
    total = first.get("ready_median") or first["ttft_median"]
    share = (
        f"Starting the three Python processes (API server, engine core, worker) and importing "
        f"vLLM and torch in each take {starts:.1f} s of the {total:.1f} s "
        f"({100 * starts / total:.0f}%, {first['cache']} cache): that, not the model, is what a "
        "restore skips for a small model."
    )
    eager = (
        "vLLM's CPU build runs with --enforce-eager here: torch.compile and graph capture are "
        "off, so there is no compile phase; warm-up is inside the engine init."
        if all(r.get("eager") for r in rows)
        else "torch.compile was on: its time is inside the engine init."
    )
    lines: list[str] = next(
        (
            r["vllm_split"]["lines"]
            for r in reversed(local.get("runs", []))
            if "lines" in (r.get("vllm_split") or {})
        ),
        [],
    )
    return "\n".join(
        [
            "Each naive boot of `rekindle-dev bench local` split by its own vLLM log: the same "
            f"run as the restore paths below (`{local['command']}`, "
            f"{local.get('date', 'date not recorded')}), so the ratios between them are within "
            f"one run. {eager} Log timestamps have whole seconds; the timers are vLLM's own. "
            f"Machine: {load_note(local)}.",
            "",
            *table,
            "",
            share,
            "",
            "The lines of the last naive boot it was read from:",
            "",
            "```",
            *[ln[:200] for ln in lines],
            "```",
            "",
        ]
    )


def section_naive_separate(doc: dict[str, Any]) -> str:
    """The split of `rekindle-dev bench report --run naive` (naive_boot.json)."""
    rows = ["| phase | seconds | from |", "|---|---:|---|"]
    where = dict(NAIVE_PHASES)
    for k, v in doc["phases"].items():
        rows.append(f"| {k} | {v:.2f} | {where.get(k, '')} |")
    starts = sum(doc["phases"].get(k, 0.0) for k, _ in NAIVE_PHASES[:3])
    share = (
        f"Starting the three Python processes (API server, engine core, worker) and importing "
        f"vLLM and torch in each take {starts:.1f} s of the {doc['ready_s']:.1f} s "
        f"({100 * starts / doc['ready_s']:.0f}%): that, not the model, is what a restore skips "
        "for a small model."
        if doc["ready_s"]
        else ""
    )
    n = len(doc.get("trials") or [1])
    loads = ", ".join(f"{t['load_avg'][0]:.1f}" for t in doc.get("trials") or [] if "load_avg" in t)
    rows[0] = f"| phase | seconds (median of {n}) | from |"
    rows.append(f"| **launch to Ready** | **{doc['ready_s']:.2f}** | measured by the harness |")
    rows.append(f"| launch to first token | {doc['first_token_s']:.2f} | measured by the harness |")
    eager = (
        "vLLM's CPU build runs with --enforce-eager here: torch.compile and graph capture are "
        "off, so there is no compile phase; warm-up is inside the engine init."
        if doc.get("eager")
        else "torch.compile was on: its time is inside the engine init."
    )
    return "\n".join(
        [
            f"Model: {doc['model']}. {eager} Log timestamps have whole seconds; the timers are "
            "vLLM's own. Machine: "
            + load_note(doc)
            + (f" (1-minute load at the end of each boot: {loads})" if loads else "")
            + f"; {doc.get('date', '')}.",
            "",
            *rows,
            "",
            share,
            "",
            f"Command: `{doc['command']}`. The lines it was read from:",
            "",
            "```",
            *[ln[:200] for ln in doc["lines"]],
            "```",
            "",
        ]
    )


def section_local(res: Results) -> str:
    doc = res.doc("local")
    if doc is None:
        return missing("local")
    s = doc["summary"]
    runs = doc.get("runs") or []
    rows = [
        "| path | cache | first token, median s | per trial, s | x naive (same run) | page "
        "cache before restore, % | phases, median s |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for r in s.values():
        ph = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phases_median", {}).items() if v >= 0.005)
        speed = r.get("speedup_vs_naive")
        trials = per_trial(runs, "ttft", variant=r["variant"], cache=r["cache"])
        rows.append(
            f"| {r['variant']}{' (mmap)' if r.get('mmap') else ''} | {r['cache']} | "
            f"{r['ttft_median']:.2f} | {joined(trials.values()) if trials else '-'} | "
            f"{f'{speed:.1f}x' if speed else '-'} | {residency_cell(r)} | {ph} |"
        )
    inside = [
        f"- {r['variant']} {r['cache']}: "
        + ", ".join(f"{k} {v:.3f}" for k, v in r["criu_median"].items() if v)
        for r in s.values()
        if r.get("criu_median")
    ]
    if inside:  # CRIU's own stats and log, inside the criu_restore phase
        rows += ["", "Inside `criu_restore` (CRIU's stats file and its log, median s):", *inside]
    rows += verify_cost_rows(doc.get("verify_cost_seconds"))
    size = doc.get("checkpoint_bytes")
    return "\n".join(
        [
            source_note(res, "local"),
            "",
            "Every path runs the real agent as PID 1 of a fresh PID and mount namespace (as a "
            "new pod); first token = agent launch to the answer of a one-token completion. "
            "Warm: checkpoint in the page cache; cold: after `echo 3 > /proc/sys/vm/drop_caches`."
            + (f" Checkpoint: {size / 2**30:.2f} GiB." if size else "")
            + " Page cache before restore: how much of the checkpoint vmtouch (mincore) found "
            "cached just before each restore's launch, median (min-max) over the trials; "
            '"not recorded" for results made before the bench recorded it. '
            + residency_sentence(s.values()),
            "",
            cold_meaning(doc),
            "",
            f"Machine: {load_note(doc)}.",
            "",
            *rows,
            "",
            f"Command: `{doc['command']}`",
            "",
            "![cold-start breakdown](bench/report/cold-start.png)",
            "",
        ]
    )


def verify_cost_rows(cost: dict[str, Any] | None) -> list[str]:
    """bench local --verify-cost: the restore's content check alone, per kind and cache."""
    if not cost:
        return []
    kinds = list(dict.fromkeys(k.split("/")[0] for k in cost if "/" in k))
    rows = [
        "",
        f"The content check alone (`--verify-cost`: the prefetcher over the checkpoint's "
        f"{cost.get('bytes', 0) / 2**30:.2f} GiB, {cost.get('threads', '?')} threads, median s):",
        "",
        "| check | warm | cold |",
        "|---|---:|---:|",
    ]
    for k in kinds:
        cells = [fmt_s(cost.get(f"{k}/{c}")) for c in ("warm", "cold")]
        rows.append(f"| {k} | {cells[0]} | {cells[1]} |")
    return rows


def fmt_s(v: Any) -> str:
    return "-" if v is None else f"{float(v):.2f}"


def residency_sentence(rows: Iterable[dict[str, Any]]) -> str:
    """One sentence: the residency before restore per cache, or that it was not recorded
    ("" without restore rows)."""
    per: dict[str, list[float]] = {}
    restores = 0
    for r in rows:
        if r.get("variant") in ("naive", None) or str(r.get("variant")).startswith("disk"):
            continue
        restores += 1
        if r.get("residency_before_percent"):
            per.setdefault(r["cache"], []).append(r["residency_before_percent"]["median"])
    if not restores:
        return ""
    if not per:
        return "Residency before restore: not recorded in this run."
    parts = [f"{cache} {min(v):.1f}-{max(v):.1f} %" for cache, v in sorted(per.items())]
    return "Residency before restore, over the restore paths' medians: " + ", ".join(parts) + "."


def section_ladder(res: Results) -> str:
    """The ladder's own table, with what its run recorded of residency and the naive split."""
    doc = res.doc("ladder")
    notes: list[str] = []
    for result in (doc or {}).get("results", []):
        s = result.get("summary", {})
        rows = [{"variant": k.split("/")[0], "cache": k.split("/")[1], **v} for k, v in s.items()]
        split = [r for r in rows if r["variant"] == "naive" and r.get("vllm_split_median")]
        how = (
            "Naive split: from each boot's own vLLM log in this run (the list after its table)."
            if split
            else "Naive split: not recorded in this run."
        )
        notes.append(f"- {result['size']}: {residency_sentence(rows) or 'No restore.'} {how}")
    head = ["Per size, from the ladder's own results:", *notes, ""] if notes else []
    return "\n".join([*head, section_embedded(res, "ladder"), *ladder_runs(res)])


def ladder_runs(res: Results) -> list[str]:
    """Sizes run on their own (ladder/<size>/, one run each): their tables and plots."""
    out = []
    root = res.bench / "ladder"
    subs = sorted(p for p in root.iterdir() if (p / "results.md").exists()) if root.is_dir() else []
    for sub in subs:
        rel = f"ladder/{sub.name}/results.json"
        doc = res.read(rel) or {}
        out += [f"#### {sub.name}, a run of its own", ""]
        if doc:
            out += [source_note(res, "ladder", rel), ""]
        out += [f"Machine: {load_note(doc)}.", "", embed(res.bench, f"ladder/{sub.name}")]
    return out


CLUSTER_TIMING = (
    "Each trial scales the InferenceService to 0, waits until its pods are gone and the "
    "operator has pointed new pods at the checkpoint (or away from it, naive), then times "
    "from the request that scales it to 1 to (a) the pod's Ready condition and (b) the first "
    "token answered through its Service (a one-token completion through the apiserver's "
    "service proxy, sent only once the pod is Ready, so never to a pod before the Service "
    "routes to it); (c) is the agent's own start-to-Ready."
)


def section_cluster(res: Results) -> str:
    doc = res.doc("cluster")
    if doc is None:
        return missing("cluster")
    s = doc["summary"]
    trials = doc.get("trials") or []
    rows = [
        "| arm | n | pod Ready, median s | first token, median s | first token per trial, s |",
        "|---|---:|---:|---:|---|",
    ]
    for arm, r in s.items():
        each = per_trial(trials, "first_token_s", arm=arm)
        rows.append(
            f"| {arm} | {int(r['ready_s']['n'])} | {r['ready_s']['median']:.1f} | "
            f"{r['first_token_s']['median']:.1f} | {joined(each.values(), '{:.1f}') or '-'} |"
        )
    ratio = ""
    if "naive" in s and "restore" in s:
        x = s["naive"]["first_token_s"]["median"] / s["restore"]["first_token_s"]["median"]
        ratios = trial_ratios(
            per_trial(trials, "first_token_s", arm="naive"),
            per_trial(trials, "first_token_s", arm="restore"),
        )
        ratio = f"First-token speedup within the run (median naive / median restore): {x:.1f}x" + (
            f" (per trial {joined(ratios, '{:.1f}', 'x')})." if ratios else "."
        )
    node = doc.get("node") or {}
    where = (
        f"Node {node.get('name')}: {node.get('kernel', '?')}, {node.get('cpus', '?')} CPUs, "
        f"kubelet {node.get('kubelet', '?')}."
        if node
        else "Node: not recorded in this file."
    )
    return "\n".join(
        [
            source_note(res, "cluster"),
            "",
            doc.get("timing")
            or (
                "This file does not record what it timed; the bench at its commit did as "
                "follows, except that it slept 2 s for the operator's pointer instead of "
                "waiting for it. " + CLUSTER_TIMING
            ),
            "Page cache before restore: not recorded by this benchmark (`kubectl rekindle "
            f"status` shows each pod's). {where} Date: {doc.get('date', 'not recorded')}.",
            "",
            *rows,
            "",
            ratio,
            "",
            f"Command: `{doc['command']}`",
            "",
            embed(res.bench, SOURCES["cluster"][0].rsplit("/", 1)[0], ("summary.md",)),
        ]
    )


def section_cluster_up(res: Results) -> str:
    doc = res.doc("cluster-up")
    if doc is None:
        return missing("cluster-up")
    return "\n".join(
        [
            source_note(res, "cluster-up"),
            "",
            f"{doc.get('what', 'scripts/local-cluster up')}: median {doc['median_s']:.2f} s "
            f"({doc['min_s']:.2f}-{doc['max_s']:.2f}; per trial "
            f"{joined(doc.get('trials_s') or [])} s). Machine: {load_note(doc)}. "
            f"Command: `{doc['command']}`.",
            "",
        ]
    )


def section_embedded(res: Results, name: str, md: tuple[str, ...] = ("results.md",)) -> str:
    doc = res.doc(name)
    sub = res.rel(name).rsplit("/", 1)[0]
    body = embed(res.bench, sub, md) if "/" in res.rel(name) else ""
    if doc is None and not body:
        return missing(name)
    head = [source_note(res, name), ""] if doc is not None else []
    cmd = None if doc is None else doc.get("command") or (doc.get("meta") or {}).get("command")
    if doc is not None and not (cmd and cmd in body):  # its own table already says both
        head.append(f"Machine: {load_note(doc)}." + (f" Command: `{cmd}`." if cmd else ""))
    return "\n".join([*head, "", body])


LOAD_STEP_NOTE = """\
A service with spec.autoscaling 1..2 idles at one replica; four clients start
sending completions through the front (the step), KEDA asks for a second
replica, which restores (step-restore) or boots (step-boot). Timed from the
step to the scale decision and to the new replica's first token (asked of that
pod itself); "from the decision" is the replica's own start, without the
autoscaler's reaction. Issue 25's target: the step served by a restored replica
at least 10x sooner than by a booted one. Checkpoint files read whole before
each restore trial (residency in the file), arms interleaved, each trial
starting with both services back at one replica. Both replicas share this
machine's two cores with the load, the front, KEDA and the control plane: the
load saturates them (load average ~10). vLLM's OpenMP threads run unpinned in
both arms: pinned (vLLM's default), every one-rank replica here binds them to
core 0, and a booting replica beside the loaded one gave no first token within
900 s, where a restore answered in 19 s (one trial each, commit 33568cc).

Storage, and what the runs show. This file: storage type node (the node
agent's verified cache, unprivileged pods), 3.6x. The same day with hostPath
(privileged pods; `--storage hostPath`, commit 763cfa5, before the arms were
kept apart, dirty: the bench script was being edited during the run;
docs/bench/load-step/hostpath-763cfa5.json): restore
16.4 / 43.0 / 19.6 s, boot 124.2 / 99.5 / 140.0 s, 6.3x. The earlier hostPath
run (commit e51bcf2, another day): 12.9 vs 103.3 s, 8.0x. In every run the
restored replica spends most of its time outside its agent: from the decision
to the pod's Ready, less the agent's own start-to-Ready, 8-32 s (hostPath) and
13-28 s (node), where the agent itself took 4-5 s (hostPath) and 5-11 s
(node). With storage node the restore's CRIU phase takes 1.3-7.2 s under this
load against 1.1-1.5 s with hostPath. CRIU runs in the restoring pod's
cgroups, but the node agent's own work around it (the request, the cache
entry, starting CRIU) does not, and the chart leaves the node agent without a
CPU request: the one BestEffort pod on a node whose other pods are Burstable,
with the smallest CPU share of all exactly when a replica must restore (the
likely cause). A 100m request left the loaded node no room for the second
replica (2 CPUs allocatable per node, 500m per replica, the replica tied to the
node holding the checkpoint). One run with the node agent requesting 100m and
every replica 400m (the bench edited by hand for it, commit a9aaa59, dirty;
docs/bench/load-step/node-agent-cpu-100m.json; a separate run, not an
interleaved arm): restored 17.3 s (16.0 / 20.9 / 17.3), booted 112.4 s: 6.5x,
the CRIU phase 1.9 s median against 3.95 s in this file.

"""


SCALE_FROM_ZERO_NOTE = """\
A service scaled to zero gets one request through the front (docs/autoscaling.md):
the front holds it, KEDA (polling the front's /load every second) scales the
service to one, the replica restores (front-restore) or boots (front-boot), and
the request is answered. scale-restore is the same restore without the autoscaler
or the front (`kubectl rekindle bench`'s trial: scale to 1 by hand, first token
through the Service): the wait that autoscaling adds is front-restore minus it
(issue 25's target: within 1 s). Checkpoint files read whole before each trial
(residency in the file), arms interleaved. The front-restore arm spreads by
seconds from trial to trial on this machine: a 3-trial run just before the one
below, on the same commit and cluster, gave +1.65 s (front-restore 4.01 s,
scale-restore 2.36 s), so neither run alone decides a 1 s target.

"""


GPU_NOTE = """\
On a lent GPU machine (one H100, a Firecracker VM with its own kernel, no
vLLM, no cluster, no network): a PyTorch process holding a known GPU tensor
and a matmul result, taken through the CUDA driver's checkpoint actions and
through the patched CRIU with its CUDA plugin, then asked to re-check both
(bit-exact). NVIDIA's cuda-checkpoint binary could not be fetched there; a
work-alike over the same driver calls (`rekindle_dev/cuda_checkpoint_cli.py`)
answered the plugin's command lines. The restore arms (mmap, copy) restore
images CRIU had just written (page cache warm for both), on fresh processes,
interleaved, the order reversed every other trial.

"""


def stopped_line(run: dict[str, Any] | None) -> list[str]:
    """Whether CRIU's CUDA plugin hung a restore with --leave-stopped on the GPU."""
    if not run or "hung" not in run:
        return []
    if run["hung"]:
        return [
            f"- `--leave-stopped` with the CUDA plugin: **CRIU hung** (killed after "
            f"{run['timeout_s']:.0f} s, its log ending in the plugin's late resume hook), as "
            "with CRIU's mock: why a GPU restore never leaves the tree stopped."
        ]
    return [f"- `--leave-stopped` with the CUDA plugin: CRIU exited {run.get('rc')} (no hang)."]


def section_gpu(res: Results) -> str:
    """The GPU probe's run: driver actions, NVIDIA files left open, CRIU dump and restore."""
    doc = res.doc("gpu")
    if doc is None:
        return missing("gpu")
    facts, drv, nvml = doc["facts"], doc["driver"], doc["nvml"]
    crit, trials, h2d = doc["criu"], doc["criu_trials"], doc.get("h2d")
    cycles = drv["cycles"]
    rows = [
        "| step | per trial, s | median, s |",
        "|---|---|---|",
    ]
    for step in ("lock", "checkpoint", "restore", "unlock"):
        vals = [c[step]["s"] for c in cycles] + [drv["in_process"][step]]
        rows.append(f"| driver {step} | {joined(vals)} | {statistics.median(vals):.2f} |")
    for arm in ("mmap", "copy"):
        runs = trials["trials"][arm]
        rows.append(
            f"| CRIU dump, {runs[0]['images_mib']:.0f} MiB of images ({arm} arm) | "
            f"{joined(r['dump_s'] for r in runs)} | {trials[arm + '_dump_median_s']:.2f} |"
        )
    for arm in ("mmap", "copy"):
        runs = trials["trials"][arm]
        ok = all(r["ok"] for r in runs)
        rows.append(
            f"| CRIU restore, {arm} (tensor and matmul {'bit-exact' if ok else 'NOT exact'}) | "
            f"{joined(r['restore_s'] for r in runs)} | {trials[arm + '_restore_median_s']:.2f} |"
        )
    ratio = trials["copy_restore_median_s"] / trials["mmap_restore_median_s"]
    wrong = cycles[-1].get("restore_wrong_map", {})
    left = {m: nvml[m]["handles_checkpointed"] for m in ("nvml", "nvml-closed")}
    torch_crit = crit["torch"]
    cli_lock = statistics.median([c["lock"]["s"] for c in cycles])
    same, bad = doc["criu_map"].get("same_gpu_map", {}), doc["criu_map"].get("wrong_map", {})
    same_ok = isinstance(same.get("check"), dict) and same["check"].get("tensor_ok") is True
    lines = [
        source_note(res, "gpu"),
        "",
        f"Machine: {facts['nvidia_smi']}; kernel {facts['kernel']}; load average "
        f"{doc['load_before'][0]:.2f} at the start. Command: `{doc['command']}`.",
        "",
        GPU_NOTE.strip(),
        "",
        f"Driver rows: one process with {drv['gpu_mib_before']} MiB on the GPU, three "
        "checkpoint cycles, the first two through the command line (as CRIU's plugin runs "
        "it), the last in-process.",
        "",
        *rows,
        "",
        f"- **CRIU restore of a CUDA process: mmap {ratio:.1f}x faster than copy** "
        f"(medians {trials['mmap_restore_median_s']:.2f} s vs "
        f"{trials['copy_restore_median_s']:.2f} s, same images, both warm): the patched "
        "restore ran on a CUDA tree for the first time, and the restored process re-checked "
        "its tensor and matmul on the GPU.",
        f"- After the driver's checkpoint action the process held no NVIDIA device file "
        f"(before it: {len(drv['handles_running'])} descriptors and mappings) and nvidia-smi "
        f"listed no GPU memory for it; with NVML initialised and never shut down: "
        f"{left['nvml'] or 'none left'}; CRIU dumped that process too "
        f"(rc {crit['nvml-left-open']['dump']['rc']}). Driver {facts['driver_version']}.",
        f"- A restore with a device map onto the same GPU worked; a map naming a GPU the "
        f"process never used was refused (`{wrong.get('out', '?')}`), and the process then "
        "restored intact. Restoring onto another GPU needs a machine with two.",
        f"- The driver's checkpoint action moved the GPU memory into the process: resident "
        f"host memory {cycles[0]['rss_mib_running']:.0f} MiB before, "
        f"{cycles[0]['rss_mib_checkpointed']:.0f} MiB checkpointed ({drv['gpu_mib_before']} "
        "MiB were on the GPU): the host copy is the GPU memory still in use.",
        f"- Device map through the agent's own CRIU command line and criu-patches/0007: onto "
        f"the process's own GPU, restored and bit-exact "
        f"({'yes' if same_ok else 'NO'}); "
        f"naming a GPU it never used, the driver refused the restore and **CRIU still exited "
        f"{bad.get('rc')}**, the process left `{(bad.get('state') or {}).get('out')}` and not "
        "answering: why the agent asks cuda-checkpoint for the state right after CRIU.",
        *stopped_line(doc.get("criu_stopped")),
        f"- One command-line action costs about {cli_lock:.2f} s "
        f"(interpreter and driver start) against {drv['in_process']['lock']:.4f} s in-process.",
        (
            f"- Host to device: pinned {h2d['pinned']['median']:.1f} GB/s, pageable "
            f"{h2d['pageable']['median']:.1f} GB/s (median of {len(h2d['pinned']['gb_per_s'])})."
            if h2d
            else "- Host to device: not in this run (its time budget ran out first)."
        ),
        f"- Restored process: {torch_crit.get('gpu_mib_restored')} MiB on the GPU, "
        f"{len(torch_crit.get('handles_restored', []))} NVIDIA descriptors and mappings again.",
    ]
    return "\n".join(lines) + "\n"


NODE_AGENT_NOTE = """\
Not like for like in one respect, by design: the in-pod arm hashes every
checkpoint file (BLAKE3) in the restoring pod, the node-agent arm does not (the
node agent verified every byte into root-only storage when the checkpoint
entered its cache, and the pod reads that copy). Warm: both arms' files in the
page cache; cold: the whole page cache dropped before each scale-up, both arms.
The pod-level figures include the kubelet's 1 s readiness-probe period.

"""


SCALE_OUT_NOTE = """\
The two-node local cluster, the tiny model, one InferenceService (storage `node`,
published to SeaweedFS in the cluster) serving N replicas on the first node (N in
the results; results made before `--replicas` have N = 0: the replica added is
the only one); each trial adds one and removes it again. `cached`: the new
replica on the first node, whose cache holds the checkpoint, its files in the
page cache; `pull`: on the second node, whose cache lost its copy just before
(its node agent asked by a Job, `kubectl rekindle bench --scale-out`'s way; N =
0 results: emptied on the host), so it pulls the checkpoint from the store (the
store's files in the page cache) and verifies every byte before the restore;
`naive`: restorePolicy Never, vLLM boots. Both nodes are this machine: the
"network" of the pull is loopback, so it shows the pull's cost, not a
network's.

The naive boot became about three times faster when the runtime image was
byte-compiled and vLLM's model info cache seeded (docs/agent.md, "What a boot
spends"): results made after it compare against that faster boot, so their
ratios are smaller than earlier ones for the same restore.

One disk holds the store and both nodes here, so the bench writes the
machine's dirty pages back before every arm (a fleet's nodes each have their
own disk) and records what was left. Beside each pull, a plain parallel reader
(`rekindle_dev.store_read`: the same objects, one GET each, the same requests in
flight, bytes dropped) reads the checkpoint's objects from the second node's
network namespace: the limit the transport sets through the cluster's network
and the store's pod.

Checkpoints are published as frames (docs/node-agent.md, "Publish"): the CPU
demo's 2.19 GB checkpoint is stored in about 0.36 GiB (vLLM's pages compress
about 4x with zstd, its /dev/shm files are mostly zeroes and not stored). Results
made before frames read the plain 2.19 GB: their pull phase was about 10 s
against 7 s for the plain reader of those bytes. With frames the store is no
longer the limit: the reader takes under 1 s, and the pull spends its 4-5 s on
this machine's two cores decoding 1.85 GB of pages and hashing 2.2 GB (the
pull's own work, which the reader does not do; on a node with more cores the
decoding spreads over the pull's threads). The pull arm still misses its 5x
target narrowly here: a new pod's start (about 2.3 s, as in the cached arm) and
the restore (about 0.9 s) come on top of the pull. A pull that overlaps the
pod's start or the restore would close it; not built yet.
"""


PROXY_NOTE = """\
One replica (the tiny model on vLLM CPU, the real agent in front, as in a pod),
the same closed-loop load sent to the agent's serve port and to vLLM's own port
behind it; every answer is 16 tokens (`ignore_eos`); the two arms of a cell run
back to back, their order alternating. Issue 25's targets: at most 1 ms added at
p50, at most 3% fewer requests/s at saturation. On this 2-core machine vLLM, the
proxy and the load generator share the cores, so trials are noisy: a trial's p50
moves by tens of milliseconds either way (the per-trial columns), far more than
the 1 ms target, which this machine can therefore neither show met nor missed;
a cell's ratio moves by about 10% from trial to trial, so a 3% target at
saturation is decided by the median of five at best. The steadier figure is the
proxy's CPU per request (the agent's CPU in its arm, less its CPU in the direct
arm). Since the relay passes each streamed piece from vLLM's socket to the
client's in one callback (plain HTTP/1.1 on kept-alive connections, no HTTP
client decoding and re-encoding every chunk) it is about 0.3 ms per plain
request and 0.9 ms per streamed one at saturation (with aiohttp's client, in an
earlier run of the same cells from commit a84e139192, not this one: 0.54 and
1.22 ms), about 40 µs per streamed piece, most of it the send itself: the floor of any proxy that
forwards each token as it comes. On a node with cores to spare that CPU is the
whole cost (about 1,000 streamed or 3,000 plain requests/s per proxy core); here
it comes out of vLLM's own API server's share of the two cores. The design that
removes the hop (vLLM serving the public port with its control routes off, the
agent keeping the admin side) is not built. Besides moving the API key check,
the allowlist, the 503 while not Ready and the drain into vLLM's process (an
ASGI middleware), it would have vLLM hold clients' TCP connections, which a
CRIU dump must refuse or cut; today only the agent talks to vLLM, on loopback,
and closes those connections before each dump.

"""


STORE_NOTE = """\
The same bytes (a 1 GiB pages file of random bytes and three small files) from
the same SeaweedFS on loopback, in the same 16 MiB ranges with the same number of
requests in flight; the arms alternate, their order reversed every other trial.
`plain` drops what it reads: the store's rate here, the limit a pull meets.
`pull` is the node agent's (every range written into root-only staging and
hashed in file order, the entry sealed into a new cache); `disk` writes the
ranges to a file and checks nothing. The server's files are in the page cache
for every arm (warmed before the first trial, their residency recorded per
trial). Issue 24's target: a pull within 1.5x of `plain`.

"""


FAIR = """\
The published anchors, what each measured, and what carries over to these numbers.

**fast-vllm (j9smith), Llama-3.2-3B on one NVIDIA GPU in Docker.** Naive cold
start 81 s (its blog says 117 s) against about 6 s end to end from a CRIU image
of vLLM asleep at level 2 (the restore 2.5-3 s, then a weight reload), with the
page cache dropped before each run and the pages images warmed by `vmtouch -t`
in 8 parallel processes (our "vmtouch -t xN"). Comparable: the ratio (13.5x),
since both sides restore a sleeping vLLM process and reload its weights after.
Not comparable: absolute seconds. Theirs include the CUDA context and GPU memory
restore and a PCIe copy of the weights; ours are a CPU-only tree whose weights
stay in host memory.

**vLLM `snapshot` (vLLM PR #51360), Qwen3-0.6B, TP=1, a laptop RTX 4090.**
`vllm snapshot restore` in 2.9-3.2 s (create 59 s, a 3.57 GB artifact). Closest
in mechanism (CRIU plus cuda-checkpoint of an initialised engine, weights read
again) and near our tiny and SmolLM2 models in size, so seconds are roughly
comparable, with two differences: their clock starts at the restore command,
ours at the agent's launch, and ours ends at the first token, which is stricter.

**NVIDIA Dynamo snapshots, B200 GPUs and local NVMe.** Under 6 s at every size
up to Qwen2.5-72B once the weights live outside the CRIU image (their GPU
Memory Service; a proof of concept with 8 SSDs); Qwen3-8B (26 GiB image) went
from 24 s with upstream CRIU to 11 s with native AIO page reads and 4.7 s with
the pinned memfd buffers restored in parallel. Their disks and GPUs are far
faster than this 2-core VM with a virtual disk: compare our restore against our
disk-read floor (the time to read the image once, cold, in the same run), not
their seconds. Their AIO page reads are in upstream CRIU now (PR #3022, merged
2026-05: batched io_submit per VMA, up to 128 reads in flight); our patched CRIU
maps the pages images instead of reading them, so with a warm cache it reads
nothing at all, and cold it is bounded by the same disk as AIO would be.

Not comparable at all: a GPU number against a CPU one in absolute seconds, and a
ratio taken across runs or machines. Every ratio in this report is taken within
one run of one benchmark on one machine.
"""


# The targets: restore-to-first-token against naive (warm), cold against the floor.
TARGET_WARM_X = 30.0
TARGET_COLD_FLOOR_X = 1.2


# Not a Rekindle restore: the simplest alternative, shown beside the best one.
PLAIN_CRIU = "plain-criu"


def headline_local(res: Results, name: str = "local", model: str = "tiny model") -> list[str]:
    """Naive vs the best of Rekindle's restore paths per cache (plain CRIU beside it), with
    per-trial values, against the targets."""
    local = res.doc(name)
    if not local:
        return []
    out = []
    s, runs = local["summary"], local.get("runs") or []
    for cache in ("warm", "cold"):
        naive = s.get(f"naive/{cache}")
        restores = [
            r
            for k, r in s.items()
            if k.endswith(f"/{cache}")
            and r.get("speedup_vs_naive")
            and not k.startswith(PLAIN_CRIU)
        ]
        best = min(restores, key=lambda r: r["ttft_median"], default=None)
        if not (naive and best):
            continue
        x = naive["ttft_median"] / best["ttft_median"]
        n_t = per_trial(runs, "ttft", variant="naive", cache=cache)
        b_t = per_trial(runs, "ttft", variant=best["variant"], cache=cache)
        each = best.get("speedup_per_trial") or trial_ratios(n_t, b_t)
        line = (
            f"- Process level, {model}, {cache} page cache (`rekindle-dev bench local`): naive "
            f"{naive['ttft_median']:.2f} s, best restore ({best['variant']}) "
            f"{best['ttft_median']:.2f} s to the first token: **{x:.1f}x**"
        )
        if each:
            line += (
                f" (per trial {joined(each, '{:.1f}', 'x')}: naive {joined(n_t.values())} s, "
                f"restore {joined(b_t.values())} s)"
            )
        if cache == "warm":
            verdict = "meets" if x >= TARGET_WARM_X else "misses"
            line += f"; the target is {TARGET_WARM_X:.0f}x: {verdict} it"
            if x < TARGET_WARM_X:
                need = naive["ttft_median"] / TARGET_WARM_X
                line += f" (it needs {need:.2f} s, {best['ttft_median'] - need:.2f} s less)"
        plain = s.get(f"{PLAIN_CRIU}/{cache}")
        if "speedup_vs_plain_criu" in best:
            line += (
                "; against plain CRIU of the whole server (stock CRIU, no agent"
                + (f", {plain['ttft_median']:.2f} s" if plain else "")
                + f") {best['speedup_vs_plain_criu']:.2f}x"
            )
        if "vs_disk_floor" in best:
            line += (
                f"; {best['vs_disk_floor']:.2f}x the cold disk-read floor "
                f"(target {TARGET_COLD_FLOOR_X}x)"
            )
        if cache == "cold":
            gbps = disk_gbps(local)
            disk = (local.get("host") or {}).get("disk") or "a disk this file does not name"
            line += (
                "; cold = the guest's page cache dropped, the host may still cache the virtual "
                "disk"
                + (f" (the run's disk floor read {gbps:.2f} GB/s from {disk})" if gbps else "")
            )
        cell = residency_cell(best)
        unit = " %" if cell[:1].isdigit() else ""
        out.append(f"{line}; page cache before that restore: {cell}{unit}. From {cite(res, name)}.")
    return out


def headline_ladder(res: Results) -> list[str]:
    """Per ladder size and cache: naive against the best restore, as a fraction, with the
    per-trial fractions and the reload's rate with and without the dump's check."""
    rels = [res.rel("ladder")] + [
        f"ladder/{p.name}/results.json" for p in sorted((res.bench / "ladder").glob("*/"))
    ]
    out = []
    for rel in rels:
        doc = res.read(rel)
        if not doc:
            continue
        st = res.status_of(rel)
        where = f"`{st.path}` ({load_span(doc)})" + ("" if st.current else f", **{st.label}**")
        for result in doc.get("results", []):
            s = result.get("summary", {})
            for cache in ("warm", "cold"):
                naive = s.get(f"naive/{cache}")
                restores = [
                    {"variant": k.split("/")[0], **r}
                    for k, r in s.items()
                    if k.endswith(f"/{cache}")
                    and not k.startswith("naive")
                    and not k.startswith(PLAIN_CRIU)
                ]
                best = min(restores, key=lambda r: r["ttft_median"], default=None)
                if not (naive and best):
                    continue
                x = naive["ttft_median"] / best["ttft_median"]
                line = (
                    f"- Size ladder, {result['size']}, {cache} page cache (`rekindle-dev bench "
                    f"ladder`): naive {naive['ttft_median']:.2f} s, restore "
                    f"({best['variant']}) {best['ttft_median']:.2f} s: **1/{x:.1f}**"
                )
                runs = result.get("runs") or []
                each = [1 / f for f in best.get("fraction_per_trial") or [] if f] or trial_ratios(
                    per_trial(runs, "ttft", variant="naive", cache=cache),
                    per_trial(runs, "ttft", variant=best["variant"], cache=cache),
                )
                if each:
                    line += f" (per trial {', '.join(f'1/{v:.1f}' for v in each)})"
                line += plain_note(s.get(f"{PLAIN_CRIU}/{cache}"), best)
                out.append(f"{line}{reload_note(best, cache)}. From {where}.")
    return out


def plain_note(plain: dict[str, Any] | None, best: dict[str, Any]) -> str:
    """Plain CRIU of the whole server beside the restore, whichever is faster."""
    if not plain:
        return ""
    ratio = plain["ttft_median"] / best["ttft_median"]
    who = (
        f"the restore is {ratio:.2f}x faster"
        if ratio >= 1
        else (f"**plain CRIU is {1 / ratio:.2f}x faster**")
    )
    took = f"{plain['ttft_median']:.2f} s"
    return f"; plain CRIU of the whole server (stock CRIU, no agent) {took}: {who}"


def reload_note(row: dict[str, Any], cache: str) -> str:
    """The ladder's weight reload with and without the wait for the dump's BLAKE3 check;
    a cold trial's reload reads what the prefetcher already brought into the page cache."""
    plain = row.get("reload_gb_per_s_median")
    if not plain:
        return ""
    checked = row.get("reload_checked_gb_per_s_median")
    if (
        checked is None
        and row.get("reload_checked_vs_best_read")
        and row.get("read_best_gbps_median")
    ):
        checked = row["reload_checked_vs_best_read"] * row["read_best_gbps_median"]
    text = f"; weight reload {plain:.1f} GB/s without the wait for the dump's BLAKE3 check, "
    text += f"{checked:.1f} GB/s with it" if checked else "with it: not recorded in this file"
    if cache == "cold":
        text += " (the reload reads what the prefetcher had read into the page cache: not cold)"
    if row.get("repack_seconds_median") is not None:
        text += f", then {row['repack_seconds_median']:.2f} s of CPU GEMM repack"
    else:
        text += " (reload_weights as a whole: this file does not split off the CPU GEMM repack)"
    return text


def headline_cluster(res: Results) -> list[str]:
    cluster = res.doc("cluster")
    if not (cluster and {"naive", "restore"} <= set(cluster["summary"])):
        return []
    n = cluster["summary"]["naive"]["first_token_s"]["median"]
    r = cluster["summary"]["restore"]["first_token_s"]["median"]
    trials = cluster.get("trials") or []
    n_t = per_trial(trials, "first_token_s", arm="naive")
    r_t = per_trial(trials, "first_token_s", arm="restore")
    each = trial_ratios(n_t, r_t)
    per = (
        f" (per trial {joined(each, '{:.1f}', 'x')}: naive {joined(n_t.values(), '{:.1f}')} s, "
        f"restore {joined(r_t.values())} s)"
        if each
        else ""
    )
    return [
        f"- Cluster, scale 0 to 1 to the first token answered through the Service, asked once "
        f"the pod is Ready (`kubectl rekindle bench`): naive {n:.1f} s, restore {r:.2f} s: "
        f"**{n / r:.1f}x**{per}. From {cite(res, 'cluster')}."
    ]


def headline_weights(res: Results) -> list[str]:
    """The mapped reload with and without the dump's BLAKE3 check, cold only where it was."""
    doc = res.doc("weights")
    if not doc:
        return []
    out = []
    for wset, caches in doc.get("summary", {}).items():
        for cache, methods in caches.items():
            plain = methods.get("rekindle_fresh_map")
            if not plain:
                continue
            checked = methods.get("rekindle_fresh_map_checked")
            if cache == "cold" and not cold_valid(plain):
                continue
            runs = doc.get("runs") or []
            plain_each = gbps_trials(runs, wset, "rekindle_fresh_map", cache)
            checked_each = gbps_trials(runs, wset, "rekindle_fresh_map_checked", cache)
            with_check = (
                f"{checked['gbps_median']:.2f} GB/s with it{checked_each}"
                if checked
                else "with it: not measured in this file"
            )
            label = "warm page cache" if cache == "warm" else "cold (guest page cache dropped)"
            out.append(
                f"- Weight reload into fresh memory by mapping the dump, {wset}, {label} "
                f"(`rekindle-dev bench weights`): {plain['gbps_median']:.2f} GB/s without the "
                f"dump's BLAKE3 check{plain_each}, {with_check}. From {cite(res, 'weights')}."
            )
    return out


def gbps_trials(runs: list[dict[str, Any]], wset: str, method: str, cache: str) -> str:
    """The per-trial GB/s of one bench weights row, as " (per trial a/b/c)" ("" with one)."""
    vals = per_trial(runs, "gbps", set=wset, method=method, cache=cache).values()
    return f" (per trial {joined(vals)})" if len(vals) > 1 else ""


def cold_valid(entry: dict[str, Any]) -> bool:
    """A "cold" row whose bytes were not in the guest's page cache before it (<= 1 %)."""
    cached = entry.get("cached_median")
    return cached is not None and cached <= 0.01


def headline_mm(res: Results) -> list[str]:
    doc = res.doc("mm")
    s = (doc or {}).get("summary") or {}
    if not {"shm", "off"} <= set(s):
        return []
    runs = doc.get("runs") or [] if doc else []
    shm = per_trial(runs, "requests_per_s", config="shm")
    vs_off = trial_ratios(shm, per_trial(runs, "requests_per_s", config="off"))
    line = (
        "- Multimodal processor cache, vLLM's own feature measured against vLLM's own off "
        "switch (`--mm-processor-cache-gb 0`): the shm cache the operator turns on gives "
        f"{s['shm']['requests_per_s'] / s['off']['requests_per_s']:.2f}x the throughput of off"
        + (f" (per trial {joined(vs_off, unit='x')})" if vs_off else "")
    )
    if "lru" in s:
        vs_lru = trial_ratios(shm, per_trial(runs, "requests_per_s", config="lru"))
        line += (
            f", and {s['shm']['requests_per_s'] / s['lru']['requests_per_s']:.2f}x that of "
            f"vLLM's default LRU cache"
            + (f" (per trial {joined(vs_lru, unit='x')})" if vs_lru else "")
            + f"; LRU against off: {s['lru']['requests_per_s'] / s['off']['requests_per_s']:.2f}x"
        )
    return [line + f". From {cite(res, 'mm')}."]


def headline_kv(res: Results) -> list[str]:
    doc = res.doc("kv")
    s = (doc or {}).get("summary") or {}
    reuse = [r for r in s.values() if r["variant"] == "reuse" and r.get("speedup")]
    if not reuse:
        return []
    last = max(reuse, key=lambda r: r["turn"])
    base = s[f"no-reuse/{last['turn']}"]
    runs = (doc or {}).get("runs") or []
    each = trial_ratios(
        per_trial(runs, "ttft", variant="no-reuse", turn=last["turn"]),
        per_trial(runs, "ttft", variant="reuse", turn=last["turn"]),
    )
    return [
        "- KV reuse across chat turns, vLLM's own automatic prefix caching measured against "
        "vLLM's own off switch (`--no-enable-prefix-caching`), the same model on both: at turn "
        f"{last['turn'] + 1} ({last['prompt_tokens']} prompt tokens, {last['hits_median']} "
        f"reused) the first token takes {last['ttft_median']:.2f} s with it, "
        f"{base['ttft_median']:.2f} s without: **{last['speedup']:.1f}x**"
        + (f" (per trial {joined(each, '{:.1f}', 'x')})" if each else "")
        + f". From {cite(res, 'kv')}."
    ]


def headline(res: Results | Path) -> str:
    """The ratios that matter, each within its own run, with per-trial values and sources."""
    res = res if isinstance(res, Results) else Results(res)
    out = [
        *headline_local(res),
        *headline_local(res, "local-smollm2", "SmolLM2-135M"),
        *headline_ladder(res),
        *headline_cluster(res),
        *headline_weights(res),
        *headline_mm(res),
        *headline_kv(res),
    ]
    warm = res.doc("warm")
    if warm:
        out.append(
            f"- Warming (`rekindle-dev bench warm`): {warm['verdict']}. From {cite(res, 'warm')}."
        )
    if not out:
        return "_No results collected yet._\n"
    return "\n".join(out) + "\n"


def cold_start_plot(bench: Path | Results, path: Path) -> bool:
    """Stacked bars: the naive boot by vLLM's phases, each restore path by the agent's."""
    res = bench if isinstance(bench, Results) else Results(bench)
    naive, local = res.doc("naive"), res.doc("local")
    bars: list[tuple[str, dict[str, float]]] = []
    same_run = local_naive_rows(local)
    for r in same_run:  # the naive boots of the restores' own run, split by their vLLM logs
        bars.append((f"naive boot, vLLM log\n{r['cache']}, same run", r["vllm_split_median"]))
    if naive and not same_run:
        host = naive.get("host") or naive.get("machine") or {}
        la = host.get("load_avg") or host.get("load_avg_at_end") or [0.0]
        bars.append((f"naive boot, vLLM log\n(load {float(la[0]):.0f})", naive["phases"]))
    if local:
        for r in local["summary"].values():
            # Naive rows of the same run are already drawn, split by their vLLM logs.
            if r["variant"].startswith("disk") or (same_run and r["variant"] == "naive"):
                continue
            bars.append((f"{r['variant']}\n{r['cache']}", r.get("phases_median", {})))
    if not bars:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(dict.fromkeys(p for _, ph in bars for p in ph))
    restores = [b for b in bars if not b[0].startswith("naive")]
    palette = [plt.get_cmap(name)(i) for name in ("tab20", "tab20b") for i in range(20)]
    panels = [bars, restores] if len(restores) < len(bars) and restores else [bars]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, group in zip(axes[0], panels, strict=True):
        for i, (_, ph) in enumerate(group):
            left = 0.0
            for p, value in ph.items():  # in the bar's own order; one color per phase name
                v = float(value)
                if v > 0:
                    color = palette[phases.index(p) % len(palette)]
                    ax.barh(i, v, left=left, color=color, label=p)
                    left += v
        ax.set_yticks(range(len(group)), [b[0] for b in group], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds from launch (median)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=False))
    axes[0][-1].legend(seen.values(), seen.keys(), fontsize=7, loc="lower right")
    axes[0][0].set_title("cold start, phase by phase")
    if len(panels) > 1:
        axes[0][1].set_title("restore paths only")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def section_weights(res: Results) -> str:
    body = section_embedded(res, "weights")
    doc = res.doc("weights")
    cold = cold_meaning(doc, cold_read_gbps(doc), "the weight dump") + (
        " A cold row whose file was partly cached before it (the cached-before column) is "
        "not cold: the bench marks it."
    )
    more = [
        (name, title)
        for name, title in (
            ("weights-sizes", "1, 4 and 8 GiB, and the tiny model on vLLM (copying reload)"),
            ("weights-direct", "O_DIRECT reads (staged path)"),
        )
        if res.doc(name) is not None
    ]
    extra = [f"\n#### {title}\n\n{section_embedded(res, name)}" for name, title in more]
    return "\n".join([cold, "", body, *extra])


def cold_read_gbps(doc: dict[str, Any] | None) -> float | None:
    """bench weights' cold page-cache read of the dump (its N-thread read), GB/s."""
    for caches in (doc or {}).get("summary", {}).values():
        entry = caches.get("cold", {}).get("pagecache")
        if entry:
            return float(entry["gbps_median"])
    return None


def section_mm(res: Results) -> str:
    return (
        "The multimodal processor cache is vLLM's own feature: every ratio here compares it "
        "with vLLM's own off switch (`--mm-processor-cache-gb 0`) or with vLLM's default LRU "
        "cache, not with anything Rekindle replaces. What the operator adds is the shm cache "
        "turned on and `/dev/shm` sized for it (docs/caches.md).\n\n" + section_embedded(res, "mm")
    )


def section_kv(res: Results) -> str:
    return (
        "KV reuse is vLLM's own automatic prefix caching: the ratios compare it with vLLM's "
        "own off switch (`--no-enable-prefix-caching`), the same model and server otherwise. "
        "The operator keeps it on (spec.kvCache.prefixCaching).\n\n" + section_embedded(res, "kv")
    )


def section_warm(res: Results) -> str:
    doc = res.doc("warm")
    if doc is None:
        return missing("warm")
    parts = [
        "Residency is read with vmtouch before and after each trial (0% before proves the "
        "cache cold). The agent keeps its own prefetcher: the restore must check every "
        "byte it reads (BLAKE3, against the manifest), which vmtouch cannot do, so vmtouch "
        "would add a second read; see the verdict. " + cold_meaning(doc, None),
        "",
        source_note(res, "warm"),
        "",
        embed(res.bench, "warm"),
    ]
    if res.doc("warm-synthetic") is not None:
        parts += [source_note(res, "warm-synthetic"), "", embed(res.bench, "warm/synthetic")]
    return "\n".join(parts)


def results_files(res: Results) -> str:
    """Every results file under the bench directory, its commit, date, load and status."""
    rels = res.all_files()
    if not rels:
        return "_No results files._\n"
    cited = {res.rel(n) for n in SOURCES} | {
        f"ladder/{p.name}/results.json" for p in (res.bench / "ladder").glob("*/")
    }
    rows = [
        "| file | commit | date | load average at start / end | status | in this report |",
        "|---|---|---|---|---|---|",
    ]
    stale = 0
    for rel in rels:
        st = res.status_of(rel)
        doc = res.read(rel) or {}
        host = doc.get("host") or {}
        start, end = host.get("load_avg_at_start"), host.get("load_avg_at_end")
        load = f"{_loads(start) if start else '-'} / {_loads(end) if end else '-'}"
        why = "" if st.current else f": {st.why()}"
        stale += not st.current
        rows.append(
            f"| `{st.path}` | {st.commit[:10] or '-'} | {st.date or '-'} | {load} | "
            f"{st.label}{' (recovered)' if st.recovered else ''}{why} | "
            f"{'yes' if rel in cited else 'no'} |"
        )
    return (
        f"{len(rels)} results files; {stale} not current (STALE: no commit, or the code they "
        "measured changed since, or uncommitted changes to it now; DIRTY TREE: made from a "
        'tree with uncommitted changes to it). "recovered": the file predates the benches '
        "recording a commit; its commit is the one that last wrote it (git history), so its "
        "numbers were measured at or before it.\n\n" + "\n".join(rows) + "\n"
    )


def report(bench: Path, command: str, repo: Path | None = None) -> str:
    """docs/benchmarks.md from whatever bench holds."""
    res = Results(bench, repo)
    sections: list[tuple[str, Callable[[], str]]] = [
        ("Naive boot, phase by phase (vLLM's own log)", lambda: section_naive(res)),
        ("Restore paths vs naive boot, process level", lambda: section_local(res)),
        (
            "Inside CRIU: stock vs mmap restore",
            lambda: section_embedded(res, "criu", ("bench.md",)),
        ),
        (
            "Memory density",
            lambda: section_embedded(res, "density", ("results.md", "bench-density.md")),
        ),
        ("Weight reload", lambda: section_weights(res)),
        ("Size ladder (0.5B, 1.5B, 3B)", lambda: section_ladder(res)),
        ("Tensor parallel 2, tiny model", lambda: section_embedded(res, "tp2")),
        ("Warming a cold checkpoint: vmtouch vs the prefetcher", lambda: section_warm(res)),
        ("CRIU's kdat cache", lambda: section_embedded(res, "kdat")),
        ("Multimodal processor cache", lambda: section_mm(res)),
        ("KV reuse across chat turns", lambda: section_kv(res)),
        ("Cluster: pod to first token", lambda: section_cluster(res)),
        (
            "Cluster: restore through the node agent vs in the pod",
            lambda: NODE_AGENT_NOTE + section_embedded(res, "node-agent"),
        ),
        (
            "Cluster: a new replica on a warm node, on a pulling node, naive",
            lambda: SCALE_OUT_NOTE + section_embedded(res, "scale-out"),
        ),
        (
            "Object store: the verified pull vs a plain parallel reader",
            lambda: STORE_NOTE + section_embedded(res, "store"),
        ),
        (
            "Cluster: scale from zero through the front and KEDA",
            lambda: SCALE_FROM_ZERO_NOTE + section_embedded(res, "scale-from-zero"),
        ),
        (
            "Cluster: a load step answered by a second replica",
            lambda: LOAD_STEP_NOTE + section_embedded(res, "load-step"),
        ),
        (
            "Serving path: the agent's proxy vs vLLM's own port",
            lambda: PROXY_NOTE + section_embedded(res, "proxy"),
        ),
        ("GPU: a CUDA process through the driver and CRIU (one H100)", lambda: section_gpu(res)),
        ("Local cluster start", lambda: section_cluster_up(res)),
        ("Test suite: make test against its budget", lambda: section_embedded(res, "suite")),
    ]
    m = machine()
    head = [
        "# Benchmarks",
        "",
        release_line(),
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        "regenerate with `rekindle-dev bench report --collect` (collect only) or without "
        "`--collect` (also runs the quick parts). Every figure names the results file it came "
        "from (docs/bench/), with the commit that file was made from; a file whose commit is "
        "missing or whose measured code changed since is marked **STALE** where it is cited "
        "and in [Results files](#results-files). Each section names the command behind its "
        "figures and the machine and load average it ran under; ratios are taken within one "
        "run only.",
        "",
        f"This machine now: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB memory, "
        f"kernel {m['kernel']}, disk {m['disk']}, load average "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])}. It is shared: timings taken under "
        "load are slower and noisier than on a quiet machine, and each section says its load.",
        "",
    ]
    body = [f"## Headline (each ratio within one run)\n\n{headline(res)}"]
    body += [f"## {title}\n\n{fn()}" for title, fn in sections]
    body += [f"## Results files\n\n{results_files(res)}"]
    return "\n".join([*head, *body, "## Fair comparison\n", FAIR])


def stale_sources(res: Results) -> list[prov.Status]:
    """The cited results files that are not current (what --strict refuses)."""
    seen = {res.rel(n) for n in SOURCES if res.doc(n) is not None}
    return [st for st in (res.status_of(r) for r in sorted(seen)) if not st.current]


def command_line(args: argparse.Namespace) -> str:
    if args.collect:
        return "rekindle-dev bench report --collect"
    return f"rekindle-dev bench report --run {args.run} --trials {args.trials}"


def run(args: argparse.Namespace) -> int:
    if args.recover:
        return run_recover(args.recover)
    if args.stamp_cluster:
        return run_stamp_cluster(Path(args.stamp_cluster), args.save)
    bench = Path(args.bench_dir)
    if not args.collect:
        for part in [p for p in args.run.split(",") if p]:
            run_part(part, args, bench)
    res = Results(bench)
    if args.strict and (bad := stale_sources(res)):
        for st in bad:
            log(f"{st.path}: {st.label}: {st.why()}")
        log(f"--strict: {len(bad)} results files are not current; no report written")
        return 1
    cold_start_plot(res, bench / "report" / "cold-start.png")
    text = report(bench, command_line(args), res.repo)
    Path(args.out).write_text(text)
    log(f"wrote {args.out}")
    return 0


def run_recover(paths: Sequence[str]) -> int:
    """--recover: give old results files (no commit) the one git history holds for them."""
    for name in paths:
        path = Path(name).resolve()
        root = git_root(path.parent)
        if root is None:
            log(f"{name}: not in a git checkout")
            return 2
        rel = str(path.relative_to((root / "docs" / "bench").resolve()))
        done = prov.recover(path, prov.MEASURED_BY.get(prov.bench_of(rel), ()), root)
        log(f"{name}: {'recovered' if done else 'has a commit already (or none in git): left'}")
    return 0


# --stamp-cluster takes the checkout's commit for results finished at most this long ago.
STAMP_WITHIN_S = 30 * 60


def age_s(stamp: str) -> float | None:
    """Seconds since a UTC time written as 2026-11-25T22:50:00Z (None if not one)."""
    try:
        return time.time() - calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return None


def run_stamp_cluster(path: Path, save: str | None) -> int:
    """--stamp-cluster: add this checkout's commit to `kubectl rekindle bench --json`'s
    results (the plugin ships without git or the dev tools); --save copies the stamped
    results, with their plot and summary beside them, into a directory under docs/bench."""
    doc = json.loads(path.read_text())
    if doc.get("commit"):
        log(f"{path} has a commit already: --stamp-cluster is for fresh results only")
        return 2
    age = age_s(str(doc.get("finished") or ""))
    if age is None or age > STAMP_WITHIN_S:
        log(
            f"{path}: not finished in the last {STAMP_WITHIN_S // 60} minutes (or made by an "
            "older plugin): this checkout need not be the code that ran it; not stamped"
        )
        return 2
    la = (doc.get("client") or {}).get("load_avg_at_start") or os.getloadavg()
    load_start = (float(la[0]), float(la[1]), float(la[2]))
    stamp = provenance(
        doc.get("command", "kubectl rekindle bench"),
        prov.MEASURED_BY["cluster"],
        load_start,
    )
    for key in ("commit", "dirty", "measured_paths"):
        doc[key] = stamp[key]
    doc.setdefault("date", stamp["date"])
    doc["stamped"] = {"by": "rekindle-dev bench report --stamp-cluster", "at": stamp["finished"]}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    log(
        f"{path}: commit {doc['commit'][:10] or 'unknown'}{' (dirty tree)' if doc['dirty'] else ''}"
    )
    if save:
        dest = Path(save)
        dest.mkdir(parents=True, exist_ok=True)
        for src in [path, *(path.with_name(n) for n in ("bench.png", "summary.txt"))]:
            if src.exists():
                shutil.copyfile(src, dest / ("bench.json" if src == path else src.name))
        log(f"saved into {dest}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--collect", action="store_true", help="run nothing; collect docs/bench/")
    p.add_argument(
        "--run",
        default=",".join(QUICK),
        help="parts to run first (naive, warm, weights, criu, local); default the quick ones",
    )
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--criu-prefix", default="", help="scripts/build-criu's output (for local)")
    p.add_argument("--model", help="model for the naive boot (default: the tiny model)")
    p.add_argument("--work", default="/var/tmp/rekindle-bench-report", help="scratch (on disk)")
    p.add_argument("--bench-dir", default="docs/bench")
    p.add_argument("--out", default="docs/benchmarks.md")
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse (exit 1, write nothing) when a cited results file is not current",
    )
    p.add_argument(
        "--recover",
        nargs="+",
        metavar="FILE",
        help="only give these old results files (docs/bench/..., no commit) the commit that "
        "last wrote them, from git history, marked as recovered",
    )
    p.add_argument(
        "--stamp-cluster",
        metavar="FILE",
        help="only add this checkout's commit to a `kubectl rekindle bench --json` file",
    )
    p.add_argument("--save", metavar="DIR", help="with --stamp-cluster: copy the results here")
