"""bench proxy's arithmetic: each trial's agent arm against the direct arm of the same
trial, and the proxy's CPU as the agent's CPU in its arm less its CPU beside vLLM."""

from __future__ import annotations

from typing import Any

from rekindle_dev import bench_proxy


def _run(arm: str, trial: int, rps: float, p50: float, cpu: float) -> dict[str, Any]:
    return {
        "arm": arm,
        "trial": trial,
        "stream": False,
        "concurrency": 4,
        "requests": int(rps * 10),
        "seconds": 10.0,
        "rps": rps,
        "p50_ms": p50,
        "p99_ms": p50 * 2,
        "agent_cpu_s": cpu,
    }


def test_the_proxy_is_measured_against_the_same_trials_direct_arm() -> None:
    runs = [
        _run("agent", 0, 90.0, 12.0, 1.0),
        _run("direct", 0, 100.0, 10.0, 0.1),
        _run("agent", 1, 99.0, 11.0, 1.1),
        _run("direct", 1, 100.0, 10.5, 0.2),
    ]
    (row,) = bench_proxy.summarize(runs)
    assert row["added_p50_ms_trials"] == [2.0, 0.5]
    assert row["rps_ratio_trials"] == [0.9, 0.99]
    # Proxy CPU: trial 0 0.9 s for 900 requests, trial 1 0.9 s for 990: 1.0 and 0.909 ms.
    assert round(row["proxy_cpu_ms_per_request"], 3) == round((1.0 + 0.9 / 0.99) / 2, 3)
    (line,) = bench_proxy.verdict([row])
    assert "+1.25 ms at p50 with 4 client (per trial +0.5 to +2.0" in line and "misses it" in line
