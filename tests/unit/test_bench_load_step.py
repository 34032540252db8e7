"""`rekindle-dev bench load-step`'s arithmetic: medians per arm, both ratios (from the
step, and the replica's own start from the autoscaler's decision) against 10x."""

from __future__ import annotations

from rekindle_dev.bench_load_step import markdown, summarize


def trial(arm: str, i: int, decision: float, token: float) -> dict[str, object]:
    return {
        "arm": arm, "i": i, "decision_s": decision, "ready_s": token - 0.5,
        "first_token_s": token, "new_replica_s": round(token - decision, 3),
        "request_p50_s": 0.4,
    }  # fmt: skip


TRIALS = [
    trial("step-restore", 0, 5.0, 8.0),
    trial("step-restore", 1, 6.0, 8.5),
    trial("step-restore", 2, 4.0, 6.5),
    trial("step-boot", 0, 5.0, 45.0),
    trial("step-boot", 1, 6.0, 40.0),
    trial("step-boot", 2, 5.5, 41.5),
]


def test_the_summary_gives_both_ratios_within_the_run() -> None:
    got = summarize(TRIALS)
    assert got["median"]["step-restore"] == {
        "decision_s": 5.0, "ready_s": 7.5, "first_token_s": 8.0, "new_replica_s": 2.5,
    }  # fmt: skip
    assert got["median"]["step-boot"]["first_token_s"] == 41.5
    assert got["median"]["step-boot"]["new_replica_s"] == 36.0
    assert got["boot_over_restore_from_step"] == 5.19  # 41.5 / 8.0
    assert got["boot_over_restore_new_replica"] == 14.4  # 36.0 / 2.5
    assert got["target_met_from_step"] is False
    assert got["target_met_new_replica"] is True


def test_the_table_lists_every_trial_and_both_verdicts() -> None:
    md = markdown({"trials": TRIALS, "summary": summarize(TRIALS)})
    assert "| step-boot | 5.50 (5.00 / 6.00 / 5.50) | 41.50 (45.00 / 40.00 / 41.50) |" in md
    assert "boot / restore 5.19x (target 10x: missed)" in md
    assert "decision: 14.4x (10x: met)" in md


def test_the_table_says_the_storage_and_the_restore_phases() -> None:
    trials = [
        {**t, "restore_s": {"criu_restore": 0.4 + t["i"], "total": 1.0 + t["i"]}}  # type: ignore[operator]
        if t["arm"] == "step-restore"
        else t
        for t in TRIALS
    ]
    md = markdown({"trials": trials, "summary": summarize(trials), "storage": "node"})
    assert "storage type node, the node agent's verified cache" in md
    assert "medians (s): criu_restore 1.40, total 2.00." in md
    old = markdown({"trials": TRIALS, "summary": summarize(TRIALS)})  # before --storage
    assert "storage type hostPath" in old and "phases" not in old
