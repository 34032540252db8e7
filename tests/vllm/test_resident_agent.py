"""--keep-resident-mb end to end: the agent locks the checkpoint its vLLM runs from (the one
it restored, then the one it just made and proved) in the page cache, reports it in
/v1/status, and the lock holds through `echo 1 > /proc/sys/vm/drop_caches`, which evicts
an unlocked file beside it; stopping the agent ends it.

The agent restores the session's tiny checkpoint (conftest's tiny_ckpt) and checkpoints
again: no boot. (Nothing is locked while an agent has no checkpoint: test_residency's
newest_checkpoint test.)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.mapped_files.immutable import remove_tree
from rekindle_agent.restoring import residency
from rekindle_store import resident_lock

from .conftest import AgentFactory, AgentProc, TinyCheckpoint

pytestmark = [pytest.mark.vllm, pytest.mark.criu]
BUDGET_MB = 4096
CONTROL_BYTES = 32 << 20
LOCK_DEADLINE_S = 180.0


def wanted_bytes(ckpt: Path) -> tuple[int, int]:
    """(bytes the agent's lock takes of ckpt within the budget, ckpt's bytes), whole pages."""
    files = residency.checkpoint_files(ckpt)
    _, want = resident_lock.within_budget(files, BUDGET_MB << 20)
    total = sum(-(-size // residency.PAGE) * residency.PAGE for _, size in files)
    return want, total


def wait_locked(agent: AgentProc, ckpt: Path, want: int) -> dict[str, Any]:
    """/v1/status once its resident_lock holds want bytes of ckpt (vmtouch locks a file at a
    time), else fail with the last one."""
    deadline = time.monotonic() + LOCK_DEADLINE_S
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = agent.status().raw
        lock = doc.get("resident_lock") or {}
        if lock.get("checkpoint") == str(ckpt) and lock.get("locked_bytes", 0) >= want:
            return doc
        time.sleep(0.2)
    raise AssertionError(
        f"{want} bytes of {ckpt} not locked after {LOCK_DEADLINE_S:.0f}s: "
        f"{doc.get('resident_lock')}"
    )


def vmtouch_holding(path: Path) -> list[int]:
    """PIDs of vmtouch processes whose command line names a file under path."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        under = str(path).encode() + b"/"
        if argv and argv[0].endswith(b"vmtouch") and any(under in a for a in argv):
            out.append(int(pid))
    return out


def cached_control(path: Path) -> Path:
    """A clean file, all in the page cache, on the checkpoints' file system."""
    with path.open("wb") as f:
        f.write(os.urandom(CONTROL_BYTES))
        f.flush()
        os.fsync(f.fileno())
    path.read_bytes()
    resident, total = residency.mincore_pages(path)
    assert resident == total > 0, (resident, total)
    return path


def test_agent_keeps_its_newest_checkpoint_resident(
    agent_factory: AgentFactory, tiny_ckpt: TinyCheckpoint
) -> None:
    if resident_lock.vmtouch_binary() is None:
        pytest.fail("vmtouch is not installed: apt-get install vmtouch (scripts/python-env does)")
    ckpt = agent_factory.checkpoints / "resident"
    control = agent_factory.checkpoints / "resident-control"
    agent = agent_factory.start(
        name="resident", restore_from=str(tiny_ckpt.path), keep_resident_mb=BUDGET_MB
    )
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored", st.raw
        # The checkpoint it runs from is locked first (enough of it to show, not all).
        doc = wait_locked(agent, tiny_ckpt.path, 1)
        assert doc["checkpoint"] == str(tiny_ckpt.path)
        assert vmtouch_holding(tiny_ckpt.path)

        agent.client.checkpoint(str(ckpt), timeout=900)
        want, total = wanted_bytes(ckpt)
        assert want == total, f"the checkpoint ({total} bytes) must fit in {BUDGET_MB} MiB"
        doc = wait_locked(agent, ckpt, want)  # the lock moved to the new one, all of it
        lock, res = doc["resident_lock"], doc["residency"]
        assert doc["checkpoint"] == str(ckpt)
        assert lock["budget_bytes"] == BUDGET_MB << 20
        assert lock["files"] == len(residency.checkpoint_files(ckpt)), lock
        assert want <= lock["locked_bytes"] <= lock["budget_bytes"], lock
        assert res["tool"] == "vmtouch" and res["files"] == lock["files"], res
        assert vmtouch_holding(ckpt) and not vmtouch_holding(tiny_ckpt.path)

        cached_control(control)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        # The drop works on this file system (on a tmpfs nothing could be dropped, and the
        # lock would prove nothing): the unlocked file beside the checkpoint left the cache.
        left, pages = residency.mincore_pages(control)
        assert left < pages // 2, f"drop_caches left {left} of {pages} pages of {control} cached"
        # Everything locked stayed: the whole checkpoint, measured now (no cached answer).
        after = residency.residency(ckpt, tool="mincore")
        assert after["percent"] == 100.0 and after["resident_bytes"] == total, after
        assert vmtouch_holding(ckpt)
    finally:
        agent.stop()
        remove_tree(ckpt)
        control.unlink(missing_ok=True)
        control.unlink(missing_ok=True)
    try:
        # stop() returned once the agent's namespace was empty: its vmtouch is gone.
        assert not vmtouch_holding(ckpt), "the lock outlived the agent"
    finally:
        remove_tree(ckpt)
