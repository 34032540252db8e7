"""What the SmolLM2 tests send and read: a chat with vLLM's prefix-cache counters
(test_kv_reuse) and the real-model questions (test_real_model).

Both run first on the session's one SmolLM2 boot (conftest's smollm2_ckpt): the
conversation on the fresh server, so its first turn hits nothing, then the
questions. The questions share no full KV block with the conversation (128
tokens on CPU; they have no common prefix longer than the chat template's first
tokens), so they add no hit the conversation's counts do not expect.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rekindle_dev.harness import AgentProc

SERVED = "smollm2"
MAX_MODEL_LEN = 2048
CPU_KV_BLOCK = 128  # vLLM's default KV block size on CPU (tokens)
COUNTERS_DEADLINE_S = 60.0

# -- the conversation (KV reuse) ------------------------------------------------------

CHAT_MAX_TOKENS = 32
SYSTEM = "You are the harbour master's assistant. The harbour log follows.\n" + "\n".join(
    f"Day {d}: the ferry left {port} at {6 + d % 12} o'clock with {40 + (d * 37) % 200} "
    f"passengers and {3 + (d * 7) % 20} cars."
    for d, port in enumerate(
        ["Dover", "Calais", "Ostend", "Bergen", "Cork", "Bilbao", "Genoa", "Naples"] * 3, 1
    )
)
QUESTIONS = [
    "Which port did the ferry leave on day 3?",
    "How many passengers were on board that day?",
    "And how many cars?",
    "Which port did it leave on day 10?",
    "Summarise the first week in one sentence.",
]


@dataclass
class Turn:
    """One request of the conversation and what the server said and counted."""

    messages: list[dict[str, str]]
    answer: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    queries: int = 0  # tokens looked up in the prefix cache by this request
    hits: int = 0  # tokens found there
    # Per output token, the two likeliest candidates (token text, logprob), likeliest first.
    top2: list[list[tuple[str, float]]] = field(default_factory=list)


def vllm_counters(agent: AgentProc) -> dict[str, int]:
    """vLLM's prefix-cache and request counters, summed over engines and labels, through
    the agent's /metrics (where vLLM's own families come through)."""
    req = urllib.request.Request(
        agent.admin_url + "/metrics", headers={"Authorization": f"Bearer {agent.token}"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    totals = {
        "vllm:prefix_cache_queries_total": 0.0,
        "vllm:prefix_cache_hits_total": 0.0,
        "vllm:request_success_total": 0.0,
    }
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return {
        "queries": int(totals["vllm:prefix_cache_queries_total"]),
        "hits": int(totals["vllm:prefix_cache_hits_total"]),
        "requests": int(totals["vllm:request_success_total"]),
    }


def counters_after(agent: AgentProc, before: dict[str, int], requests: int) -> dict[str, int]:
    """The counters once vLLM has counted `requests` more finished requests than before.

    The engine's stats reach the API server's metrics in order and can trail the
    response by a step; a finished request is counted with (or after) the stats
    of every step that served it, its prefix-cache lookup included.
    """
    deadline = time.monotonic() + COUNTERS_DEADLINE_S
    while True:
        now = vllm_counters(agent)
        if now["requests"] - before["requests"] >= requests:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(
                f"vLLM counted {now['requests'] - before['requests']} of {requests} "
                f"finished requests after {COUNTERS_DEADLINE_S:.0f}s: {now}"
            )
        time.sleep(0.1)


def chat(agent: AgentProc, messages: list[dict[str, str]]) -> Turn:
    """One greedy chat request, with its token ids and its prefix-cache counter deltas."""
    c0 = vllm_counters(agent)
    body: dict[str, Any] = {
        "model": SERVED,
        "messages": messages,
        "max_tokens": CHAT_MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    status, text = agent.request("POST", "/v1/chat/completions", body, timeout=300)
    assert status == 200, text
    doc = json.loads(text)
    c1 = counters_after(agent, c0, 1)
    return Turn(
        messages=[dict(m) for m in messages],
        answer=doc["choices"][0]["message"]["content"],
        prompt_ids=list(doc["prompt_token_ids"]),
        output_ids=list(doc["choices"][0]["token_ids"]),
        queries=c1["queries"] - c0["queries"],
        hits=c1["hits"] - c0["hits"],
        top2=[
            [(str(c["token"]), float(c["logprob"])) for c in pos["top_logprobs"][:2]]
            for pos in (doc["choices"][0].get("logprobs") or {}).get("content") or []
        ],
    )


# Two greedy runs that compute the same logits in another order (a prefix served from the
# KV cache vs computed again) may pick different tokens where the two likeliest are this
# close: two steps of bf16 at logits of 16 to 32 (0.125 each; seen: an exact tie in one
# run, 0.125 apart in the other). A tie broken by rounding, not a different answer.
NEAR_TIE = 0.25


def same_greedy_answer(a: Turn, b: Turn) -> str | None:
    """None when b's tokens are a's, or differ first where both runs had the same two
    likeliest tokens within NEAR_TIE of each other, each picking the other's second;
    else what differs (the comparison ends at the first difference: after it the two
    continue from different text)."""
    for k, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=False)):
        if x == y:
            continue
        ta, tb = a.top2[k], b.top2[k]
        near = all(len(t) == 2 and t[0][1] - t[1][1] <= NEAR_TIE for t in (ta, tb))
        if near and ta[0][0] == tb[1][0] and ta[1][0] == tb[0][0]:
            return None
        return f"token {k}: {x} vs {y}, candidates {ta} vs {tb}"
    if len(a.output_ids) != len(b.output_ids):
        return f"{len(a.output_ids)} vs {len(b.output_ids)} tokens"
    return None


def conversation(agent: AgentProc) -> list[Turn]:
    """Ask QUESTIONS one after the other, each turn carrying the whole history."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        turn = chat(agent, messages)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn.answer})
    return turns


def replay(agent: AgentProc, turns: list[Turn]) -> list[Turn]:
    """The same requests again (the first server's history), so answers compare turn by turn."""
    return [chat(agent, t.messages) for t in turns]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def expected_hits(turn: Turn, cached: list[list[int]]) -> int:
    """The tokens vLLM can reuse: whole blocks shared with a sequence it computed before.

    A sequence's KV exists for its prompt and every output token but the
    last (never fed back). At least one prompt token is always computed.
    """
    shared = max((common_prefix(turn.prompt_ids, seq) for seq in cached), default=0)
    usable = min(shared, len(turn.prompt_ids) - 1)
    return usable // CPU_KV_BLOCK * CPU_KV_BLOCK


def computed(turn: Turn) -> list[int]:
    return turn.prompt_ids + turn.output_ids[:-1]


# -- the real-model questions -----------------------------------------------------------

ANSWER_MAX_TOKENS = 24
PORTS = ["Dover", "Calais", "Ostend", "Bergen", "Cork", "Bilbao", "Genoa", "Naples"]


def ferry_log(days: int) -> str:
    """A long, varied prompt (no repeated sentence): one KV block every few days."""
    lines = [
        f"On day {d}, the ferry left {PORTS[d % len(PORTS)]} at {6 + d % 12} o'clock "
        f"with {40 + (d * 37) % 200} passengers and {3 + (d * 7) % 20} cars."
        for d in range(1, days + 1)
    ]
    return (
        "Ferry log.\n"
        + "\n".join(lines)
        + "\nQuestion: which port did the ferry leave on day 3? Answer:"
    )


# Plain completions of several lengths: 5 tokens to more than four KV blocks.
COMPLETIONS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Here is a short list of three fruits: apples,",
    ferry_log(6),
    ferry_log(28),
]
# The same questions sent at once, so the server batches them.
BATCH = [*COMPLETIONS, "The largest planet in the solar system is", "A week has seven days:"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Answers:
    """Everything one server said: the oracle is equality of two Answers."""

    sequential: list[str] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)
    chat: str = ""


def ask(agent: AgentProc) -> Answers:
    def one(prompt: str) -> str:
        return agent.complete(prompt, ANSWER_MAX_TOKENS, model=SERVED)

    out = Answers(sequential=[one(p) for p in COMPLETIONS])
    with ThreadPoolExecutor(len(BATCH)) as pool:
        out.batch = list(pool.map(one, BATCH))
    body = {"model": SERVED, "messages": CHAT, "max_tokens": ANSWER_MAX_TOKENS, "temperature": 0}
    status, text = agent.request("POST", "/v1/chat/completions", body, timeout=120)
    assert status == 200, text
    out.chat = json.loads(text)["choices"][0]["message"]["content"]
    return out
