"""The canary: fixed prompts answered greedily, recorded at checkpoint, compared after a restore.

A restore can come back serving and still compute something else: a weight
reload that put bytes in the wrong place, GPU state the driver did not bring
back faithfully, a sleep mode that dropped what it should have kept (vLLM's
sleep mode has shipped silently wrong output before). The one-token
completion after a restore proves that the engine runs, not that it computes
the same function. So before a checkpoint the agent asks vLLM for a few
greedy tokens and their logprobs on fixed prompts and records them in the
manifest (signed with it); after every restore, the proving one included, it
asks again. The tokens must be the same and each logprob within
LOGPROB_TOLERANCE, or the restore is refused and the pod boots.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rekindle_agent.supervision.vllm_control import VllmControl

PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,")
MAX_TOKENS = 8
# Nats. A restored process computes with the same weights and kernels, so on CPU its
# logprobs come back bit for bit; GPU kernels that reduce in another order move them in
# the third decimal. A wrong weight moves them by whole units.
LOGPROB_TOLERANCE = 0.02


def record(control: VllmControl, model: str) -> dict[str, Any]:
    """The canary to keep in the manifest: its prompts, length and answers."""
    answers = control.greedy(model, list(PROMPTS), MAX_TOKENS)
    return {"prompts": list(PROMPTS), "max_tokens": MAX_TOKENS, "answers": answers}


def check(control: VllmControl, model: str, saved: Mapping[str, Any]) -> list[str]:
    """Ask the saved canary's prompts again; what differs (empty: the same answers)."""
    now = control.greedy(model, list(saved["prompts"]), int(saved["max_tokens"]))
    return compare(saved["answers"], now)


def compare(
    saved: Sequence[Mapping[str, Any]],
    now: Sequence[Mapping[str, Any]],
    tolerance: float = LOGPROB_TOLERANCE,
) -> list[str]:
    """Each prompt whose tokens differ, or whose logprobs moved more than tolerance."""
    if len(saved) != len(now):
        return [f"{len(now)} answers to the checkpoint's {len(saved)} prompts"]
    problems = []
    for i, (a, b) in enumerate(zip(saved, now, strict=True)):
        if list(a["tokens"]) != list(b["tokens"]):
            problems.append(f"prompt {i}: tokens {b['tokens']!r}, at checkpoint {a['tokens']!r}")
            continue
        if len(a["logprobs"]) != len(b["logprobs"]):
            problems.append(
                f"prompt {i}: {len(b['logprobs'])} logprobs, at checkpoint {len(a['logprobs'])}"
            )
            continue
        pairs = zip(a["logprobs"], b["logprobs"], strict=True)
        worst = max((_moved(x, y) for x, y in pairs), default=0.0)
        if not worst <= tolerance:  # NaN fails too
            problems.append(f"prompt {i}: a logprob moved by {worst:.4g} (tolerance {tolerance})")
    return problems


def _moved(x: float, y: float) -> float:
    if x == y:  # -inf == -inf too
        return 0.0
    d = abs(float(x) - float(y))
    return d if math.isfinite(d) else math.inf
