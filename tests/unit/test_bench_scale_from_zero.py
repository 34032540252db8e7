"""`rekindle-dev bench scale-from-zero`'s arithmetic: medians per arm, the wait the
autoscaler adds against the 1 s target, and the boot/restore ratio."""

from __future__ import annotations

from rekindle_dev.bench_scale_from_zero import markdown, summarize


def trials(arm: str, *secs: float) -> list[dict[str, object]]:
    return [{"arm": arm, "i": i, "first_answer_s": s} for i, s in enumerate(secs)]


def test_the_summary_compares_medians_within_the_run() -> None:
    got = summarize(
        trials("front-restore", 5.0, 4.0, 9.0)
        + trials("front-boot", 40.0, 36.0, 38.0)
        + trials("scale-restore", 3.5, 3.0, 4.0)
    )
    assert got["median_first_answer_s"] == {
        "front-restore": 5.0, "front-boot": 38.0, "scale-restore": 3.5,
    }  # fmt: skip
    assert got["front_restore_minus_scale_restore_s"] == 1.5
    assert got["target_met"] is False
    assert got["boot_over_restore_through_front"] == 7.6


def test_the_table_lists_every_trial_and_the_verdict() -> None:
    ts = trials("front-restore", 4.0) + trials("front-boot", 36.0) + trials("scale-restore", 3.5)
    md = markdown({"trials": ts, "summary": summarize(ts)})
    assert "| front-boot | 36.00 | 36.00 |" in md
    assert "+0.50 s (target: within +1 s: met)" in md
