"""The canary's comparison (supervision/canary.py): same tokens, logprobs within tolerance.

Pure logic; the e2e tests (tests/vllm) record a real canary at checkpoint, compare it
after every restore, and refuse a restore whose canary was made to differ."""

from __future__ import annotations

import math

from rekindle_agent.supervision import canary

SAVED = [
    {"tokens": [" Paris", ".", " It"], "logprobs": [-0.12, -1.5, -0.7]},
    {"tokens": ["\n", "   "], "logprobs": [-0.01, -0.2]},
]


def test_the_same_answers_pass_and_small_moves_within_tolerance_too() -> None:
    assert canary.compare(SAVED, SAVED) == []
    nudged = [dict(a, logprobs=[x - 0.015 for x in a["logprobs"]]) for a in SAVED]
    assert canary.compare(SAVED, nudged) == []


def test_a_logprob_that_moves_more_than_the_tolerance_is_named() -> None:
    moved = [SAVED[0], {"tokens": ["\n", "   "], "logprobs": [-0.01, -0.25]}]
    (problem,) = canary.compare(SAVED, moved)
    assert problem == "prompt 1: a logprob moved by 0.05 (tolerance 0.02)"
    assert canary.compare(SAVED, moved, tolerance=0.1) == []


def test_other_tokens_fail_whatever_the_logprobs() -> None:
    other = [{"tokens": [" Lyon", ".", " It"], "logprobs": SAVED[0]["logprobs"]}, SAVED[1]]
    (problem,) = canary.compare(SAVED, other)
    assert problem.startswith("prompt 0: tokens [' Lyon', '.', ' It'], at checkpoint [' Paris'")


def test_nan_infinities_and_missing_answers_never_pass() -> None:
    nan = [dict(SAVED[0], logprobs=[math.nan, -1.5, -0.7]), SAVED[1]]
    assert canary.compare(SAVED, nan) == ["prompt 0: a logprob moved by inf (tolerance 0.02)"]
    inf = [dict(SAVED[0], logprobs=[-math.inf, -1.5, -0.7]), SAVED[1]]
    assert len(canary.compare(SAVED, inf)) == 1
    both_inf = [dict(SAVED[0], logprobs=[-math.inf, -1.5, -0.7]), SAVED[1]]
    assert canary.compare(both_inf, both_inf) == []
    assert canary.compare(SAVED, SAVED[:1]) == ["1 answers to the checkpoint's 2 prompts"]
    short = [dict(SAVED[0], logprobs=[-0.12, -1.5]), SAVED[1]]
    assert canary.compare(SAVED, short) == ["prompt 0: 2 logprobs, at checkpoint 3"]
