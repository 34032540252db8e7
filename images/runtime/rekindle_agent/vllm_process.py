"""vLLM's process tree as the agent owns it: how to start it, its root PID, killing it.

The root is either the agent's own child (a boot) or a process CRIU restored
and re-parented to the agent (adopt). Either way one object knows the root,
so the flows (boot, checkpoint, restore) never disagree about which tree is
the live one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from rekindle_agent import proctree, seccomp, shm_files
from rekindle_agent.reaper import Reaper


class VllmProcess:
    """argv and env of vLLM, where it logs, and the root PID of its live tree (or None)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        log_path: str,
        reaper: Reaper,
        seccomp_io_uring: bool = True,
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.reaper = reaper
        self.seccomp_io_uring = seccomp_io_uring
        self.root_pid: int | None = None

    def spawn(self) -> int:
        """Start vLLM in its own session, output appended to the log; returns the root PID."""
        argv = seccomp.wrap(self.argv) if self.seccomp_io_uring else list(self.argv)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            pid = self.reaper.spawn(argv, env=self.env, stdout=fd, stderr=fd)
        finally:
            os.close(fd)
        self.root_pid = pid
        return pid

    def adopt(self, pid: int) -> None:
        """A tree CRIU restored (its root is now the agent's child) becomes the live one."""
        self.root_pid = pid

    def alive(self) -> bool:
        return self.root_pid is not None and proctree.alive(self.root_pid)

    def dumped(self, pids: list[int]) -> None:
        """CRIU killed the tree after a successful dump: wait until it is fully gone."""
        with contextlib.suppress(TimeoutError):
            proctree.kill_tree(pids, timeout=10)
        self.root_pid = None

    def kill(self, remove_shm: bool = False) -> None:
        """Kill the whole tree (SIGKILL); optionally delete the /dev/shm files it used."""
        if self.root_pid is None:
            return
        pids = proctree.tree(self.root_pid)
        names = shm_files.tree_shm_files(pids) if remove_shm else set()
        with contextlib.suppress(TimeoutError):
            proctree.kill_tree(pids)
        if remove_shm:
            shm_files.remove(sorted(names))
        self.root_pid = None
