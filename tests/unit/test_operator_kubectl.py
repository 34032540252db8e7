"""`kubectl rekindle` argument handling and the objects/patches it sends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rekindle_operator import cluster_bench as bench
from rekindle_operator.kubectl_plugin import (
    build_parser,
    checkpoint_object,
    format_status,
    restart_patch,
)


def parse(*argv: str) -> object:
    return build_parser().parse_args(list(argv))


def test_checkpoint_args() -> None:
    a = parse("-n", "prod", "checkpoint", "tiny", "--wait", "--timeout", "90")
    assert (a.cmd, a.name, a.wait, a.timeout, a.namespace) == (
        "checkpoint",
        "tiny",
        True,
        90.0,
        "prod",
    )  # type: ignore[attr-defined]


def test_bench_args() -> None:
    a = parse("bench", "tiny", "--trials", "5", "--json", "r.json", "--plot", "r.png")
    assert a.trials == 5 and str(a.json) == "r.json" and str(a.plot) == "r.png"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "argv",
    [
        ("bench", "tiny", "--trials", "0"),
        ("bench", "tiny", "--trials", "x"),
        ("checkpoint", "tiny", "--timeout", "-1"),
        ("checkpoint",),
        ("frobnicate", "tiny"),
        ("status", "tiny", "-o", "yaml"),
    ],
)
def test_bad_args_exit_with_usage(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_checkpoint_object() -> None:
    o = checkpoint_object("tiny", "ns", None, None, retain=False, timeout=30)
    assert o["kind"] == "Checkpoint" and o["metadata"]["name"].startswith("tiny-")
    assert o["spec"] == {
        "inferenceService": "tiny",
        "deletionPolicy": "Delete",
        "timeoutSeconds": 60,
    }
    o = checkpoint_object("tiny", "ns", "mine", "tiny-abc", retain=True, timeout=600)
    assert o["metadata"]["name"] == "mine"
    assert o["spec"]["pod"] == "tiny-abc" and o["spec"]["deletionPolicy"] == "Retain"


def test_restart_patch() -> None:
    assert restart_patch("T") == {"metadata": {"annotations": {"rekindle.dev/restartedAt": "T"}}}


def test_format_status_mentions_boot_paths_and_stale() -> None:
    isvc = {
        "metadata": {"name": "tiny"},
        "status": {
            "phase": "Ready",
            "replicas": 1,
            "readyReplicas": 1,
            "checkpoint": "c2",
            "sharedMemory": {"size": "1216Mi", "totalBytes": 1216 * 2**20},
            "pods": [
                {"name": "tiny-a", "origin": "booted", "reason": "checksum_mismatch", "ready": True}
            ],
            "lastColdStartSeconds": {"booted": 40.0, "restored": 3.1},
        },
    }
    ck = [
        {
            "metadata": {"name": "c1", "creationTimestamp": "1"},
            "spec": {"inferenceService": "tiny"},
            "status": {"phase": "Ready", "stale": True},
        }
    ]
    text = format_status(isvc, ck)
    assert "booted (checksum_mismatch)" in text
    assert "c1: Ready STALE" in text
    assert "restored 3.1s" in text


def test_bench_summary_and_table() -> None:
    trials = [bench.Trial("naive", i, 30.0 + i, 31.0 + i, "booted", "") for i in range(3)] + [
        bench.Trial("restore", i, 3.0 + i, 3.5 + i, "restored", "") for i in range(3)
    ]
    s = bench.summarize_trials(trials)
    assert s["naive"]["first_token_s"]["median"] == 32.0
    assert s["restore"]["ready_s"]["min"] == 3.0 and s["restore"]["ready_s"]["max"] == 5.0
    text = bench.table(s)
    assert "speedup" in text and f"{32.0 / 4.5:.1f}x" in text
    assert "p25" in bench.summarize([1.0, 2.0, 3.0, 4.0])


def test_bench_writes_json_and_png(tmp_path: Path) -> None:
    trials = [
        bench.Trial("naive", 0, 30.0, 31.0, "booted", ""),
        bench.Trial("restore", 0, 3.0, 3.5, "restored", ""),
    ]
    bench.write_json(tmp_path / "r.json", trials, {"command": "kubectl rekindle bench tiny"})
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["summary"]["restore"]["first_token_s"]["median"] == 3.5
    assert [t["origin"] for t in doc["trials"]] == ["booted", "restored"]
    bench.plot(trials, tmp_path / "r.png", "t")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
