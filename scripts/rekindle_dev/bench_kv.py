"""`rekindle-dev bench kv`: time to first token per turn of a growing chat, KV reuse on and off.

Two real vLLM CPU servers serve the same model (default SmolLM2-135M-Instruct,
converted once into the cache), started with the contract's vllm_argv: one
with automatic prefix caching (vLLM's default and the operator's), one with
`--no-enable-prefix-caching` (spec.kvCache.prefixCaching: false). Each trial
is one conversation of --turns turns: every turn adds a new passage of about
--chunk-tokens tokens and a question to the history, so the prompt grows by
the same amount each turn while everything before it repeats. The servers
take turns (the order alternates per trial), so both see the same machine
load; each trial's conversation starts with its own line, so no trial reuses
another's KV. Per turn: time to the first streamed token (TTFT), the prompt's
tokens and the prefix-cache hits vLLM counted (`vllm:prefix_cache_hits`).
Answers are greedy and compared between the two servers.

Each number in the table is the median of --trials trials, all in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rekindle_agent.supervision.vllm_control import wait_health
from rekindle_agent.supervision.vllm_launch import vllm_env
from rekindle_contract.vllm_argv import VllmOptions, vllm_argv

from rekindle_dev.bench_common import md_table, provenance, pyplot, save_figure, spread
from rekindle_dev.bench_provenance import MEASURED_BY, provenance_line
from rekindle_dev.ports import free_port
from rekindle_dev.vllm_runner import _kill_group

SERVED = "bench"
VARIANTS = ("reuse", "no-reuse")  # prefix caching on, off
PLACES = ["Dover", "Calais", "Ostend", "Bergen", "Cork", "Bilbao", "Genoa", "Naples", "Riga"]
WORDS_PER_TOKEN = 0.75  # rough English ratio, only to size the passages


def log(msg: str) -> None:
    print(f"[bench kv {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def passage(trial: int, turn: int, tokens: int) -> str:
    """A varied, deterministic passage of about `tokens` tokens (no sentence repeats)."""
    lines = []
    n = 0
    i = 0
    while n < tokens * WORDS_PER_TOKEN:
        d = turn * 1000 + i
        line = (
            f"Entry {turn}.{i}: the ferry left {PLACES[d % len(PLACES)]} at {6 + d % 12} "
            f"o'clock with {40 + (d * 37 + trial) % 200} passengers and {3 + (d * 7) % 20} cars."
        )
        lines.append(line)
        n += len(line.split())
        i += 1
    return "\n".join(lines)


def conversation(trial: int, turns: int, chunk_tokens: int) -> list[list[dict[str, str]]]:
    """The messages of each turn: the whole history, then a new passage and a question.

    The assistant's earlier answers in the history are fixed text, so both
    servers see exactly the same prompts whatever they answered.
    """
    history = [
        {
            "role": "system",
            "content": f"Session {trial}. You keep the harbour log and answer briefly.",
        }
    ]
    out = []
    for t in range(turns):
        history.append(
            {
                "role": "user",
                "content": passage(trial, t, chunk_tokens)
                + f"\nQuestion {t}: which port appears first in entry {t}.0?",
            }
        )
        out.append([dict(m) for m in history])
        history.append({"role": "assistant", "content": f"Noted entries {t}.*."})
    return out


def prefix_hits(url: str) -> tuple[int, int]:
    """(queries, hits) in tokens: vLLM's prefix-cache counters, summed over engines."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    q = h = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == "vllm:prefix_cache_queries_total":
            q += float(line.rsplit(" ", 1)[1])
        elif name == "vllm:prefix_cache_hits_total":
            h += float(line.rsplit(" ", 1)[1])
    return int(q), int(h)


def stream_chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One greedy streamed chat request: TTFT (to the first content token), answer, usage."""
    body = {
        "model": SERVED,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    ttft = None
    text = ""
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
            for choice in doc.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.monotonic() - t0
                text += piece
    total = time.monotonic() - t0
    return {
        "ttft": ttft if ttft is not None else total,
        "total": total,
        "answer": text,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
    }


@contextmanager
def server(model: Path, prefix_caching: bool, log_path: Path, max_len: int) -> Iterator[str]:
    """A vLLM CPU server as the agent would start it (its argv and env), without the agent."""
    opts = VllmOptions(
        model=str(model),
        served_name=SERVED,
        port=free_port(),
        max_model_len=max_len,
        worker_extension=None,
        prefix_caching=prefix_caching,
    )
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            vllm_argv(opts),
            env=vllm_env(opts.device),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://{opts.host}:{opts.port}"
    try:
        wait_health(url, 900, alive=lambda: proc.poll() is None)
        yield url
    finally:
        _kill_group(proc)


def one_turn(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    q0, h0 = prefix_hits(url)
    r = stream_chat(url, messages, max_tokens)
    # The counters follow the engine's stats, which can trail the stream's end.
    deadline = time.monotonic() + 10
    while True:
        q1, h1 = prefix_hits(url)
        if q1 - q0 >= r["prompt_tokens"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    r.update(hits=h1 - h0, queries=q1 - q0)
    return r


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant and turn: median TTFT (min, max), median prompt tokens and hits."""
    out: dict[str, Any] = {}
    for v in VARIANTS:
        for turn in sorted({r["turn"] for r in runs}):
            rs = [r for r in runs if r["variant"] == v and r["turn"] == turn]
            if not rs:
                continue
            ttfts = [r["ttft"] for r in rs]
            out[f"{v}/{turn}"] = {
                "variant": v,
                "turn": turn,
                "trials": len(rs),
                "prompt_tokens": int(statistics.median(r["prompt_tokens"] for r in rs)),
                "hits_median": int(statistics.median(r["hits"] for r in rs)),
                "ttft_median": statistics.median(ttfts),
                "ttft_min": min(ttfts),
                "ttft_max": max(ttfts),
            }
    for s in out.values():
        if s["variant"] == "reuse":
            base = out.get(f"no-reuse/{s['turn']}")
            if base:
                s["speedup"] = base["ttft_median"] / s["ttft_median"]
    return out


def table(summary: dict[str, Any]) -> str:
    header = (
        "turn",
        "prompt tokens",
        "reused tokens (hits)",
        "TTFT reuse (s)",
        "TTFT no reuse (s)",
        "x faster",
    )
    rows = [
        (
            str(s["turn"] + 1),
            str(s["prompt_tokens"]),
            str(s["hits_median"]),
            spread(s, "ttft_median", lo="ttft_min", hi="ttft_max"),
            spread(base, "ttft_median", lo="ttft_min", hi="ttft_max"),
            f"{s.get('speedup', 0):.1f}",
        )
        for s in summary.values()
        if s["variant"] == "reuse" and (base := summary.get(f"no-reuse/{s['turn']}"))
    ]
    return md_table(header, rows)


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    fig, ax = pyplot().subplots(figsize=(9, 5))
    for v, style in zip(VARIANTS, ("o-", "s--"), strict=True):
        rows = [s for s in summary.values() if s["variant"] == v]
        xs = [s["prompt_tokens"] for s in rows]
        ys = [s["ttft_median"] for s in rows]
        err = [
            [s["ttft_median"] - s["ttft_min"] for s in rows],
            [s["ttft_max"] - s["ttft_median"] for s in rows],
        ]
        label = "prefix caching on" if v == "reuse" else "prefix caching off"
        ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=label)
    ax.set_xlabel("prompt tokens of the turn (the whole conversation so far)")
    ax.set_ylabel("time to first token, s (median; whiskers min-max)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)


def command_line(args: argparse.Namespace) -> str:
    parts = ["rekindle-dev bench kv", f"--trials {args.trials}", f"--turns {args.turns}"]
    parts += [f"--chunk-tokens {args.chunk_tokens}", f"--max-tokens {args.max_tokens}"]
    if args.model:
        parts.append(f"--model {args.model}")
    return " ".join([*parts, f"--work {args.work}", f"--out {args.out}"])


def render(out: Path, doc: dict[str, Any]) -> str:
    text = table(doc["summary"])
    host = doc["host"]
    (out / "results.md").write_text(
        f"`{doc['command']}`\n\non {host['node']} ({host['cpus']} CPUs, load average "
        f"{host['load_avg_at_start'][0]:.1f} at start, {host['load_avg_at_end'][0]:.1f} at end; "
        f"model {doc['model_name']}, vLLM CPU). {provenance_line(doc)}\n\n"
        "Prefix caching is vLLM's own feature: \"no reuse\" is vLLM's own off switch "
        "(`--no-enable-prefix-caching`), the same model and server otherwise.\n\n" + text
    )
    plot(
        doc["summary"],
        out / "results.png",
        f"rekindle-dev bench kv: {doc['model_name']} on vLLM CPU, {host['cpus']} CPUs, "
        f"{doc['trials']} trials",
    )
    return text


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.replot:
        doc = json.loads((out / "results.json").read_text())
        print(render(out, doc))
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        from rekindle_dev.smollm2 import build_cached, default_cache_root, print_progress

        model = build_cached(default_cache_root(), print_progress)
    # Passages are sized by words and run to about 1.6 tokens per "token" asked for.
    max_len = args.turns * (2 * args.chunk_tokens + 64) + 512
    started, load_start = time.time(), os.getloadavg()
    runs: list[dict[str, Any]] = []
    log(f"model {model}; {args.trials} trials of {args.turns} turns; max-model-len {max_len}")
    with (
        server(model, True, work / "vllm-reuse.log", max_len) as reuse,
        server(model, False, work / "vllm-no-reuse.log", max_len) as plain,
    ):
        urls = {"reuse": reuse, "no-reuse": plain}
        log("both servers up")
        # One throwaway request each: the first request of a server pays one-off costs.
        for url in urls.values():
            stream_chat(url, [{"role": "user", "content": "Hello."}], 4)
        for trial in range(args.trials):
            convo = conversation(trial, args.turns, args.chunk_tokens)
            order = VARIANTS if trial % 2 == 0 else tuple(reversed(VARIANTS))
            for turn, messages in enumerate(convo):
                for v in order:
                    r = one_turn(urls[v], messages, args.max_tokens)
                    r.update(variant=v, trial=trial, turn=turn, load_avg=os.getloadavg())
                    runs.append(r)
                    log(
                        f"trial {trial} turn {turn} {v:8s}: {r['prompt_tokens']} tokens, "
                        f"{r['hits']} reused, first token {r['ttft']:.3f}s"
                    )
    by_key = {(r["trial"], r["turn"], r["variant"]): r["answer"] for r in runs}
    same = all(
        by_key[(r["trial"], r["turn"], "reuse")] == by_key[(r["trial"], r["turn"], "no-reuse")]
        for r in runs
    )
    summary = summarize(runs)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        **provenance(command_line(args), MEASURED_BY["kv"], load_start, started, str(work)),
        "model": str(model),
        "model_name": model.name.split("-")[0],
        "trials": args.trials,
        "answers_identical": same,
        "summary": summary,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    print(render(out, doc))
    log(f"answers identical with and without reuse: {same}")
    return 0 if same else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: SmolLM2 from the cache)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--turns", type=int, default=8, help="turns per conversation")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=400,
        help="rough size of the passage each turn adds, sized by words (numbers make the "
        "real count higher: the results give the prompts' real token counts)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each answer may have")
    p.add_argument("--work", default="/var/tmp/rekindle-bench-kv", help="scratch (server logs)")
    p.add_argument("--out", default="docs/bench/kv")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
