"""The node agent's resident budget: its newest checkpoints locked by a real `vmtouch -l`,
within the budget, following the cache as it changes.

Root (mlock without a limit) and vmtouch, as tests/criu/test_resident_lock.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from rekindle_dev.testenv import require
from rekindle_node.keep_resident import NodeResidency
from rekindle_store import node_cache
from rekindle_store.node_cache import NodeCache
from rekindle_store.resident_lock import locked_bytes

from tests.unit.test_store_node_cache import KEY, publish

pytestmark = pytest.mark.criu

MIB = 1 << 20


def test_the_newest_checkpoints_are_locked_within_the_budget_and_follow_the_cache(
    tmp_path: Path,
) -> None:
    require("root", "vmtouch")
    cache = NodeCache(tmp_path / "cache", budget_bytes=1 << 30)
    old = cache.get(publish(tmp_path / "old", os.urandom(8 * MIB)), KEY)
    os.utime(cache.entries / old.entry / node_cache.ENTRY_RECORD, (1, 1))
    new = cache.get(publish(tmp_path / "new", os.urandom(8 * MIB)), KEY)
    keeper = NodeResidency(cache, 12 * MIB)  # the newest whole, the older one's small files
    try:
        assert keeper.follow_once()
        assert keeper.lock.wait_locked(60), keeper.lock.why
        assert keeper.kept() == {new.entry, old.entry}
        assert f"{old.entry}/images/pages-1.img" not in keeper.lock.files
        assert f"{new.entry}/images/pages-1.img" in keeper.lock.files
        pid = keeper.lock.proc.pid if keeper.lock.proc else 0
        assert 8 * MIB <= locked_bytes(pid) <= 12 * MIB
        assert not keeper.follow_once()  # nothing changed: the same child keeps it

        # The newest evicted: its pages are unlocked (the child holding them replaced)
        # and the older checkpoint takes the budget.
        shutil.rmtree(cache.entries / new.entry)
        assert keeper.follow_once()
        assert keeper.lock.wait_locked(60), keeper.lock.why
        assert keeper.kept() == {old.entry}
        assert f"{old.entry}/images/pages-1.img" in keeper.lock.files
        assert pid != (keeper.lock.proc.pid if keeper.lock.proc else 0)
        assert not os.path.exists(f"/proc/{pid}") or locked_bytes(pid) == 0
    finally:
        keeper.lock.release()
    assert keeper.kept() == set()
