"""The agent says Ready after a checkpoint only once the checkpoint is recorded.

An operator restarted mid-checkpoint reads the agent's status and records the
checkpoint if the agent reports it finished, else fails it; a Ready agent that has
not yet recorded its proof made a good checkpoint fail as OperatorRestarted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rekindle_agent.agent import Agent
from rekindle_agent.checkpointing import checkpoint
from rekindle_agent.config import AgentConfig
from rekindle_agent.restoring import restore
from rekindle_store import manifest_io


def test_ready_comes_after_the_checkpoint_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = AgentConfig(model=str(tmp_path), run_dir=str(tmp_path), worker_extension="none")
    agent = Agent(cfg, b"unit-test-token-0123456789")
    for state in ("Ready", "Draining", "Checkpointing"):
        agent.set_state(state)  # type: ignore[arg-type]
    man: dict[str, Any] = {"timings": {"criu_dump": 1.0}, "files": []}
    seen: dict[str, Any] = {}

    def fake_restore(*_a: Any, **_k: Any) -> tuple[dict[str, float], Any]:
        return {"criu_restore": 0.5}, SimpleNamespace(use=False, path="copy", why="proving")

    def fake_mark_verified(*_a: Any, **_k: Any) -> None:
        seen["state_while_recording"] = agent.status.state
        seen["last_checkpoint_then"] = agent.status.last_checkpoint

    monkeypatch.setattr(agent, "_dump", lambda ckpt: man)
    monkeypatch.setattr(agent, "criu_info", lambda: None)
    monkeypatch.setattr(agent, "boot", lambda: pytest.fail("the restore failed: it booted"))
    monkeypatch.setattr(restore, "restore", fake_restore)
    monkeypatch.setattr(manifest_io, "mark_verified", fake_mark_verified)
    monkeypatch.setattr(Agent, "_protect", staticmethod(lambda ckpt, m: "immutable"))
    monkeypatch.setattr(Agent, "_protect_weights", staticmethod(lambda ckpt, m: "immutable"))

    assert agent.run_checkpoint(tmp_path / "c1") is man
    assert seen["state_while_recording"] == "Restoring"  # busy for the operator
    assert seen["last_checkpoint_then"] is None
    assert agent.status.state == "Ready"
    assert agent.status.last_checkpoint is not None
    assert agent.status.last_checkpoint["ok"] is True
    assert agent.status.last_checkpoint["dir"] == str(tmp_path / "c1")


def test_the_files_a_tree_uses_below_the_run_dir_are_found(tmp_path: Path) -> None:
    """checkpoint.run_dir_files on a real process: what it maps (a compiled kernel, say)
    and holds open below the run dir, not what is saved otherwise, not what lies
    outside, not a FIFO."""
    run = tmp_path / "run"
    (run / "cache").mkdir(parents=True)
    kernel, opened, log = run / "cache" / "k.so", run / "cache" / "open.bin", run / "vllm.log"
    outside = tmp_path / "elsewhere.bin"
    for f in (kernel, opened, log, outside):
        f.write_bytes(b"\0" * 4096)
    fifo = run / "fifo"
    os.mkfifo(fifo)
    script = (
        "import mmap, os, sys, time\n"
        f"m = mmap.mmap(os.open({str(kernel)!r}, os.O_RDONLY), 0, prot=mmap.PROT_READ)\n"
        f"keep = [open({str(opened)!r}, 'rb'), open({str(log)!r}, 'rb'),"
        f" open({str(outside)!r}, 'rb'), os.open({str(fifo)!r}, os.O_RDWR)]\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        found = checkpoint.run_dir_files([p.pid], str(run), {str(log)})
    finally:
        p.kill()
        p.wait()
    assert found == [str(kernel), str(opened)]
