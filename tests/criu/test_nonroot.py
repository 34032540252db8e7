"""Dumping a non-root worker in a pod from the host, as the node agent does.

A "pod" is a PID + mount namespace whose PID 1 stays (a reaper); its worker runs
as uid 65534 with rlimits of its own (soft RLIMIT_NOFILE 1000 of 4096, RLIMIT_CORE
0 of 1 MiB) and keeps a counter and a random token in memory only. From the host,
as root, CRIU dumps the worker through `nsenter -t <pod's PID 1> -p -m` with the
agent's own command lines (rekindle_agent.checkpointing.criu) and restores it the same way.

CRIU reads a task's rlimits with prlimit(), which needs CAP_SYS_RESOURCE when the
task has another uid. Where root's capability bounding set lacks it (this VM),
stock CRIU cannot dump the worker at all ("Can't get rlimit 0"); the patched CRIU
(criu-patches/0006) reads /proc/PID/limits instead and says so in its log. Where
the capability is there, prlimit() works and the log must not say it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rekindle_agent.checkpointing.criu import dump_argv, restore_argv
from rekindle_dev.testenv import require

from .criu_helpers import CRIU_TIMEOUT, Flavor, flavors, log_tail, wait_gone

pytestmark = pytest.mark.criu

PYTHON = "/usr/bin/python3"  # readable by uid 65534 (a venv under /root is not)
UID = 65534
CAP_SYS_RESOURCE = 24
FALLBACK_LOG = "reading rlimits from /proc/PID/limits"

# The pod's PID 1: reaps every orphan (a dumped worker must not stay a zombie holding
# its PID for the restore) and otherwise waits.
INIT = """
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    signal.sigwait({signal.SIGCHLD})
"""
# The worker: its rlimits, then one line "N TOKEN" at start and after each SIGUSR1 (N
# counts them). The token and the counter are only in its memory.
WORKER = """
import os, resource, signal
resource.setrlimit(resource.RLIMIT_NOFILE, (1000, 4096))
resource.setrlimit(resource.RLIMIT_CORE, (0, 1 << 20))
token = os.urandom(8).hex()
n = 0
def answer(*_):
    global n
    n += 1
    os.write(1, f"{n} {token}\\n".encode())
signal.signal(signal.SIGUSR1, answer)
os.write(1, f"0 {token}\\n".encode())
while True:
    signal.pause()
"""
# Started inside the pod (nsenter -p -m): stdio opened there (CRIU cannot dump a
# descriptor opened in another mount namespace), a session of its own (as the agent's
# vLLM), uid 65534, and orphaned at once so that the pod's PID 1 adopts it.
# $1: its log; the rest: its argv.
SPAWN = """
log=$1
shift
cd / || exit 1
setsid setpriv --reuid 65534 --regid 65534 --clear-groups "$@" </dev/null >>"$log" 2>&1 &
"""
MARKER = "rekindle-nonroot-worker"
UNSHARE = ("unshare", "--pid", "--fork", "--mount", "--mount-proc", "--")


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in lines)}


def _ns_pid(pid: int) -> int:
    """pid as its own (innermost) PID namespace numbers it."""
    return int(_status(pid)["NSpid"].split()[-1])


def _has_cap_sys_resource() -> bool:
    """Whether root's processes (CRIU) can have CAP_SYS_RESOURCE: the bounding set."""
    return bool(int(_status(os.getpid())["CapBnd"], 16) >> CAP_SYS_RESOURCE & 1)


@dataclass
class Worker:
    host_pid: int
    ns_pid: int
    log: Path
    token: str

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def ask(self, pid: int, n: int, timeout: float = 30) -> None:
        """SIGUSR1 to pid (host view), then wait for line n; it must be 'n token'."""
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while len(self.lines()) <= n:
            assert time.monotonic() < deadline, f"worker {pid} did not answer: {self.lines()}"
            time.sleep(0.01)
        assert self.lines() == [f"{i} {self.token}" for i in range(n + 1)]


class Pod:
    """A PID + mount namespace whose PID 1 (a reaper) stays until kill()."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.proc = subprocess.Popen(
            [*UNSHARE, PYTHON, "-I", "-S", "-c", INIT],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not (kids := _children(self.proc.pid)) or _ns_pid(kids[0]) != 1:
            assert self.proc.poll() is None, f"unshare exited {self.proc.returncode}"
            assert time.monotonic() < deadline, "the pod's PID 1 did not start"
            time.sleep(0.01)
        self.init = kids[0]

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        """argv inside the pod's PID and mount namespaces (from the host, as the agent)."""
        return subprocess.run(
            ["nsenter", "-t", str(self.init), "-p", "-m", "--", *argv],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CRIU_TIMEOUT,
            check=False,
        )

    def child(self, ns_pid: int, timeout: float = 30) -> int:
        """The host pid of the pod's PID 1's child numbered ns_pid in the pod."""
        deadline = time.monotonic() + timeout
        while True:
            for pid in _children(self.init):
                try:
                    if _ns_pid(pid) == ns_pid:
                        return pid
                except (OSError, KeyError):
                    pass
            assert time.monotonic() < deadline, f"no child {ns_pid} of the pod's PID 1"
            time.sleep(0.01)

    def start_worker(self) -> Worker:
        log = self.work / "worker.log"
        res = self.run("sh", "-c", SPAWN, "sh", str(log), PYTHON, "-I", "-S", "-c", WORKER, MARKER)
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 30
        while True:
            found = [p for p in _children(self.init) if MARKER.encode() in _cmdline(p)]
            if found and log.exists() and log.read_text().endswith("\n"):
                break
            assert time.monotonic() < deadline, f"no worker ready: {found} {_read(log)!r}"
            time.sleep(0.01)
        assert len(found) == 1, found
        n, token = log.read_text().split()
        assert n == "0"
        return Worker(found[0], _ns_pid(found[0]), log, token)

    def kill(self) -> None:
        """SIGKILL to PID 1 ends the whole pod (the kernel kills the rest)."""
        pids = [self.init, *_children(self.init)]
        if self.proc.poll() is None:
            os.kill(self.init, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for pid in pids:
            wait_gone(pid)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _errors(log: Path) -> str:
    """CRIU's error lines in log (its tail is mostly cleanup after a failure)."""
    return "\n".join(ln for ln in _read(log).splitlines() if "Error (" in ln)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        return str(e)


@pytest.fixture
def pod(criu_prefix: Path, tmp_path: Path) -> Iterator[Pod]:
    require("root", "unshare")  # also nsenter and setpriv (util-linux)
    assert os.access(PYTHON, os.X_OK), f"no {PYTHON}: apt-get install python3"
    p = Pod(tmp_path)
    try:
        yield p
    finally:
        p.kill()


def _dump(pod: Pod, flavor: Flavor, worker: Worker) -> tuple[subprocess.CompletedProcess, Path]:
    images, log = pod.work / "images", pod.work / "dump.log"
    images.mkdir()
    return pod.run(*dump_argv(str(flavor.criu), worker.ns_pid, str(images), str(log))), log


def test_patched_criu_dumps_and_restores_a_non_root_worker_in_a_pod(
    criu_prefix: Path, pod: Pod
) -> None:
    patched = flavors(criu_prefix)["patched"]
    worker = pod.start_worker()
    worker.ask(worker.host_pid, 1)
    worker.ask(worker.host_pid, 2)
    before = _status(worker.host_pid)
    assert before["Uid"].split() == [str(UID)] * 4, before["Uid"]
    assert int(before["PPid"]) == pod.init
    limits = Path(f"/proc/{worker.host_pid}/limits").read_text()
    # The worker's own rlimits, unlike CRIU's (this process's): a restore that did not
    # set them from the image would show.
    ours = Path("/proc/self/limits").read_text().splitlines()
    nofile = next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
    assert nofile.split()[3:5] == ["1000", "4096"], nofile
    assert nofile not in ours

    res, dump_log = _dump(pod, patched, worker)
    assert res.returncode == 0, res.stderr + _errors(dump_log)
    wait_gone(worker.host_pid)  # the dump ends the worker; the pod's PID 1 reaps it
    text = dump_log.read_text()
    if _has_cap_sys_resource():
        assert FALLBACK_LOG not in text  # prlimit() worked: nothing changes
    else:
        assert text.count(FALLBACK_LOG) == 1, _errors(dump_log)
        p = worker.ns_pid
        assert f"Reading rlimits of {p} from /proc/{p}/limits" in text

    pidfile, restore_log = pod.work / "restore.pid", pod.work / "restore.log"
    images = pod.work / "images"
    res = pod.run(*restore_argv(str(patched.criu), str(images), str(restore_log), str(pidfile)))
    assert res.returncode == 0, res.stderr + _errors(restore_log)
    assert int(pidfile.read_text()) == worker.ns_pid
    restored = pod.child(worker.ns_pid)
    after = _status(restored)
    assert after["Uid"].split() == [str(UID)] * 4, after["Uid"]
    assert after["Gid"].split() == [str(UID)] * 4, after["Gid"]
    assert int(after["PPid"]) == pod.init  # re-parented to the pod's PID 1
    assert Path(f"/proc/{restored}/limits").read_text() == limits
    worker.ask(restored, 3)  # same token, the counter went on: its memory came back


def test_stock_criu_cannot_dump_a_non_root_worker_without_cap_sys_resource(
    criu_prefix: Path, pod: Pod
) -> None:
    """Why patch 0006 exists; only where root's bounding set lacks CAP_SYS_RESOURCE."""
    if _has_cap_sys_resource():
        pytest.skip("CAP_SYS_RESOURCE is in the bounding set: stock CRIU's prlimit() works here")
    stock = flavors(criu_prefix)["stock"]
    worker = pod.start_worker()
    res, dump_log = _dump(pod, stock, worker)
    assert res.returncode != 0, log_tail(dump_log)
    assert "Can't get rlimit 0: Operation not permitted" in _errors(dump_log)
    worker.ask(worker.host_pid, 1)  # the failed dump left the worker running
