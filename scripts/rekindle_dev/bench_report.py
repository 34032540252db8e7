"""`rekindle-dev bench report`: every benchmark's results in one page, docs/benchmarks.md.

Full mode runs the quick parts first (a naive boot of the tiny model whose vLLM
log is split into phases, and whatever --run names: warm, criu, weights,
local), then collects; --collect only collects what docs/bench/ holds. Every
section names the command behind its figures, the machine and the load it ran
under; ratios are only taken between numbers of one run. Sections whose
results are missing say which command makes them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rekindle_dev.bench_common import NAIVE_PHASES, parse_vllm_log, residency_cell
from rekindle_dev.machine import machine

# Where each benchmark writes, and the command that writes it (for a missing one).
SOURCES: dict[str, tuple[str, str]] = {
    "local": ("local/results.json", "rekindle-dev bench local --criu-prefix DIR --trials 3"),
    "criu": ("criu/bench.json", "scripts/bench-criu --sizes 0.5,1,2,4 --trials 5"),
    "weights": ("weights/results.json", "rekindle-dev bench weights --sizes 1,4 --trials 3"),
    "ladder": ("ladder/results.json", "rekindle-dev bench ladder --criu-prefix DIR"),
    "mm": ("mm/results.json", "rekindle-dev bench mm"),
    "kv": ("kv/results.json", "rekindle-dev bench kv"),
    "warm": ("warm/results.json", "rekindle-dev bench warm --size-gb 2 --trials 5"),
    "cluster": ("cluster/bench.json", "kubectl rekindle -n rk-bench bench tiny --trials 3"),
    "naive": ("report/naive_boot.json", "rekindle-dev bench report --run naive"),
}
QUICK = ("naive", "warm")


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
    trials = [one_naive_boot(factory, i) for i in range(args.trials)]
    doc = median_boot(trials)
    doc.update(
        command=f"rekindle-dev bench report --run naive --trials {args.trials} --work {args.work}"
        + (f" --model {args.model}" if args.model else ""),
        model=str(args.model or "the tiny model (rekindle-dev model tiny)"),
        trials=trials,
        machine=machine(str(work)),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
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
        "warm": [*dev, "warm", "--trials", str(args.trials), "--out", str(out / "warm")],
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


# -- reading what the benchmarks wrote -------------------------------------------------


def load(bench: Path, name: str) -> dict[str, Any] | None:
    path = bench / SOURCES[name][0]
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return None


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
    la = host.get("load_avg") or host.get("load_avg_at_end") or doc.get("load_after")
    if la:
        parts.append("load average " + ", ".join(f"{float(x):.1f}" for x in la))
    return ", ".join(parts) or "machine not recorded"


def demote(md: str) -> str:
    """A benchmark's own results.md, its headings two levels down, inside the report."""
    return re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", md, flags=re.M)


def embed(bench: Path, sub: str, md_names: tuple[str, ...] = ("results.md",)) -> str:
    """A benchmark directory's own table (results.md or the named one) and its plot."""
    out = []
    for name in md_names:
        p = bench / sub / name
        if p.exists():
            out.append(demote(p.read_text().strip()))
            break
    for png in ("results.png", "bench.png"):
        if (bench / sub / png).exists():
            out.append(f"![{sub}](bench/{sub}/{png})")
            break
    return "\n\n".join(out) + "\n" if out else ""


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


def section_naive(bench: Path) -> str:
    """The naive split from bench local's run when it recorded one, else the separate run."""
    local = load(bench, "local")
    rows = local_naive_rows(local)
    if local and rows:
        return section_naive_same_run(local, rows)
    doc = load(bench, "naive")
    note = (
        f"bench local's results (`{local['command']}`) predate the per-boot split: not "
        "recorded there. "
        if local
        else ""
    )
    if doc is None:
        return note + missing("naive")
    return (
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


def section_local(bench: Path) -> str:
    doc = load(bench, "local")
    if doc is None:
        return missing("local")
    s = doc["summary"]
    rows = [
        "| path | cache | first token, median s | x naive (same run) | page cache before "
        "restore, % | phases, median s |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in s.values():
        ph = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phases_median", {}).items() if v >= 0.005)
        speed = r.get("speedup_vs_naive")
        rows.append(
            f"| {r['variant']}{' (mmap)' if r.get('mmap') else ''} | {r['cache']} | "
            f"{r['ttft_median']:.2f} | {f'{speed:.1f}x' if speed else '-'} | "
            f"{residency_cell(r)} | {ph} |"
        )
    inside = [
        f"- {r['variant']} {r['cache']}: "
        + ", ".join(f"{k} {v:.3f}" for k, v in r["criu_median"].items() if v)
        for r in s.values()
        if r.get("criu_median")
    ]
    if inside:  # CRIU's own stats and log, inside the criu_restore phase
        rows += ["", "Inside `criu_restore` (CRIU's stats file and its log, median s):", *inside]
    size = doc.get("checkpoint_bytes")
    return "\n".join(
        [
            "Every path runs the real agent as PID 1 of a fresh PID and mount namespace (as a "
            "new pod); first token = agent launch to the answer of a one-token completion. "
            "Warm: checkpoint in the page cache; cold: after `echo 3 > /proc/sys/vm/drop_caches`."
            + (f" Checkpoint: {size / 2**30:.2f} GiB." if size else "")
            + " Page cache before restore: how much of the checkpoint vmtouch (mincore) found "
            "cached just before each restore's launch, median (min-max) over the trials; "
            '"not recorded" for results made before the bench recorded it. '
            + residency_sentence(s.values()),
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


def section_ladder(bench: Path) -> str:
    """The ladder's own table, with what its run recorded of residency and the naive split."""
    doc = load(bench, "ladder")
    notes: list[str] = []
    for res in (doc or {}).get("results", []):
        s = res.get("summary", {})
        rows = [{"variant": k.split("/")[0], "cache": k.split("/")[1], **v} for k, v in s.items()]
        split = [r for r in rows if r["variant"] == "naive" and r.get("vllm_split_median")]
        how = (
            "Naive split: from each boot's own vLLM log in this run (the list after its table)."
            if split
            else "Naive split: not recorded in this run."
        )
        notes.append(f"- {res['size']}: {residency_sentence(rows) or 'No restore.'} {how}")
    head = ["Per size, from the ladder's own results:", *notes, ""] if notes else []
    return "\n".join([*head, section_embedded(bench, "ladder"), *ladder_runs(bench)])


def ladder_runs(bench: Path) -> list[str]:
    """Sizes run on their own (ladder/<size>/, one run each): their tables and plots."""
    out = []
    root = bench / "ladder"
    subs = sorted(p for p in root.iterdir() if (p / "results.md").exists()) if root.is_dir() else []
    for sub in subs:
        doc = (
            json.loads((sub / "results.json").read_text())
            if (sub / "results.json").exists()
            else {}
        )
        out += [f"#### {sub.name}, a run of its own", "", f"Machine: {load_note(doc)}.", ""]
        out.append(embed(bench, f"ladder/{sub.name}"))
    return out


def section_cluster(bench: Path) -> str:
    doc = load(bench, "cluster")
    if doc is None:
        return missing("cluster")
    s = doc["summary"]
    rows = ["| arm | n | pod Ready, median s | first token, median s |", "|---|---:|---:|---:|"]
    for arm, r in s.items():
        rows.append(
            f"| {arm} | {int(r['ready_s']['n'])} | {r['ready_s']['median']:.1f} | "
            f"{r['first_token_s']['median']:.1f} |"
        )
    ratio = ""
    if "naive" in s and "restore" in s:
        x = s["naive"]["first_token_s"]["median"] / s["restore"]["first_token_s"]["median"]
        ratio = f"First-token speedup within the run (median naive / median restore): {x:.1f}x."
    return "\n".join(
        [
            "Page cache before restore: not recorded by this benchmark (`kubectl rekindle "
            "status` shows each pod's). "
            "Scale 0 to 1 on the embedded local cluster, scale request to the pod's Ready and "
            f"to the first token; {doc.get('date', '')}.",
            "",
            *rows,
            "",
            ratio,
            "",
            f"Command: `{doc['command']}`",
            "",
            "![cluster](bench/cluster/bench.png)",
            "",
        ]
    )


def section_embedded(bench: Path, name: str, md: tuple[str, ...] = ("results.md",)) -> str:
    doc = load(bench, name)
    sub = SOURCES[name][0].split("/")[0]
    body = embed(bench, sub, md)
    if doc is None and not body:
        return missing(name)
    head = []
    cmd = None if doc is None else doc.get("command") or (doc.get("meta") or {}).get("command")
    if doc is not None and not (cmd and cmd in body):  # its own table already says both
        head.append(f"Machine: {load_note(doc)}." + (f" Command: `{cmd}`." if cmd else ""))
    return "\n".join([*head, "", body])


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


def headline(bench: Path) -> str:
    """The ratios that matter, each within its own run, against the targets."""
    out: list[str] = []
    local = load(bench, "local")
    if local:
        s = local["summary"]
        for cache in ("warm", "cold"):
            naive = s.get(f"naive/{cache}")
            restores = [
                r for k, r in s.items() if k.endswith(f"/{cache}") and r.get("speedup_vs_naive")
            ]
            best = min(restores, key=lambda r: r["ttft_median"], default=None)
            if naive and best:
                x = naive["ttft_median"] / best["ttft_median"]
                line = (
                    f"- Process level, {cache} page cache (`rekindle-dev bench local`): naive "
                    f"{naive['ttft_median']:.2f} s, best restore ({best['variant']}) "
                    f"{best['ttft_median']:.2f} s to the first token: **{x:.1f}x**"
                )
                if cache == "warm":
                    verdict = "meets" if x >= TARGET_WARM_X else "misses"
                    line += f"; the target is {TARGET_WARM_X:.0f}x: {verdict} it"
                    if x < TARGET_WARM_X:
                        need = naive["ttft_median"] / TARGET_WARM_X
                        line += f" (it needs {need:.2f} s, {best['ttft_median'] - need:.2f} s less)"
                if "vs_disk_floor" in best:
                    line += (
                        f"; {best['vs_disk_floor']:.2f}x the cold disk-read floor "
                        f"(target {TARGET_COLD_FLOOR_X}x)"
                    )
                cell = residency_cell(best)
                unit = " %" if cell[:1].isdigit() else ""
                out.append(f"{line}; page cache before that restore: {cell}{unit}.")
    cluster = load(bench, "cluster")
    if cluster and {"naive", "restore"} <= set(cluster["summary"]):
        n = cluster["summary"]["naive"]["first_token_s"]["median"]
        r = cluster["summary"]["restore"]["first_token_s"]["median"]
        out.append(
            f"- Cluster, scale 0 to 1 (`kubectl rekindle bench`): naive {n:.1f} s, restore "
            f"{r:.1f} s to the first token: **{n / r:.1f}x**."
        )
    warm = load(bench, "warm")
    if warm:
        out.append(f"- Warming (`rekindle-dev bench warm`): {warm['verdict']}.")
    if not out:
        return "_No results collected yet._\n"
    return "\n".join(out) + "\n"


def cold_start_plot(bench: Path, path: Path) -> bool:
    """Stacked bars: the naive boot by vLLM's phases, each restore path by the agent's."""
    naive, local = load(bench, "naive"), load(bench, "local")
    bars: list[tuple[str, dict[str, float]]] = []
    same_run = local_naive_rows(local)
    for r in same_run:  # the naive boots of the restores' own run, split by their vLLM logs
        bars.append((f"naive boot, vLLM log\n{r['cache']}, same run", r["vllm_split_median"]))
    if naive and not same_run:
        la = (naive.get("machine") or {}).get("load_avg") or [0.0]
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


def report(bench: Path, command: str) -> str:
    """docs/benchmarks.md from whatever bench holds."""
    sections: list[tuple[str, Callable[[], str]]] = [
        ("Naive boot, phase by phase (vLLM's own log)", lambda: section_naive(bench)),
        ("Restore paths vs naive boot, process level", lambda: section_local(bench)),
        (
            "Inside CRIU: stock vs mmap restore",
            lambda: section_embedded(bench, "criu", ("bench.md",)),
        ),
        ("Weight reload", lambda: section_embedded(bench, "weights")),
        ("Size ladder (0.5B, 1.5B, 3B)", lambda: section_ladder(bench)),
        ("Warming a cold checkpoint: vmtouch vs the prefetcher", lambda: section_warm(bench)),
        ("Multimodal processor cache", lambda: section_embedded(bench, "mm")),
        ("KV reuse across chat turns", lambda: section_embedded(bench, "kv")),
        ("Cluster: pod to first token", lambda: section_cluster(bench)),
    ]
    m = machine()
    head = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        "regenerate with `rekindle-dev bench report --collect` (collect only) or without "
        "`--collect` (also runs the quick parts). Each section comes from its benchmark's own "
        "results (docs/bench/), names the command behind its figures and the machine and load "
        "average it ran under; ratios are taken within one run only.",
        "",
        f"This machine now: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB memory, "
        f"kernel {m['kernel']}, disk {m['disk']}, load average "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])}. It is shared: timings taken under "
        "load are slower and noisier than on a quiet machine, and each section says its load.",
        "",
    ]
    body = [f"## Headline (each ratio within one run)\n\n{headline(bench)}"]
    body += [f"## {title}\n\n{fn()}" for title, fn in sections]
    return "\n".join([*head, *body, "## Fair comparison\n", FAIR])


def section_warm(bench: Path) -> str:
    doc = load(bench, "warm")
    if doc is None:
        return missing("warm")
    return "\n".join(
        [
            "Residency is read with vmtouch before and after each trial (0% before proves the "
            "cache cold). The agent keeps its own prefetcher: the restore must check every "
            "byte it reads (BLAKE3, against the manifest), which vmtouch cannot do, so vmtouch "
            "would add a second read; see the verdict.",
            "",
            embed(bench, "warm"),
            embed(bench, "warm/synthetic"),
        ]
    )


def command_line(args: argparse.Namespace) -> str:
    if args.collect:
        return "rekindle-dev bench report --collect"
    return f"rekindle-dev bench report --run {args.run} --trials {args.trials}"


def run(args: argparse.Namespace) -> int:
    bench = Path(args.bench_dir)
    if not args.collect:
        for part in [p for p in args.run.split(",") if p]:
            run_part(part, args, bench)
    cold_start_plot(bench, bench / "report" / "cold-start.png")
    text = report(bench, command_line(args))
    Path(args.out).write_text(text)
    log(f"wrote {args.out}")
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
