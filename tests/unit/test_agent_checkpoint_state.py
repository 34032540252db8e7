"""The agent says Ready after a checkpoint only once the checkpoint is recorded.

An operator restarted mid-checkpoint reads the agent's status and records the
checkpoint if the agent reports it finished, else fails it; a Ready agent that has
not yet recorded its proof made a good checkpoint fail as OperatorRestarted.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rekindle_agent.agent import Agent
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
