"""Keeping a checkpoint resident: `vmtouch -l` holds it in the page cache through
`echo 1 > /proc/sys/vm/drop_caches`, and the unlocked control does not stay.

Root (drop_caches, mlock without a limit) and vmtouch (scripts/python-env
installs it); no CRIU needed, but the same privileges, so it runs with the CRIU suite.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from rekindle_agent.restoring import residency
from rekindle_dev.testenv import require
from rekindle_store import resident_lock

pytestmark = pytest.mark.criu

MIB = 1 << 20


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    require("root", "vmtouch")  # drop_caches and mlock without a limit; the locker
    root = tmp_path / "ckpt"
    (root / "images").mkdir(parents=True)
    (root / "images" / "core-1.img").write_bytes(os.urandom(64 << 10))
    (root / "images" / "pages-1.img").write_bytes(os.urandom(24 * MIB))
    (root / "weights.bin").write_bytes(os.urandom(8 * MIB))
    os.sync()
    return root


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def test_locked_checkpoint_stays_resident_and_unlocked_one_does_not(ckpt: Path) -> None:
    residency.residency(ckpt)  # warm (vmtouch reads nothing; lock() faults it in)
    lock = resident_lock.ResidentLock(64 * MIB)
    lock.lock(str(ckpt), residency.checkpoint_files(ckpt))
    try:
        assert lock.proc is not None, lock.why
        assert lock.doc()["locked_bytes"] >= 32 * MIB
        drop_caches()
        doc = residency.residency(ckpt)
        assert doc["percent"] == 100.0, doc
    finally:
        lock.release()
    drop_caches()
    # The control: once unlocked, the same drop empties the cache (the test can fail).
    assert residency.residency(ckpt)["percent"] == 0.0


def test_budget_locks_only_what_fits(ckpt: Path) -> None:
    lock = resident_lock.ResidentLock(16 * MIB)
    lock.lock(str(ckpt), residency.checkpoint_files(ckpt))
    try:
        assert lock.files == ["images/core-1.img", "weights.bin"]
        assert "left out" in lock.why
        drop_caches()
        assert residency.residency(ckpt / "weights.bin")["percent"] == 100.0
        assert residency.residency(ckpt / "images" / "pages-1.img")["percent"] == 0.0
    finally:
        lock.release()


def test_follow_locks_the_newest_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "weights.bin").write_bytes(os.urandom(4 * MIB))
    current: list[Path] = [ckpt]
    lock = resident_lock.ResidentLock(64 * MIB)
    stop = threading.Event()
    t = threading.Thread(
        target=residency.follow,
        args=(lock, lambda: (str(current[0]), residency.checkpoint_files(current[0])), stop),
        kwargs={"every": 0.1},
    )
    t.start()
    try:
        for want in (ckpt, newer):
            current[0] = want
            deadline = time.monotonic() + 60
            while not (lock.root == str(want) and lock.wait_locked(5)):
                assert time.monotonic() < deadline, f"follow() did not lock {want}: {lock.why}"
                stop.wait(0.1)
            drop_caches()
            assert residency.residency(want)["percent"] == 100.0
    finally:
        stop.set()
        t.join(30)
    assert lock.proc is None  # follow() releases the lock when it stops
