"""Child processes when the agent is PID 1 (or a subreaper).

A restored vLLM tree is not the agent's own Popen child: after `criu restore -d`
its root is re-parented to the agent, and so is every orphan of the tree. One
thread reaps every child and keeps the exit statuses; the agent starts
processes and waits for them only through this class, never Popen.wait (which
would race the reaper for the same status).

The reaper never calls waitpid(-1): that would also take the status of a child
some library started with subprocess (vmtouch, a version probe), whose Popen
then reads "exit 0" for a command that failed. It reaps its own children by
pid at once, and an orphan (a child it did not start) only after the orphan
has been a zombie for ORPHAN_GRACE_S, by which time any Popen waiting for its
own child has taken it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rekindle_agent.process_tree import proctree

PR_SET_CHILD_SUBREAPER = 36
ORPHAN_GRACE_S = 5.0  # a zombie nobody claimed for this long is an orphan: reap it
ORPHAN_SCAN_S = 0.25  # how often /proc is scanned for orphans


def become_subreaper() -> None:
    """Orphans of vLLM's tree (and a restored root) are re-parented to this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@dataclass
class Result:
    returncode: int
    output: str


class Reaper:
    def __init__(self, orphan_grace_s: float = ORPHAN_GRACE_S) -> None:
        self.orphan_grace_s = orphan_grace_s
        self._cond = threading.Condition()
        self._status: dict[int, int] = {}
        self._running: set[int] = set()  # run()'s children (criu), for kill_running()
        self._owned: set[int] = set()  # spawned or adopted, not yet reaped
        self._zombie_since: dict[int, float] = {}  # orphans seen exited, not yet reaped
        self._exempt: set[int] = set()  # children a Popen owns and polls itself
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="reaper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # Polling (not a blocking waitpid) so that stop() takes effect at once and
        # no child exiting after it is reaped behind its owner's back.
        next_scan = 0.0
        while not self._stop:
            reaped = self._reap_owned()
            if time.monotonic() >= next_scan:
                reaped |= self._reap_orphans()
                next_scan = time.monotonic() + ORPHAN_SCAN_S
            if not reaped:
                time.sleep(0.02)

    def _record(self, pid: int, status: int) -> None:
        with self._cond:
            self._status[pid] = os.waitstatus_to_exitcode(status)
            self._owned.discard(pid)
            self._cond.notify_all()

    def _reap_owned(self) -> bool:
        with self._cond:
            pids = list(self._owned)
        reaped = False
        for pid in pids:
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not (or no longer) our child: nothing to report
                with self._cond:
                    self._owned.discard(pid)
                continue
            if got == pid:
                self._record(pid, status)
                reaped = True
        return reaped

    def _reap_orphans(self) -> bool:
        now = time.monotonic()
        zombies = proctree.zombie_children(os.getpid())
        with self._cond:
            zombies -= self._owned
            zombies -= self._exempt
        self._zombie_since = {p: self._zombie_since.get(p, now) for p in zombies}
        reaped = False
        for pid, since in list(self._zombie_since.items()):
            if now - since < self.orphan_grace_s:
                continue
            with contextlib.suppress(ChildProcessError):
                got, status = os.waitpid(pid, os.WNOHANG)
                if got == pid:
                    self._record(pid, status)
                    reaped = True
            del self._zombie_since[pid]
        return reaped

    def exempt(self, pid: int) -> None:
        """pid is a Popen's own child (it polls it, maybe rarely): never reap it here."""
        with self._cond:
            self._exempt.add(pid)

    def adopt(self, pid: int) -> None:
        """pid (a tree CRIU restored, re-parented to this process) is reaped at once
        when it exits, and its status kept for wait()."""
        with self._cond:
            self._status.pop(pid, None)
            self._owned.add(pid)

    def stop(self) -> None:
        self._stop = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
    ) -> int:
        """Start argv in its own session (killed as a group) and return its pid."""
        with self._cond:
            p = subprocess.Popen(
                list(argv),
                env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
            self._status.pop(p.pid, None)
            self._owned.add(p.pid)
            # Popen must never wait for it: the reaper owns the status.
            p.returncode = 0
            return p.pid

    def wait(self, pid: int, timeout: float | None = None) -> int:
        """Exit code (negative: killed by that signal); TimeoutError after timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pid not in self._status:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"pid {pid} still running after {timeout}s")
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return self._status[pid]

    def kill_running(self) -> list[int]:
        """SIGKILL the process group of every run() still going (the watchdog's last resort)."""
        with self._cond:
            pids = sorted(self._running)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, 9)
        return pids

    def forget(self, pid: int) -> None:
        with self._cond:
            self._status.pop(pid, None)

    def run(self, argv: Sequence[str], *, timeout: float | None = None) -> Result:
        """Run to completion; its stdout+stderr (through a temporary file) are returned."""
        path = f"/tmp/.rekindle-run-{os.getpid()}-{threading.get_ident()}.log"
        with open(path, "wb") as out:
            pid = self.spawn(argv, stdout=out.fileno(), stderr=subprocess.STDOUT)
        with self._cond:
            self._running.add(pid)
        try:
            code = self.wait(pid, timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, 9)
            self.wait(pid, 10)
            raise
        finally:
            with self._cond:
                self._running.discard(pid)
            self.forget(pid)
        with open(path, errors="replace") as f:
            text = f.read()
        os.unlink(path)
        return Result(code, text)
