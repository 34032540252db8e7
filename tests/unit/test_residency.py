"""Page-cache residency: vmtouch's summary parsed, mincore(2) here, the lock budget."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from rekindle_agent.process_tree.proctree import zombie_children
from rekindle_agent.process_tree.reaper import Reaper
from rekindle_agent.restoring import residency
from rekindle_dev.testenv import require
from rekindle_store import resident_lock

VMTOUCH_OUT = """           Files: 3
     Directories: 1
  Resident Pages: 8704/12800  34M/50M  68%
         Elapsed: 0.000861 seconds
"""


def test_parse_vmtouch_summary() -> None:
    assert residency.parse_vmtouch(VMTOUCH_OUT) == (3, 8704, 12800)


def test_parse_vmtouch_refuses_output_without_a_summary() -> None:
    with pytest.raises(ValueError, match="Resident Pages"):
        residency.parse_vmtouch("vmtouch: FATAL: unable to open f1\n")


def _file(path: Path, pages: int) -> Path:
    path.write_bytes(os.urandom(pages * residency.PAGE))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages: DONTNEED can then drop them
    finally:
        os.close(fd)
    return path


def _evict(path: Path) -> None:
    """Drop path's pages from the page cache; fails on a file system that keeps them
    (tmpfs: its pages are the file), where residency cannot be shown to change."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert residency.mincore_pages(path)[0] == 0, (
        f"the file system of {path} keeps pages through POSIX_FADV_DONTNEED (tmpfs?): "
        "run pytest with --basetemp on a disk file system"
    )


def _read(path: Path, pages: int) -> None:
    """Read the first pages of path, and no more: no readahead (POSIX_FADV_RANDOM)."""
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        assert len(f.read(pages * residency.PAGE)) == pages * residency.PAGE


def test_mincore_sees_pages_come_and_go(tmp_path: Path) -> None:
    f = _file(tmp_path / "f", 64)
    _evict(f)
    assert residency.mincore_pages(f) == (0, 64)
    _read(f, 16)
    assert residency.mincore_pages(f) == (16, 64)
    _read(f, 64)
    assert residency.mincore_pages(f) == (64, 64)


@pytest.mark.parametrize("tool", ["mincore", "vmtouch"])
def test_residency_of_a_tree(tmp_path: Path, tool: str) -> None:
    if tool == "vmtouch":
        require("vmtouch")
    (tmp_path / "images").mkdir()
    a = _file(tmp_path / "images" / "pages-1.img", 32)
    b = _file(tmp_path / "weights.bin", 32)
    _read(a, 32)
    _read(b, 32)
    doc = residency.residency(tmp_path, tool=tool)
    assert doc["tool"] == tool
    assert doc["files"] == 2
    assert doc["bytes"] == 64 * residency.PAGE
    assert doc["resident_bytes"] == doc["bytes"]
    assert doc["percent"] == 100.0
    _evict(b)
    doc = residency.residency(tmp_path, tool=tool)
    assert doc["resident_bytes"] == 32 * residency.PAGE
    assert doc["percent"] == 50.0


def test_residency_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        residency.residency(tmp_path / "gone")


def test_within_budget_keeps_order_and_skips_what_does_not_fit() -> None:
    page = residency.PAGE
    files = [("images/core-1.img", 10), ("images/pages-1.img", 5 * page), ("w.bin", page)]
    chosen, used = resident_lock.within_budget(files, 3 * page)
    assert chosen == ["images/core-1.img", "w.bin"]  # the pages image is over the budget
    assert used == 2 * page
    assert resident_lock.within_budget(files, 0) == ([], 0)
    assert resident_lock.within_budget(files, 10 * page)[0] == [f[0] for f in files]


def test_checkpoint_files_in_lock_order(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "core-1.img").write_bytes(b"x" * 10)
    (tmp_path / "images" / "pages-1.img").write_bytes(b"x" * 100)
    (tmp_path / "weights.bin").write_bytes(b"x" * 1000)
    names = [p for p, _ in residency.checkpoint_files(tmp_path)]
    assert names == ["images/core-1.img", "weights.bin", "images/pages-1.img"]


def test_lock_without_vmtouch_says_so(tmp_path: Path) -> None:
    lock = resident_lock.ResidentLock(1 << 20, binary=None)
    lock.binary = None
    lock.lock(str(tmp_path), [("f", 10)], wait=0)
    doc = lock.doc()
    assert doc["locked_bytes"] == 0 and "not installed" in doc["why"]


def test_lock_with_nothing_in_budget_says_so(tmp_path: Path) -> None:
    lock = resident_lock.ResidentLock(0, binary="/bin/true")
    lock.lock(str(tmp_path), [("f", 10)], wait=0)
    assert lock.proc is None and "nothing fits" in lock.doc()["why"]


# -- the operator's side: the agent's report in the pod's status and `kubectl rekindle status`


def test_pod_status_and_kubectl_status_show_residency() -> None:
    from rekindle_contract.api import StatusReply
    from rekindle_operator.kubectl_plugin import format_status
    from rekindle_operator.status import Observed, compute_status, pod_boot

    pod = {"metadata": {"name": "p"}, "status": {}}
    reply = StatusReply.from_json(
        {
            "state": "Ready",
            "origin": "restored",
            "checkpoint": "/c/x",
            "residency": {"percent": 75.0, "resident_bytes": 3 << 29, "bytes": 2 << 30},
        }
    )
    boot = pod_boot(pod, reply, None)
    assert boot.page_cache == {
        "residentPercent": 75.0,
        "residentBytes": 3 << 29,
        "bytes": 2 << 30,
    }
    st = compute_status(
        {},
        Observed(1, None, (boot,), None, 1 << 30, {}, None, "app=x", "http://x"),
    )
    assert st["pods"][0]["pageCache"]["residentPercent"] == 75.0
    text = format_status({"metadata": {"name": "svc"}, "status": st}, [])
    assert "checkpoint 75% in page cache (1.5/2.0 GiB)" in text
    # An agent that reports no residency (older, or no checkpoint): no note, no key.
    bare = pod_boot(pod, StatusReply.from_json({"state": "Ready", "origin": "booted"}), None)
    assert bare.page_cache is None
    st = compute_status({}, Observed(1, None, (bare,), None, 1 << 30, {}, None, "s", "e"))
    assert "pageCache" not in st["pods"][0]
    assert "page cache" not in format_status({"metadata": {"name": "s"}, "status": st}, [])


# -- the agent's side: what GET /v1/status reports, what the keeper follows


def test_agent_reports_its_checkpoint_and_follows_only_when_ready(tmp_path: Path) -> None:
    from rekindle_agent.agent import Agent
    from rekindle_agent.config import AgentConfig
    from rekindle_agent.serving.server import checkpoint_residency, newest_checkpoint

    ckpt = tmp_path / "ckpt"
    (ckpt / "images").mkdir(parents=True)
    _read(_file(ckpt / "images" / "pages-1.img", 8), 8)
    assert checkpoint_residency(None) is None
    assert checkpoint_residency(str(tmp_path / "gone")) is None  # logged, not raised
    doc = checkpoint_residency(str(ckpt))
    assert doc is not None and doc["files"] == 1 and doc["percent"] == 100.0

    agent = Agent(AgentConfig(model=str(tmp_path), run_dir=str(tmp_path)), b"t" * 32)
    try:
        assert newest_checkpoint(agent) is None  # booting, no checkpoint
        agent.status.checkpoint = str(ckpt)
        assert newest_checkpoint(agent) is None  # not Ready yet: a restore may be reading it
        agent.set_state("Ready")
        assert newest_checkpoint(agent) == (str(ckpt), [("images/pages-1.img", 8 * residency.PAGE)])
    finally:
        agent.reaper.stop()


def test_keep_resident_flag_is_checked() -> None:
    from rekindle_agent.config import AgentConfig, ConfigError
    from rekindle_contract.agent_args import agent_argv

    cfg = AgentConfig(model="/m", keep_resident_mb=-1)
    with pytest.raises(ConfigError, match="--keep-resident-mb"):
        cfg.validate()
    assert agent_argv(AgentConfig(model="/m", keep_resident_mb=512))[-2:] == [
        "--keep-resident-mb",
        "512",
    ]


# -- spec.coldStart.keepResident: parsed, bounded by the memory, passed to the agent


def test_keep_resident_spec_becomes_the_agent_flag() -> None:
    from rekindle_operator.agent_command import agent_command
    from rekindle_operator.spec import parse_spec
    from rekindle_operator.spec_error import SpecError
    from rekindle_operator.spec_fingerprint import spec_fingerprint

    def spec(**cold: object) -> dict[str, object]:
        return {"model": {"source": "/m"}, "resources": {"memory": "8Gi"}, "coldStart": cold}

    off = parse_spec("a", "ns", spec())
    assert off.keep_resident_bytes == 0
    assert "--keep-resident-mb" not in agent_command(off)
    assert parse_spec("a", "ns", spec(keepResident={"maxSize": "2Gi"})).keep_resident_bytes == 0
    on = parse_spec("a", "ns", spec(keepResident={"enabled": True, "maxSize": "2Gi"}))
    assert on.keep_resident_bytes == 2 << 30
    argv = agent_command(on)
    assert argv[argv.index("--keep-resident-mb") + 1] == "2048"
    # A page-cache hint, not the process: checkpoints made without it still match.
    assert spec_fingerprint(on) == spec_fingerprint(off)
    with pytest.raises(SpecError, match="maxSize of at least 1Mi"):
        parse_spec("a", "ns", spec(keepResident={"enabled": True}))
    with pytest.raises(SpecError, match=r"not below spec.resources.memory \(8Gi\)"):
        parse_spec("a", "ns", spec(keepResident={"enabled": True, "maxSize": "8Gi"}))


def test_a_lock_that_dies_says_why(tmp_path: Path) -> None:
    """Its real exit code, though the agent's reaper (quick here) reaps orphans."""
    (tmp_path / "f").write_bytes(b"x" * 10)
    dies = tmp_path / "vmtouch"
    dies.write_text("#!/bin/sh\nsleep 0.5\nexit 1\n")
    dies.chmod(0o755)
    reaper = Reaper(orphan_grace_s=0.05)
    try:
        lock = resident_lock.ResidentLock(1 << 20, binary=str(dies), on_spawn=reaper.exempt)
        lock.lock(str(tmp_path), [("f", 10)], wait=0)
        assert lock.proc is not None
        deadline = time.monotonic() + 60
        while lock.proc.pid not in zombie_children(os.getpid()):
            assert time.monotonic() < deadline, "vmtouch never exited"
            time.sleep(0.02)
        time.sleep(0.3)  # several reaper passes past its grace
        doc = lock.doc()
    finally:
        reaper.stop()
    assert "exited 1" in doc["why"] and doc["locked_bytes"] == 0 and lock.proc is None


def test_status_residency_is_measured_at_most_every_few_seconds(tmp_path: Path) -> None:
    """The operator polls /v1/status: one measurement serves every poll for max_age seconds."""
    now = [100.0]
    cache = residency.ResidencyCache(max_age=5.0, clock=lambda: now[0])
    f = _file(tmp_path / "pages-1.img", 8)
    _read(f, 8)
    first = cache.get(tmp_path, tool="mincore")
    assert first["files"] == 1
    _file(tmp_path / "pages-2.img", 8)  # the tree grows; a fresh walk would see 2 files
    now[0] += 4.9
    assert cache.get(tmp_path, tool="mincore") == first  # still within max_age: reused
    now[0] += 0.2
    assert cache.get(tmp_path, tool="mincore")["files"] == 2  # older than max_age: measured
    now[0] -= 50.0  # a clock that went back: never trusted, measured again
    assert cache.get(tmp_path, tool="mincore")["files"] == 2


def test_residency_cache_does_not_keep_errors(tmp_path: Path) -> None:
    cache = residency.ResidencyCache(max_age=5.0, clock=lambda: 1.0)
    with pytest.raises(FileNotFoundError):
        cache.get(tmp_path / "ckpt", tool="mincore")
    (tmp_path / "ckpt").mkdir()
    _file(tmp_path / "ckpt" / "pages-1.img", 4)
    assert cache.get(tmp_path / "ckpt", tool="mincore")["files"] == 1
