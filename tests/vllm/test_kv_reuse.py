"""KV-cache reuse across the turns of a chat, on a real vLLM CPU server (SmolLM2).

vLLM's automatic prefix caching keeps the KV blocks of earlier requests keyed
by a hash of their tokens: the next turn of a conversation repeats the whole
previous prompt and answer, so only its new tokens are computed. What this
proves, with vLLM's own counters (`vllm:prefix_cache_queries` and
`vllm:prefix_cache_hits`, in tokens):

- every later turn hits exactly the full KV blocks it shares with what the
  server already computed (the previous prompt and answer), and the first turn
  of a fresh server hits nothing;
- greedy answers are the same with prefix caching on and off (the second
  server gets `--no-enable-prefix-caching` through the operator's path: the
  agent's prefix_caching setting, turned into vLLM flags by vllm_argv);
- after a checkpoint and a restore the cache starts empty (the KV cache is
  released before the dump and the agent resets the prefix cache when it
  wakes vLLM): the first repeat of a turn is a miss with the same answer, and
  the next repeat hits again.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rekindle_dev.smollm2 import generate_smollm2

from tests.vllm.conftest import AgentFactory, AgentProc, factory_for

pytestmark = [pytest.mark.vllm]

SERVED = "smollm2"
MAX_MODEL_LEN = 2048
MAX_TOKENS = 32
CPU_KV_BLOCK = 128  # vLLM's default KV block size on CPU (tokens)
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


def prefix_counters(agent: AgentProc) -> tuple[int, int]:
    """(queries, hits) of vLLM's prefix cache, summed over engines, through the agent's /metrics."""
    req = urllib.request.Request(
        agent.admin_url + "/metrics", headers={"Authorization": f"Bearer {agent.token}"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return int(totals["vllm:prefix_cache_queries_total"]), int(
        totals["vllm:prefix_cache_hits_total"]
    )


def chat(agent: AgentProc, messages: list[dict[str, str]], counted: bool = True) -> Turn:
    """One greedy chat request, with its token ids and its prefix-cache counter deltas.

    counted=False: the server does no lookups (prefix caching off), so there is
    no lookup to wait for.
    """
    q0, h0 = prefix_counters(agent)
    body: dict[str, Any] = {
        "model": SERVED,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    status, text = agent.request("POST", "/v1/chat/completions", body, timeout=300)
    assert status == 200, text
    doc = json.loads(text)
    turn = Turn(
        messages=[dict(m) for m in messages],
        answer=doc["choices"][0]["message"]["content"],
        prompt_ids=list(doc["prompt_token_ids"]),
        output_ids=list(doc["choices"][0]["token_ids"]),
    )
    # The counters are updated from the engine's stats, which can trail the
    # response by a step: wait until this request's lookup is counted.
    deadline = time.monotonic() + (30 if counted else 0)
    while True:
        q1, h1 = prefix_counters(agent)
        if q1 - q0 >= len(turn.prompt_ids) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    turn.queries, turn.hits = q1 - q0, h1 - h0
    return turn


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


def replay(agent: AgentProc, turns: list[Turn], counted: bool = True) -> list[Turn]:
    """The same requests again (the first server's history), so answers compare turn by turn."""
    return [chat(agent, t.messages, counted) for t in turns]


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


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_smollm2(tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture(scope="module")
def factory(
    tmp_path_factory: pytest.TempPathFactory, smollm2: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "agent-kv", smollm2, criu_prefix, SERVED)


@pytest.fixture(scope="module")
def cached_turns(factory: AgentFactory) -> list[Turn]:
    """The conversation a server with prefix caching (the default) had.

    The server is stopped before the next one starts: the factory's agents
    share vLLM's port, as pods of one service do.
    """
    agent = factory.start(name="cached", max_model_len=MAX_MODEL_LEN)
    try:
        agent.wait_ready(600)
        return conversation(agent)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()


def test_later_turns_hit_the_prefix_cache(cached_turns: list[Turn]) -> None:
    turns = cached_turns
    lengths = [len(t.prompt_ids) for t in turns]
    # The premise: the conversation spans several KV blocks and grows every turn.
    assert lengths[0] > 3 * CPU_KV_BLOCK and lengths == sorted(lengths), lengths
    assert all(t.queries == len(t.prompt_ids) for t in turns), [t.queries for t in turns]
    assert turns[0].hits == 0  # a fresh server has nothing cached
    for i, turn in enumerate(turns[1:], 1):
        want = expected_hits(turn, [computed(t) for t in turns[:i]])
        # Each turn repeats the previous prompt whole, so it reuses at least its full blocks.
        assert want >= len(turns[i - 1].prompt_ids) // CPU_KV_BLOCK * CPU_KV_BLOCK
        assert turn.hits == want, (i, turn.hits, want, lengths)


def test_answers_identical_without_prefix_caching(
    factory: AgentFactory, cached_turns: list[Turn]
) -> None:
    turns = cached_turns
    agent = factory.start(name="nocache", max_model_len=MAX_MODEL_LEN, prefix_caching=False)
    try:
        agent.wait_ready(600)
        _, hits_before = prefix_counters(agent)
        plain = replay(agent, turns, counted=False)
        time.sleep(2)  # any stats still on their way from the engine
        _, hits_after = prefix_counters(agent)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    assert hits_after == hits_before, "prefix caching is off: nothing may be reused"
    assert [t.prompt_ids for t in plain] == [t.prompt_ids for t in turns]
    assert [t.output_ids for t in plain] == [t.output_ids for t in turns]
    assert [t.answer for t in plain] == [t.answer for t in turns]


@pytest.mark.criu
def test_prefix_cache_after_checkpoint_and_restore(
    factory: AgentFactory, cached_turns: list[Turn]
) -> None:
    """A restored server starts with an empty prefix cache, answers the same, then hits again."""
    turns = cached_turns
    boot = factory.start(name="kvboot", max_model_len=MAX_MODEL_LEN)
    ckpt = factory.checkpoints / "kv"
    try:
        boot.wait_ready(600)
        warm = replay(boot, turns[:2])
        assert warm[1].hits > 0  # warm before the checkpoint
        boot.client.checkpoint(str(ckpt), timeout=900)
    except BaseException:
        print(boot.tail(200))
        raise
    finally:
        boot.stop()
    agent = factory.start(name="kvrestore", checkpoint=str(ckpt), max_model_len=MAX_MODEL_LEN)
    try:
        assert agent.wait_ready(300).origin == "restored"
        first = chat(agent, turns[1].messages)
        again = chat(agent, turns[1].messages)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    assert first.hits == 0, "a restored server must not reuse KV blocks whose content was released"
    assert first.output_ids == turns[1].output_ids and first.answer == turns[1].answer
    # The repeat reuses every full block of the first (all but the last prompt token).
    assert again.hits == (len(again.prompt_ids) - 1) // CPU_KV_BLOCK * CPU_KV_BLOCK > 0
    assert again.output_ids == turns[1].output_ids
