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
  agent's prefix_caching setting, turned into vLLM flags by vllm_argv), a near
  tie of the two likeliest tokens broken the other way aside (bf16 logits
  computed in another order: smollm2_talk.same_greedy_answer), and
  with it off nothing is looked up or reused;
- after a checkpoint and a restore the cache starts empty (the KV cache is
  released before the dump and the agent resets the prefix cache when it
  wakes vLLM): the first repeat of a turn is a miss with the same answer, and
  the next repeat hits again.

The conversation runs on the session's SmolLM2 boot (conftest's smollm2_ckpt),
first thing after it is Ready; that server, warm with the whole conversation,
is the one checkpointed.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import AgentFactory, SmolCheckpoint
from tests.vllm.smollm2_talk import (
    CPU_KV_BLOCK,
    MAX_MODEL_LEN,
    chat,
    computed,
    counters_after,
    expected_hits,
    replay,
    same_greedy_answer,
    vllm_counters,
)

pytestmark = [pytest.mark.vllm]


def test_later_turns_hit_the_prefix_cache(smollm2_ckpt: SmolCheckpoint) -> None:
    turns = smollm2_ckpt.turns
    lengths = [len(t.prompt_ids) for t in turns]
    # The premise: the conversation spans several KV blocks and grows every turn.
    assert lengths[0] > 3 * CPU_KV_BLOCK and lengths == sorted(lengths), lengths
    assert lengths[-1] + 32 <= MAX_MODEL_LEN, lengths
    assert all(t.queries == len(t.prompt_ids) for t in turns), [t.queries for t in turns]
    assert turns[0].hits == 0  # a fresh server has nothing cached
    for i, turn in enumerate(turns[1:], 1):
        want = expected_hits(turn, [computed(t) for t in turns[:i]])
        # Each turn repeats the previous prompt whole, so it reuses at least its full blocks.
        assert want >= len(turns[i - 1].prompt_ids) // CPU_KV_BLOCK * CPU_KV_BLOCK
        assert turn.hits == want, (i, turn.hits, want, lengths)


def test_answers_identical_without_prefix_caching(
    smollm2_factory: AgentFactory, smollm2_ckpt: SmolCheckpoint
) -> None:
    turns = smollm2_ckpt.turns
    agent = smollm2_factory.start(name="nocache", max_model_len=MAX_MODEL_LEN, prefix_caching=False)
    try:
        agent.wait_ready(600)
        c0 = vllm_counters(agent)
        plain = replay(agent, turns)
        # Every replayed request counted as finished, so every lookup it made is counted too.
        c1 = counters_after(agent, c0, len(turns))
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    assert c1["requests"] - c0["requests"] == len(turns)
    assert (c1["queries"], c1["hits"]) == (c0["queries"], c0["hits"]), (c0, c1)
    assert [(t.queries, t.hits) for t in plain] == [(0, 0)] * len(turns)
    assert [t.prompt_ids for t in plain] == [t.prompt_ids for t in turns]
    # The same greedy answers, a near tie broken the other way aside (same_greedy_answer).
    pairs = zip(turns, plain, strict=True)
    differ = [(i, same_greedy_answer(t, p)) for i, (t, p) in enumerate(pairs)]
    assert [d for d in differ if d[1] is not None] == [], differ


@pytest.mark.criu
def test_prefix_cache_after_checkpoint_and_restore(
    smollm2_factory: AgentFactory, smollm2_ckpt: SmolCheckpoint
) -> None:
    """A restored server starts with an empty prefix cache, answers the same, then hits again."""
    turns = smollm2_ckpt.turns
    # The checkpointed server was warm: its later turns hit (test_later_turns_... proves how much).
    assert turns[1].hits > 0 and turns[-1].hits > 0, [t.hits for t in turns]
    agent = smollm2_factory.start(
        name="kvrestore", restore_from=str(smollm2_ckpt.path), max_model_len=MAX_MODEL_LEN
    )
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored" and st.last_fallback is None, st.raw
        first = chat(agent, turns[1].messages)
        again = chat(agent, turns[1].messages)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    assert first.queries == len(first.prompt_ids)
    assert first.hits == 0, "a restored server must not reuse KV blocks whose content was released"
    assert first.output_ids == turns[1].output_ids and first.answer == turns[1].answer
    # The repeat reuses every full block of the first (all but the last prompt token).
    assert again.hits == (len(again.prompt_ids) - 1) // CPU_KV_BLOCK * CPU_KV_BLOCK > 0
    assert again.output_ids == turns[1].output_ids
