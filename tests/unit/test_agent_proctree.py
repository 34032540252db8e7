from __future__ import annotations

import os
import subprocess
import sys
import time

from rekindle_agent.process_tree import proctree


def test_parse_stat_with_spaces_and_parens_in_comm() -> None:
    assert proctree.parse_stat("123 (a b) (c)) S 7 123 123 0") == (123, "S", 7)


def test_descendants_order_and_missing_root() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1}
    assert proctree.descendants(10, parents) == [10, 11, 12, 13]
    assert proctree.descendants(99, parents) == []


def test_real_tree_and_kill() -> None:
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while len(pids := proctree.tree(p.pid)) != 2:
            assert time.monotonic() < deadline, pids
            time.sleep(0.05)
        assert pids[0] == p.pid
        proctree.kill_tree(pids)
        p.wait()
        assert not proctree.alive(p.pid)
    finally:
        if p.poll() is None:
            p.kill()
    assert proctree.alive(os.getpid())
    assert sys.executable


def test_reaper_run_and_orphans() -> None:
    from rekindle_agent.process_tree.reaper import Reaper

    r = Reaper()
    try:
        res = r.run([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], timeout=30)
        assert (res.returncode, res.output.strip()) == (3, "hi")
        pid = r.spawn([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"])
        assert r.wait(pid, 30) == -9
    finally:
        r.stop()
    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    assert p.wait(30) == 5  # after stop() the reaper no longer steals statuses


def test_reaper_leaves_other_children_to_their_popen() -> None:
    """A library's subprocess child keeps its own exit status while the reaper runs
    (waitpid(-1) would take it, and Popen would then read exit 0 for a failure)."""
    from rekindle_agent.process_tree.reaper import Reaper

    r = Reaper()
    try:
        for _ in range(20):
            p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
            deadline = time.monotonic() + 30
            while not proctree.zombie_children(os.getpid()) & {p.pid}:
                assert time.monotonic() < deadline, "the child never exited"
                time.sleep(0.01)
            time.sleep(0.1)  # several reaper passes see the zombie
            assert p.wait(30) == 7
    finally:
        r.stop()


def test_reaper_takes_an_orphan_after_the_grace() -> None:
    """A zombie nobody waits for (a restored tree's orphan) is reaped and its status kept."""
    from rekindle_agent.process_tree.reaper import Reaper

    r = Reaper(orphan_grace_s=0.2)
    try:
        p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
        assert r.wait(p.pid, 30) == 4
        assert p.pid not in proctree.zombie_children(os.getpid())
        p.returncode = 4  # Popen must not wait for what the reaper took
    finally:
        r.stop()
