"""A vLLM server restored with --mmap-restore under allocation churn, against a booted one.

With `--mmap-restore` the restored processes' private memory is the pages
images mapped MAP_PRIVATE: pages fault in from the page cache, a write copies
the page. This module makes the restored server allocate, free and reuse
memory for a while after the restore, and checks that it computes exactly what
a booted server computes and that its memory stays comparable:

- one boot; the workload (below) on it gives the reference outputs; the memory
  of its vLLM tree is measured; then the one checkpoint of the module;
- a fresh agent, in a new PID + mount namespace, restores it with
  `--mmap-restore on`; the same workload gives the same outputs, request by
  request (greedy, temperature 0, max_tokens fixed, EOS ignored);
- after the workload the restored tree (every process of it) is alive, the
  status says restored_with_mmap, parts of its memory are still mapped from
  pages-*.img, its PSS is not above the booted tree's, and its anonymous memory
  stays well below the images' size (the untouched images stay page cache).

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
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent import proctree

from tests.vllm.conftest import AgentFactory, AgentProc

pytestmark = [pytest.mark.vllm, pytest.mark.criu]

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


@dataclass(frozen=True)
class Out:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def _send(agent: AgentProc, req: Req) -> Out:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": req.prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,  # every request decodes MAX_TOKENS tokens
        "stream": req.stream,
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
        return Out(
            choice["text"],
            usage["prompt_tokens"],
            usage["completion_tokens"],
            choice["finish_reason"],
        )
    assert raw.rstrip().endswith("data: [DONE]"), f"{req.key}: stream cut: {raw[-200:]}"
    text, finish, usage = "", "", None
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or []:
            text += choice["text"]
            finish = choice.get("finish_reason") or finish
        usage = chunk.get("usage") or usage
    assert usage is not None, f"{req.key}: no usage in the stream"
    return Out(text, usage["prompt_tokens"], usage["completion_tokens"], finish)


def _run_workload(agent: AgentProc) -> dict[str, Out]:
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


# -- the module's run ----------------------------------------------------------------


@dataclass
class Churn:
    booted: dict[str, Out] = field(default_factory=dict)
    restored: dict[str, Out] = field(default_factory=dict)
    booted_mem: Memory | None = None
    restored_mem: Memory | None = None
    tree_before: list[int] = field(default_factory=list)  # restored tree, right after restore
    alive_after: dict[int, bool] = field(default_factory=dict)
    status_after: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    images_kib: int = 0  # the checkpoint's pages-*.img, all processes


@pytest.fixture(scope="module")
def churn(agent_factory: AgentFactory) -> Iterator[Churn]:
    c = Churn()
    t0 = time.monotonic()
    ckpt = agent_factory.checkpoints / "churn"
    agent = agent_factory.start(name="churn-boot")
    try:
        st = agent.wait_ready(600)
        assert st.origin == "booted", st.raw
        c.seconds["boot"] = time.monotonic() - t0
        t = time.monotonic()
        c.booted = _run_workload(agent)
        c.seconds["workload_booted"] = time.monotonic() - t
        c.booted_mem = measure(vllm_tree(agent, agent.status().raw["vllm_pid"]))
        t = time.monotonic()
        agent.client.checkpoint(str(ckpt), timeout=900)
        c.seconds["checkpoint"] = time.monotonic() - t
        c.images_kib = sum(p.stat().st_size for p in (ckpt / "images").glob("pages-*.img")) >> 10
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()

    t = time.monotonic()
    agent = agent_factory.start(name="churn-mmap", checkpoint=str(ckpt), mmap_restore="on")
    try:
        st = agent.wait_ready(300)
        c.seconds["restore"] = time.monotonic() - t
        assert st.origin == "restored" and st.last_fallback is None, (st.raw, agent.tail(100))
        vllm_pid = st.raw["vllm_pid"]
        c.tree_before = vllm_tree(agent, vllm_pid)
        t = time.monotonic()
        c.restored = _run_workload(agent)
        c.seconds["workload_restored"] = time.monotonic() - t
        c.alive_after = {pid: proctree.alive(pid) for pid in c.tree_before}
        c.status_after = dict(agent.status().raw)
        c.restored_mem = measure(vllm_tree(agent, vllm_pid))
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    c.seconds["total"] = time.monotonic() - t0
    print(f"churn timings (s): { {k: round(v, 1) for k, v in c.seconds.items()} }")
    print(f"booted:   {c.booted_mem.summary()}")
    print(f"restored: {c.restored_mem.summary()}")
    print(f"pages images: {c.images_kib / 1024:.0f} MiB")
    tokens = sorted(o.prompt_tokens for o in c.booted.values())
    print(f"{len(tokens)} requests, prompt tokens {tokens[0]}..{tokens[-1]}")
    yield c


def test_workload_reaches_several_blocks_and_batches() -> None:
    """The workload itself: what it claims to exercise (checked on the real token counts below)."""
    sizes = [len(r) for r in WORKLOAD]
    assert sizes[0] == 1 and {2, 4, 8} <= set(sizes)
    assert any(r.stream for rnd in WORKLOAD for r in rnd)
    assert any(not r.stream for rnd in WORKLOAD for r in rnd)
    keys = [r.key for rnd in WORKLOAD for r in rnd]
    assert len(keys) == len(set(keys))


def test_restored_outputs_match_booted(churn: Churn) -> None:
    assert churn.booted.keys() == churn.restored.keys()
    tokens = [o.prompt_tokens for o in churn.booted.values()]
    assert min(tokens) <= 8 and max(tokens) > 3 * BLOCK, tokens
    assert max(tokens) + MAX_TOKENS <= 512
    assert all(o.completion_tokens == MAX_TOKENS for o in churn.booted.values())
    diff = {
        k: (churn.booted[k], churn.restored[k])
        for k in churn.booted
        if churn.booted[k] != churn.restored[k]
    }
    assert not diff, f"{len(diff)} of {len(churn.booted)} requests differ: {diff}"


def test_restored_tree_alive_with_mmap(churn: Churn) -> None:
    st = churn.status_after
    assert st["state"] == "Ready" and st["origin"] == "restored", st
    assert st["restored_with_mmap"] is True, st
    assert st["restore_memory"]["path"] == "mmap", st
    assert churn.alive_after and all(churn.alive_after.values()), churn.alive_after
    assert churn.restored_mem is not None and churn.booted_mem is not None
    # The same tree after the workload as right after the restore, and the booted tree's
    # processes (CRIU restores the pids inside the namespace).
    assert churn.restored_mem.pids == churn.tree_before
    assert sorted(churn.restored_mem.ns_pids) == sorted(churn.booted_mem.ns_pids)
    assert sorted(churn.restored_mem.comms) == sorted(churn.booted_mem.comms)


def test_restored_memory_comparable_and_mapped(churn: Churn) -> None:
    b, r = churn.booted_mem, churn.restored_mem
    assert b is not None and r is not None
    why = f"restored {r.summary()}\nbooted {b.summary()}\nimages {churn.images_kib >> 10} MiB"
    # The option took effect: parts of the restored processes' memory are the images,
    # still mapped after the churn.
    assert r.image_vmas > 0 and r.image_size > 0, why
    assert b.image_vmas == 0, why
    assert r.pss <= b.pss * PSS_MARGIN, why
    # Most of the images stayed page cache (shared, reclaimable), not private copies.
    assert r.rss_anon <= churn.images_kib * ANON_OF_IMAGES, why
