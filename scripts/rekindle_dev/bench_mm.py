"""`rekindle-dev bench mm`: vLLM's multimodal processor cache, shm vs lru vs off.

A real vLLM CPU server serves the project's tiny vision-language model
(rekindle_dev.vlm) while concurrent clients send chat requests with images: N
distinct, locally drawn images, each sent K times (round robin, so an image
comes back after the N-1 others). Three configurations, each on a freshly
booted server (the cache starts empty), interleaved trial by trial:

  shm  --mm-processor-cache-type shm: one ring buffer in /dev/shm, written by
       the API process, read by the engine (what the operator turns on)
  lru  --mm-processor-cache-type lru: vLLM's default, a copy in each process
  off  --mm-processor-cache-gb 0: every image is processed again

Prefix caching is off by default: a repeated image with the same prompt would
otherwise also hit the KV prefix cache, and the numbers would mix the two
caches. Measured per request: time to first token (streaming) and latency;
per run: requests/s and output tokens/s; and vLLM's own counters
(vllm:mm_cache_queries / vllm:mm_cache_hits from /metrics), which show the
cache worked. Results: JSON, a Markdown table and a PNG.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rekindle_agent.supervision.vllm_control import wait_health
from rekindle_agent.supervision.vllm_launch import vllm_env
from rekindle_contract.vllm_argv import VllmOptions, vllm_argv

from rekindle_dev.bench_common import fmt, md_table, provenance, pyplot, save_figure, spread
from rekindle_dev.bench_provenance import MEASURED_BY, provenance_line
from rekindle_dev.ports import free_port

# vLLM's flags per configuration (the cache size is --cache-gb for shm and lru).
CONFIGS = ("shm", "lru", "off")
SERVED_NAME = "vlm"
PROMPT = "Describe this image."
CACHE_COUNTERS = ("vllm:mm_cache_queries", "vllm:mm_cache_hits")


def log(msg: str) -> None:
    print(f"[bench mm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cache_flags(config: str, cache_gb: float, max_object_mb: int) -> tuple[float | None, list[str]]:
    """(VllmOptions.mm_shm_cache_gb, extra vLLM args) for a configuration.

    shm goes through the contract's own flags (what the agent passes in a pod);
    lru and off are plain vLLM flags.
    """
    if config == "shm":
        return cache_gb, ["--mm-shm-cache-max-object-size-mb", str(max_object_mb)]
    if config == "lru":
        return None, [
            "--mm-processor-cache-type",
            "lru",
            "--mm-processor-cache-gb",
            f"{cache_gb:g}",
        ]
    if config == "off":
        return None, ["--mm-processor-cache-gb", "0"]
    raise ValueError(f"unknown configuration {config!r}: use one of {', '.join(CONFIGS)}")


def server_options(model: Path, port: int, config: str, args: argparse.Namespace) -> VllmOptions:
    """The vLLM options of one configuration (the contract's argv builder, as the agent)."""
    shm_gb, extra = cache_flags(config, args.cache_gb, args.max_object_mb)
    if shm_gb is not None:  # the contract adds the max-object flag itself
        extra = []
    return VllmOptions(
        model=str(model),
        served_name=SERVED_NAME,
        port=port,
        max_model_len=args.max_model_len or None,
        mm_shm_cache_gb=shm_gb,
        mm_shm_max_object_mb=args.max_object_mb if shm_gb is not None else None,
        prefix_caching=args.prefix_caching,
        extra_args=tuple(extra),
    )


# --- the workload -------------------------------------------------------------------------


def draw_images(count: int, size: int, seed: int) -> list[bytes]:
    """count distinct PNGs of size x size: random shapes on a random background.

    Drawn, not noise, so they compress like pictures and stay small on the wire;
    the seed makes every trial and configuration send the same bytes.
    """
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        img = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(img)
        for _ in range(12):
            x0, y0 = rng.randrange(size), rng.randrange(size)
            box = (x0, y0, x0 + rng.randrange(8, size // 2), y0 + rng.randrange(8, size // 2))
            fill = tuple(rng.randrange(256) for _ in range(3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def request_order(images: int, repeats: int) -> list[int]:
    """Which image each request sends: every image once, then again, repeats times."""
    if images < 1 or repeats < 1:
        raise ValueError("--images and --repeats must be at least 1")
    return [i for _ in range(repeats) for i in range(images)]


def chat_body(png: bytes, max_tokens: int) -> dict[str, Any]:
    """A streaming chat request with one image (a data URL: no network) and a fixed length."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {
        "model": SERVED_NAME,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,  # random weights: never stop early, same work per request
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Reply:
    """One streamed answer: seconds to the first token and to the end, tokens generated."""

    ttft: float
    latency: float
    tokens: int


def read_stream(lines: Iterable[bytes], started: float) -> Reply:
    """Read an OpenAI server-sent-event stream: the first content chunk is the first token."""
    ttft: float | None = None
    tokens = 0
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"vLLM answered an error: {chunk['error']}")
        choices = chunk.get("choices") or []
        if ttft is None and any((c.get("delta") or {}).get("content") for c in choices):
            ttft = time.monotonic() - started
        usage = chunk.get("usage")
        if usage:
            tokens = int(usage.get("completion_tokens") or 0)
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return Reply(ttft, time.monotonic() - started, tokens)


def stream_chat(url: str, body: dict[str, Any], timeout: float = 300) -> Reply:
    """POST one streaming chat completion; time it from before the connection."""
    parts = urlsplit(url)
    started = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:2000].decode(errors='replace')}")
        return read_stream(iter(resp.readline, b""), started)
    finally:
        conn.close()


def run_workload(
    url: str, images: list[bytes], order: list[int], concurrency: int, max_tokens: int
) -> tuple[float, list[dict[str, Any]]]:
    """Send the requests in order from concurrency clients; (wall seconds, per request)."""
    bodies = [chat_body(png, max_tokens) for png in images]
    lock = threading.Lock()
    seen: set[int] = set()

    def one(img: int) -> dict[str, Any]:
        with lock:  # "first" = the first request to send this image (a cache miss)
            first = img not in seen
            seen.add(img)
        reply = stream_chat(url, bodies[img])
        return {"image": img, "first": first, **asdict(reply)}

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, order))
    return time.monotonic() - t0, results


# --- vLLM's metrics -----------------------------------------------------------------------


def counter_totals(text: str, names: Iterable[str] = CACHE_COUNTERS) -> dict[str, float]:
    """Sum Prometheus counters over their labels: {name: total} (0 when absent).

    A counter `vllm:x` is exposed as `vllm:x_total`; both spellings are read.
    """
    want = {n: 0.0 for n in names}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric, _, rest = line.partition(" ")
        name = metric.split("{", 1)[0].removesuffix("_total")
        if name in want and rest:
            want[name] += float(rest.split()[0])
    return want


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return counter_totals(resp.read().decode(errors="replace"))


# --- one server per run -------------------------------------------------------------------


@contextmanager
def served(opts: VllmOptions, log_path: Path, timeout: float) -> Iterator[str]:
    """Boot vLLM on loopback in its own session; yield its URL; always kill its group."""
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
        try:
            wait_health(url, timeout, alive=lambda: proc.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{e}; last lines of {log_path}:\n{tail}") from e
        yield url
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def one_run(
    config: str, model: Path, images: list[bytes], warmup: bytes, args: argparse.Namespace
) -> dict[str, Any]:
    """Boot config, warm it up on an image outside the set, run the workload, read counters."""
    opts = server_options(model, free_port(), config, args)
    work = Path(args.work)
    t0 = time.monotonic()
    with served(opts, work / f"vllm-{config}.log", args.boot_timeout) as url:
        boot = time.monotonic() - t0
        stream_chat(url, chat_body(warmup, args.max_tokens))
        before = scrape(url)
        order = request_order(len(images), args.repeats)
        wall, reqs = run_workload(url, images, order, args.concurrency, args.max_tokens)
        after = scrape(url)
    counters = {k: after[k] - before[k] for k in after}
    return {
        "config": config,
        "vllm_args": vllm_argv(opts)[3:],
        "boot_s": boot,
        "wall_s": wall,
        "requests": len(reqs),
        "requests_per_s": len(reqs) / wall,
        "tokens_per_s": sum(r["tokens"] for r in reqs) / wall,
        "ttft_median": statistics.median(r["ttft"] for r in reqs),
        "ttft_first_median": _median([r["ttft"] for r in reqs if r["first"]]),
        "ttft_repeat_median": _median([r["ttft"] for r in reqs if not r["first"]]),
        "latency_median": statistics.median(r["latency"] for r in reqs),
        "mm_cache_queries": counters["vllm:mm_cache_queries"],
        "mm_cache_hits": counters["vllm:mm_cache_hits"],
        "per_request": reqs,
    }


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# --- results ------------------------------------------------------------------------------

METRICS = (
    "ttft_median",
    "ttft_first_median",
    "ttft_repeat_median",
    "latency_median",
    "requests_per_s",
    "tokens_per_s",
    "mm_cache_queries",
    "mm_cache_hits",
    "boot_s",
)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: the median over trials of each run's numbers, and their range."""
    out: dict[str, Any] = {}
    for config in [c for c in CONFIGS if any(r["config"] == c for r in runs)]:
        rs = [r for r in runs if r["config"] == config]
        s: dict[str, Any] = {"config": config, "trials": len(rs)}
        loads = [r["load_avg"][0] for r in rs if r.get("load_avg")]
        s["load1_median"] = statistics.median(loads) if loads else None
        for m in METRICS:
            vals = [r[m] for r in rs if r.get(m) is not None]
            if vals:
                s[m] = statistics.median(vals)
                s[f"{m}_min"], s[f"{m}_max"] = min(vals), max(vals)
        out[config] = s
    off = out.get("off")
    for s in out.values():
        if off and s.get("ttft_median") and off.get("ttft_median"):
            s["ttft_vs_off"] = off["ttft_median"] / s["ttft_median"]
        if off and off.get("requests_per_s"):
            s["throughput_vs_off"] = s["requests_per_s"] / off["requests_per_s"]
    return out


TABLE_HEADER = (
    "cache",
    "trials",
    "TTFT median (s)",
    "TTFT 1st sight (s)",
    "TTFT repeat (s)",
    "requests/s",
    "output tokens/s",
    "mm cache hits / queries",
    "TTFT x vs off",
    "throughput x vs off",
    "load avg (1 min)",
)


def table(summary: dict[str, Any]) -> str:
    rows = [
        (
            s["config"],
            str(s["trials"]),
            spread(s, "ttft_median"),
            fmt(s.get("ttft_first_median")),
            fmt(s.get("ttft_repeat_median")),
            fmt(s.get("requests_per_s"), "{:.2f}"),
            fmt(s.get("tokens_per_s"), "{:.1f}"),
            f"{s.get('mm_cache_hits', 0):.0f} / {s.get('mm_cache_queries', 0):.0f}",
            fmt(s.get("ttft_vs_off"), "{:.2f}"),
            fmt(s.get("throughput_vs_off"), "{:.2f}"),
            fmt(s.get("load1_median"), "{:.1f}"),
        )
        for s in summary.values()
    ]
    return md_table(TABLE_HEADER, rows)


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    keys = list(summary)
    fig, axes = pyplot().subplots(1, 3, figsize=(14, 4.8))
    panels = (
        ("ttft_first_median", "TTFT, first sight of an image (s)"),
        ("ttft_repeat_median", "TTFT, repeated image (s)"),
        ("requests_per_s", "throughput (requests/s)"),
    )
    colors = {"shm": "tab:green", "lru": "tab:blue", "off": "tab:gray"}
    for ax, (metric, label) in zip(axes, panels, strict=True):
        vals = [summary[k].get(metric) or 0.0 for k in keys]
        lo = [v - (summary[k].get(f"{metric}_min") or v) for k, v in zip(keys, vals, strict=True)]
        hi = [(summary[k].get(f"{metric}_max") or v) - v for k, v in zip(keys, vals, strict=True)]
        ax.bar(keys, vals, color=[colors.get(k, "tab:orange") for k in keys])
        ax.errorbar(range(len(keys)), vals, yerr=[lo, hi], fmt="k.", capsize=4)
        ax.set_title(label)
        for i, k in enumerate(keys):
            s = summary[k]
            ax.annotate(
                f"hits {s.get('mm_cache_hits', 0):.0f}/{s.get('mm_cache_queries', 0):.0f}",
                (i, 0),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color="white",
            )
    save_figure(fig, path, title)


def render(out: Path, doc: dict[str, Any]) -> str:
    summary = doc["summary"]
    trials = max(s["trials"] for s in summary.values())
    text = table(summary)
    w = doc["workload"]
    text += (
        f"\nWorkload: {w['images']} distinct {w['image_size']}x{w['image_size']} PNGs, each "
        f"sent {w['repeats']} times ({w['images'] * w['repeats']} requests), "
        f"{w['concurrency']} concurrent clients, {w['max_tokens']} output tokens each, "
        f"prefix caching {'on' if w['prefix_caching'] else 'off'}; a fresh server per run, "
        f"configurations interleaved. Medians over trials (TTFT range in brackets). "
        f"Hits/queries are vLLM's own counters (vllm:mm_cache_*) over the workload.\n"
        "\nThe cache is vLLM's own feature: \"off\" is vLLM's own off switch "
        '(`--mm-processor-cache-gb 0`) and "lru" vLLM\'s default cache; the operator turns '
        "on shm and sizes /dev/shm for it.\n"
        f"\nMachine: {doc['host']['cpus']} CPUs, load average at the end "
        f"{', '.join(f'{x:.2f}' for x in doc['host']['load_avg_at_end'])}"
        " (shared with other work: compare within this run only). "
        f"{provenance_line(doc)}\n"
        f"\nCommand: `{doc['command']}`\n"
    )
    (out / "results.md").write_text(text)
    plot(
        summary,
        out / "results.png",
        f"rekindle-dev bench mm: tiny VLM on vLLM CPU, {w['images']} images x {w['repeats']}, "
        f"{w['concurrency']} clients; bars = median over {trials} trials, whiskers = min-max",
    )
    return text


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run."""
    parts = [
        "rekindle-dev bench mm",
        f"--trials {args.trials}",
        f"--configs {args.configs}",
        f"--images {args.images}",
        f"--repeats {args.repeats}",
        f"--concurrency {args.concurrency}",
        f"--image-size {args.image_size}",
        f"--max-tokens {args.max_tokens}",
        f"--cache-gb {args.cache_gb:g}",
    ]
    if args.model:
        parts.append(f"--model {args.model}")
    if args.prefix_caching:
        parts.append("--prefix-caching")
    return " ".join([*parts, f"--out {args.out}"])


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.replot:
        doc = json.loads((out / "results.json").read_text())
        doc["summary"] = summarize(doc["runs"])
        print(render(out, doc))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            print(f"--configs: unknown {c!r}; use {','.join(CONFIGS)}", file=sys.stderr)
            return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        from rekindle_dev.vlm import generate_tiny_vlm

        model = generate_tiny_vlm(work / "tiny-vlm")
    images = draw_images(args.images + 1, args.image_size, seed=1)
    warmup, images = images[-1], images[:-1]
    log(f"model {model}; {len(images)} images x {args.repeats}, {args.concurrency} clients")
    runs: list[dict[str, Any]] = []
    started, load_start = time.time(), os.getloadavg()
    for trial in range(args.trials):
        for config in configs:
            r = one_run(config, model, images, warmup, args)
            r["trial"] = trial
            r["load_avg"] = os.getloadavg()
            runs.append(r)
            log(
                f"trial {trial} {config:3s}: TTFT median {r['ttft_median']:.3f}s "
                f"(first {r['ttft_first_median'] or 0:.3f}, "
                f"repeat {r['ttft_repeat_median'] or 0:.3f}), {r['requests_per_s']:.2f} req/s, "
                f"hits {r['mm_cache_hits']:.0f}"
                f"/{r['mm_cache_queries']:.0f}, boot {r['boot_s']:.1f}s"
            )
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        **provenance(command_line(args), MEASURED_BY["mm"], load_start, started, str(work)),
        "workload": {
            "images": args.images,
            "image_size": args.image_size,
            "repeats": args.repeats,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "cache_gb": args.cache_gb,
            "max_object_mb": args.max_object_mb,
            "prefix_caching": args.prefix_caching,
            "model": str(args.model or "generated tiny VLM (rekindle_dev.vlm)"),
        },
        "summary": summarize(runs),
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    print(render(out, doc))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a VLM directory (default: generate the tiny VLM)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS), help="subset of shm,lru,off")
    p.add_argument("--images", type=int, default=16, help="distinct images")
    p.add_argument("--repeats", type=int, default=4, help="times each image is sent")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    p.add_argument("--image-size", type=int, default=512, help="pixels per side")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument("--cache-gb", type=float, default=0.5, help="cache size, shm and lru")
    p.add_argument("--max-object-mb", type=int, default=64, help="shm cache's largest item")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's own")
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave vLLM's prefix caching on (off by default: it would also hit on repeats)",
    )
    p.add_argument("--boot-timeout", type=float, default=600)
    p.add_argument("--work", default="/var/tmp/rekindle-bench-mm", help="scratch: model, logs")
    p.add_argument("--out", default="docs/bench/mm")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
