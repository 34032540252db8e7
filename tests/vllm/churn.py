"""The churn workload and the memory of a vLLM tree, for the shared tiny checkpoint and
test_mmap_churn: the booted half runs on the session's one tiny boot (conftest's
tiny_ckpt), the restored half in test_mmap_churn.

The workload ("churn"): prompts from a few tokens up to ~3.5 KV blocks
(vLLM CPU's block is 128 tokens; max_model_len is 512), sent one at a time,
then in rounds of 2, 4 and 8 concurrent requests of mixed lengths, then rounds
whose prompts share a multi-block prefix with an earlier prompt (prefix-cache
hits on blocks filled after the restore); streaming and not, alternately.
"""

from __future__ import annotations

import json
import random
import re
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rekindle_agent.process_tree import proctree
from rekindle_dev.harness import AgentProc

MAX_TOKENS = 16
BLOCK = 128  # vLLM CPU's default KV block size, in tokens
# Memory bounds, from what this module measured on the 2-CPU VM (after the workload):
#   booted tree:   PSS 3067-3097 MiB (anon 2724-2727, file 342-371). Nearly all of the
#                  difference is the worker's 1 GiB KV cache, all resident at boot; the
#                  checkpoint releases it and a restored worker has only the blocks
#                  written since (API server and engine core: same anon as booted);
#   mmap restore:  PSS 913-1041 MiB (anon 766-768, file 147-274), 970 MiB of the tree
#                  mapped from the images (122-230 MiB of it resident), images 1687 MiB;
#   copy restore (measured by hand, not run here): PSS 1766 MiB, anon 1717 MiB.
# PSS_MARGIN: the restored tree may have up to the booted tree's PSS (measured: 0.34
# of it), so a generous bound that only a gross regression crosses; it cannot tell a
# copying restore from a mapping one (1766 MiB passes too). ANON_OF_IMAGES is the sharp
# one: the restored tree's anonymous memory after the churn, as a fraction of its
# pages images. A copying restore holds all of them as anonymous memory (1.02);
# mapped, only what was written since the restore and what the restore read (the
# heap, arenas, small runs) is anonymous (0.46); 0.75 is half-way.
PSS_MARGIN = 1.0
ANON_OF_IMAGES = 0.75

_WORDS = (
    "cold",
    "start",
    "checkpoint",
    "restore",
    "kernel",
    "page",
    "cache",
    "memory",
    "process",
    "thread",
    "weight",
    "tensor",
    "model",
    "token",
    "prompt",
    "server",
    "cluster",
    "node",
    "pod",
    "container",
    "image",
    "layer",
    "vector",
    "river",
    "mountain",
    "light",
    "stone",
    "garden",
    "winter",
    "ocean",
    "forest",
    "city",
    "bridge",
)


@dataclass(frozen=True)
class Req:
    key: str
    prompt: str
    stream: bool


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _workload() -> list[list[Req]]:
    """Rounds of requests; a round's requests are sent at once (a round of 1: sequential)."""
    rounds: list[list[Req]] = []
    # Growing prompts, one at a time: a few tokens up to ~3.5 KV blocks.
    lengths = [2, 6, 20, 50, 100, 160, 230, 300, 370, 430]
    seq = [Req(f"seq{i}-{n}w", _words(100 + i, n), i % 2 == 1) for i, n in enumerate(lengths)]
    rounds += [[r] for r in seq]
    # Batches of 2, 4, 8, mixed lengths (short and long together), twice each.
    for n in (2, 4, 8):
        for rep in range(2):
            sizes = [4 + (420 - 4) * i // (n - 1) for i in range(n)]
            if rep:
                sizes.reverse()
            rounds.append(
                [
                    Req(
                        f"b{n}.{rep}.{i}-{w}w",
                        _words(1000 * n + 10 * rep + i, w),
                        (i + rep) % 2 == 1,
                    )
                    for i, w in enumerate(sizes)
                ]
            )
    # A shared prefix of ~2.5 blocks (the seq prompt of 300 words) with different tails,
    # then exact repeats of earlier long prompts: prefix-cache hits after the restore.
    base = seq[7].prompt
    for n in (4, 8):
        rounds.append(
            [
                Req(f"pfx{n}.{i}", base + " " + _words(5000 + 10 * n + i, 5 + 12 * i), i % 2 == 0)
                for i in range(n)
            ]
        )
    rounds.append([Req(f"rep.{r.key}", r.prompt, not r.stream) for r in (seq[6], seq[8], seq[9])])
    return rounds


WORKLOAD = _workload()


# vLLM's CPU kernels are not batch-invariant: a request batched with others can see
# its logits move by a rounding step, which flips a near tie between the two likeliest
# tokens (seen once in 53 requests on AVX-512). Two bf16 steps at logits of 16 to 32.
NEAR_TIE = 0.25
TOP = 2  # logprobs asked per token: the chosen one and the runner-up


@dataclass(frozen=True)
class Out:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    # Per generated token, its (token, logprob) candidates, likeliest first: only to tell
    # a near tie from a real difference (not compared: they move with batching).
    top: tuple[tuple[tuple[str, float], ...], ...] = field(default=(), compare=False)
    tokens: tuple[str, ...] = field(default=(), compare=False)


def near_tie_flip(a: Out, b: Out) -> str | None:
    """None when a and b first differ at a token where both runs had the same two
    likeliest tokens within NEAR_TIE of each other, each picking the other's second
    (after it the two continue from different text); else what differs."""
    for k, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)):
        if x == y:
            continue
        ta, tb = a.top[k], b.top[k]
        near = all(len(t) >= 2 and t[0][1] - t[1][1] <= NEAR_TIE for t in (ta, tb))
        if near and ta[0][0] == tb[1][0] and ta[1][0] == tb[0][0]:
            return None
        return f"token {k}: {x!r} vs {y!r}, candidates {ta} vs {tb}"
    return f"no differing token found ({len(a.tokens)} vs {len(b.tokens)} tokens)"


def _candidates(logprobs: dict[str, Any]) -> tuple[list[str], list[tuple[tuple[str, float], ...]]]:
    """The completions API's logprobs: the chosen tokens and each one's candidates."""
    tokens = list(logprobs.get("tokens") or [])
    top = [
        tuple(sorted(((t, float(v)) for t, v in (d or {}).items()), key=lambda c: -c[1]))
        for d in logprobs.get("top_logprobs") or []
    ]
    return tokens, top


def _send(agent: AgentProc, req: Req) -> Out:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": req.prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,  # every request decodes MAX_TOKENS tokens
        "stream": req.stream,
        "logprobs": TOP,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    http = urllib.request.Request(
        agent.serve_url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(http, timeout=180) as resp:
        raw = resp.read().decode()
    if not req.stream:
        doc = json.loads(raw)
        choice, usage = doc["choices"][0], doc["usage"]
        tokens, top = _candidates(choice.get("logprobs") or {})
        return Out(
            choice["text"],
            usage["prompt_tokens"],
            usage["completion_tokens"],
            choice["finish_reason"],
            tuple(top),
            tuple(tokens),
        )
    assert raw.rstrip().endswith("data: [DONE]"), f"{req.key}: stream cut: {raw[-200:]}"
    text, finish, usage = "", "", None
    all_tokens: list[str] = []
    all_top: list[tuple[tuple[str, float], ...]] = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or []:
            text += choice["text"]
            finish = choice.get("finish_reason") or finish
            tokens, top = _candidates(choice.get("logprobs") or {})
            all_tokens += tokens
            all_top += top
        usage = chunk.get("usage") or usage
    assert usage is not None, f"{req.key}: no usage in the stream"
    return Out(
        text,
        usage["prompt_tokens"],
        usage["completion_tokens"],
        finish,
        tuple(all_top),
        tuple(all_tokens),
    )


def run_workload(agent: AgentProc) -> dict[str, Out]:
    """Every round, in order; a round's requests leave together (a barrier) and all finish."""
    out: dict[str, Out] = {}
    with ThreadPoolExecutor(max_workers=8) as pool:
        for rnd in WORKLOAD:
            gate = threading.Barrier(len(rnd))

            def go(req: Req, gate: threading.Barrier = gate) -> Out:
                gate.wait(30)
                return _send(agent, req)

            futures = [(req.key, pool.submit(go, req)) for req in rnd]
            for key, fut in futures:
                out[key] = fut.result(300)
    return out


# -- the vLLM tree seen from the host ------------------------------------------------


def _nspid(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return []


def vllm_tree(agent: AgentProc, vllm_pid: int) -> list[int]:
    """Host pids of vLLM's tree: below the agent, rooted where its namespace has vllm_pid."""
    parents = proctree.parent_map()
    roots = []
    for pid in proctree.descendants(agent.proc.pid, parents):
        try:
            ns = _nspid(pid)
        except OSError:
            continue
        if len(ns) >= 2 and ns[-1] == vllm_pid:
            roots.append(pid)
    assert len(roots) == 1, (vllm_pid, roots)
    return proctree.descendants(roots[0], parents)


_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")
_IMAGE = re.compile(r"(^|/)pages-\d+\.img( \(deleted\))?$")


@dataclass
class Memory:
    """Sums over a tree, in KiB (smaps_rollup, status, smaps)."""

    pids: list[int]
    ns_pids: list[int] = field(default_factory=list)
    comms: list[str] = field(default_factory=list)
    pss: int = 0
    pss_anon: int = 0
    pss_file: int = 0
    rss_anon: int = 0
    image_size: int = 0  # virtual size of VMAs backed by a pages-*.img
    image_rss: int = 0  # their resident pages (page cache, untouched since the restore)
    image_vmas: int = 0

    def mib(self, kib: int) -> float:
        return kib / 1024

    def summary(self) -> str:
        return (
            f"{len(self.pids)} procs {self.comms}: PSS {self.mib(self.pss):.0f} MiB "
            f"(anon {self.mib(self.pss_anon):.0f}, file {self.mib(self.pss_file):.0f}), "
            f"RssAnon {self.mib(self.rss_anon):.0f} MiB, image-mapped "
            f"{self.mib(self.image_size):.0f} MiB in {self.image_vmas} VMAs "
            f"({self.mib(self.image_rss):.0f} MiB resident)"
        )


def _kib_fields(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].endswith(":") and parts[2] == "kB":
            out[parts[0][:-1]] = int(parts[1])
    return out


def measure(pids: list[int]) -> Memory:
    m = Memory(pids=list(pids))
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        m.ns_pids.append(_nspid(pid)[-1])
        m.comms.append((proc / "comm").read_text().strip())
        rollup = _kib_fields((proc / "smaps_rollup").read_text())
        m.pss += rollup["Pss"]
        m.pss_anon += rollup.get("Pss_Anon", 0)
        m.pss_file += rollup.get("Pss_File", 0)
        m.rss_anon += _kib_fields((proc / "status").read_text())["RssAnon"]
        in_image = False
        for line in (proc / "smaps").read_text().splitlines():
            vma = _VMA.match(line)
            if vma:
                in_image = bool(_IMAGE.search(vma.group(3)))
                if in_image:
                    m.image_vmas += 1
                    m.image_size += (int(vma.group(2), 16) - int(vma.group(1), 16)) // 1024
            elif in_image and line.startswith("Rss:"):
                m.image_rss += int(line.split()[1])
    return m
