"""--keep-resident-mb end to end: the agent locks the checkpoint it just made and proved
(the one its vLLM now runs from) in the page cache, reports it in /v1/status, and the
lock holds through `echo 1 > /proc/sys/vm/drop_caches`; stopping the agent ends it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent import residency
from rekindle_agent.immutable import remove_tree

from .conftest import AgentFactory, AgentProc

pytestmark = [pytest.mark.vllm, pytest.mark.criu]
BUDGET_MB = 4096


def wait_locked(agent: AgentProc, timeout: float = 180) -> dict[str, Any]:
    """/v1/status once its resident_lock has locked something, else fail with the last one."""
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = agent.status().raw
        lock = doc.get("resident_lock") or {}
        if lock.get("locked_bytes", 0) > 0 and lock.get("checkpoint") == doc.get("checkpoint"):
            return doc
        time.sleep(0.5)
    raise AssertionError(f"nothing locked after {timeout}s: {doc.get('resident_lock')}")


def vmtouch_holding(path: Path) -> list[int]:
    """PIDs of vmtouch processes whose command line names a file under path."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"vmtouch") and any(str(path).encode() in a for a in argv):
            out.append(int(pid))
    return out


def test_agent_keeps_its_newest_checkpoint_resident(agent_factory: AgentFactory) -> None:
    if residency.vmtouch_binary() is None:
        pytest.fail("vmtouch is not installed: scripts/python-env installs it")
    ckpt = agent_factory.checkpoints / "resident"
    agent = agent_factory.start(name="resident", keep_resident_mb=BUDGET_MB)
    try:
        st = agent.wait_ready(900)
        assert st.raw["residency"] is None and st.raw["resident_lock"]["checkpoint"] is None
        agent.client.checkpoint(str(ckpt), timeout=900)
        doc = wait_locked(agent)
        lock, res = doc["resident_lock"], doc["residency"]
        assert doc["checkpoint"] == str(ckpt)
        assert lock["budget_bytes"] == BUDGET_MB << 20
        assert 0 < lock["locked_bytes"] <= lock["budget_bytes"]
        assert res["tool"] == "vmtouch" and res["files"] > 0
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        # The status reuses a residency measurement for CACHE_S: wait out the one
        # taken before the drop (it may even predate the lock's last pages).
        time.sleep(residency.CACHE_S + 0.5)
        after = agent.status().raw["residency"]
        # Everything locked stays; with the whole checkpoint in budget, that is all of it.
        assert after["resident_bytes"] >= lock["locked_bytes"]
        if res["bytes"] <= lock["budget_bytes"]:
            assert after["percent"] == 100.0, after
        assert vmtouch_holding(ckpt)
    finally:
        agent.stop()
    try:
        deadline = time.monotonic() + 30
        while vmtouch_holding(ckpt) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not vmtouch_holding(ckpt), "the lock outlived the agent"
    finally:
        remove_tree(ckpt)
