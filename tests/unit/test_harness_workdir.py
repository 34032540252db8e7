"""A reused work dir is safe for the dev harness: no stale ports file, a fresh log; and what
stop() waits on (the agent's PID namespace) is found.

`rekindle-dev bench local --work DIR` (and the tests' factories) name each
agent's ports file and log after its name and number, so a second run in the
same DIR meets the first run's files. A ports file left there was read at
once by AgentProc.ports(), which then talked to the old run's ports.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from rekindle_dev.harness import AgentProc, namespace_members, pid_namespace


def test_stale_ports_file_is_not_read(tmp_path: Path) -> None:
    ports_file = tmp_path / "boot-0.ports.json"
    ports_file.write_text(json.dumps({"serve": 1, "admin": 2}))  # an earlier run's
    log = tmp_path / "boot-0.log"
    log.write_text("an earlier run's line\n")
    # An "agent" that exits at once without listening.
    agent = AgentProc([sys.executable, "-c", "print('new run')"], log, ports_file, "t", {})
    agent.proc.wait(30)
    assert not ports_file.exists()
    with pytest.raises(RuntimeError, match="before listening"):
        agent.ports(timeout=5)
    assert log.read_text() == "new run\n"


def test_ports_file_written_by_this_agent_is_read(tmp_path: Path) -> None:
    ports_file = tmp_path / "a.ports.json"
    code = (
        f"import json; open({str(ports_file)!r}, 'w').write(json.dumps({{'serve': 7, 'admin': 8}}))"
    )
    agent = AgentProc([sys.executable, "-c", code], tmp_path / "a.log", ports_file, "t", {})
    agent.proc.wait(30)
    assert agent.ports(timeout=5) == {"serve": 7, "admin": 8}


def test_namespace_helpers_see_this_process(tmp_path: Path) -> None:
    """What stop() waits on: the PID namespace of a process and every process in it."""
    ns = pid_namespace(os.getpid())
    assert ns is not None and ns.startswith("pid:[")
    assert os.getpid() in namespace_members(ns)
    assert pid_namespace(2**22 + 1) is None  # above pid_max: never a process


def test_an_agent_outside_a_new_namespace_has_none(tmp_path: Path) -> None:
    """fresh_ns=False (or an agent already gone): stop() has no namespace to wait for."""
    ports_file = tmp_path / "a.ports.json"
    code = "import time; time.sleep(30)"
    agent = AgentProc([sys.executable, "-c", code], tmp_path / "a.log", ports_file, "t", {})
    try:
        assert agent.namespace() is None
    finally:
        agent.stop()
    assert agent.proc.returncode is not None
    assert agent.namespace() is None
