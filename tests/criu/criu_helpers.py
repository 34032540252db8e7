"""Helpers shared by the CRIU tests: running CRIU, test processes, /proc views."""

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CRIU_TIMEOUT = 120
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>

# Where test_zdtm.py leaves what it found, for the summary at the end of the run
# (conftest.py's pytest_terminal_summary): in the run's config, not in this module.
ZDTM_SUMMARY = pytest.StashKey[list[dict[str, Any]]]()


@dataclass
class Flavor:
    """A CRIU binary and the options its restores get."""

    name: str
    criu: Path
    restore_args: tuple[str, ...]

    @property
    def mmap(self) -> bool:
        return "--mmap-restore" in self.restore_args


def flavors(prefix: Path) -> dict[str, Flavor]:
    return {
        "stock": Flavor("stock", prefix / "stock" / "criu", ()),
        "patched": Flavor("patched", prefix / "patched" / "criu", ("--mmap-restore",)),
    }


def cmdline_has(pid: int, name: bytes) -> bool:
    try:
        return name in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def set_child_subreaper(on: bool) -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): orphans of this process's descendants come to it,
    not to PID 1 (see conftest.own_restored_processes for why)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER, {int(on)}): {os.strerror(err)}")


def reap_orphans() -> None:
    """Reap every child of this process that has exited (adopted orphans included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Wait until pid is free for a restore again: no /proc/PID at all.

    Neither a zombie nor a process still exiting (its cmdline already empty) is gone:
    CRIU cannot give the PID to a restored task until it is reaped ("Can't fork for
    PID: File exists"). This process's own zombies (what it restored, adopted as the
    child subreaper) are reaped here at once; another parent's are waited for.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return
        state, ppid = fields[0], int(fields[1])
        if state in ("Z", "X") and ppid == os.getpid():
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    continue
        assert time.monotonic() < deadline, (
            f"pid {pid} (state {state}, parent {ppid}) is still there after {timeout}s"
        )
        time.sleep(0.01)


def criu(
    flavor: Flavor,
    *args: str,
    timeout: float = CRIU_TIMEOUT,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(flavor.criu), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def criu_dump(flavor: Flavor, pid: int, images: Path, *extra: str) -> subprocess.CompletedProcess:
    """`criu dump` (or `pre-dump` with extra=("--pre",...)) into images; returns the result."""
    images.mkdir(parents=True, exist_ok=True)
    cmd = "dump"
    if extra and extra[0] == "pre-dump":
        cmd, extra = "pre-dump", extra[1:]
    return criu(flavor, cmd, "-t", str(pid), "-D", str(images), "-v4", "-o", f"{cmd}.log", *extra)


def criu_restore(flavor: Flavor, images: Path, *extra: str) -> subprocess.CompletedProcess:
    return criu(
        flavor,
        "restore",
        "-D",
        str(images),
        "-d",
        "--pidfile",
        str(images / "restore.pid"),
        "-v4",
        "-o",
        "restore.log",
        *flavor.restore_args,
        *extra,
    )


def log_tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text()[-n:]
    except OSError as e:
        return f"({path}: {e})"


@dataclass
class Vma:
    start: int
    end: int
    path: str
    flags: list[str]
    fields: dict[str, int]


def smaps(pid: int) -> list[Vma]:
    """Every VMA of pid, with its path, VmFlags and the kB fields of smaps."""
    vmas: list[Vma] = []
    cur: Vma | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
        if m:
            cur = Vma(int(m[1], 16), int(m[2], 16), m[3], [], {})
            vmas.append(cur)
        elif cur and line.startswith("VmFlags:"):
            cur.flags = line.split(":", 1)[1].split()
        elif cur:
            f = re.match(r"^(\w+):\s+(\d+) kB$", line)
            if f:
                cur.fields[f[1]] = int(f[2])
    return vmas


def vmas_in(pid: int, start: int, end: int) -> list[Vma]:
    return [v for v in smaps(pid) if v.start < end and v.end > start]


@contextmanager
def sysctl(path: str, value: str) -> Iterator[str]:
    """Set a /proc/sys or /sys knob for the block, and put the old value back."""
    p = Path(path)
    old = p.read_text().strip()
    if "[" in old:  # /sys/kernel/mm/transparent_hugepage/enabled: "always [madvise] never"
        old = old.split("[", 1)[1].split("]", 1)[0]
    p.write_text(value)
    try:
        yield old
    finally:
        p.write_text(old)


@dataclass
class Probe:
    """One memprobe process tree (tests/criu/memprobe.c) through its dumps and restores."""

    binary: Path
    run: Path
    children: int = 0
    popen: subprocess.Popen[bytes] | None = None
    pids: set[int] = field(default_factory=set)
    seqs: dict[str, int] = field(default_factory=dict)

    NAME = b"memprobe"

    def dirs(self) -> list[Path]:
        return [self.run] + [self.run / f"c{i}" for i in range(self.children)]

    def start(self) -> None:
        self.run.mkdir(parents=True, exist_ok=True)
        with open(self.run / "out.log", "wb") as log:
            self.popen = subprocess.Popen(
                [str(self.binary), str(self.run), str(self.children)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        for d in self.dirs():
            while not (d / "ready").exists():
                assert self.popen.poll() is None, (self.run / "out.log").read_text()
                assert time.monotonic() < deadline, f"memprobe did not get ready in {d}"
                time.sleep(0.02)
            self.pids.add(self.pid(d))

    @property
    def root(self) -> int:
        return self.pid(self.run)

    def pid(self, d: Path | None = None) -> int:
        return int(((d or self.run) / "pid").read_text())

    def regions(self, d: Path | None = None) -> dict[str, tuple[int, int]]:
        out = {}
        for line in ((d or self.run) / "regions").read_text().splitlines():
            name, start, end = line.split()
            out[name] = (int(start, 16), int(end, 16))
        return out

    def vmas(self, name: str, d: Path | None = None) -> list[Vma]:
        start, end = self.regions(d)[name]
        return vmas_in(self.pid(d), start, end)

    def cmd(self, text: str, d: Path | None = None, timeout: float = 60) -> str:
        """Run one command in the process serving d (default: the root); returns the result."""
        d = d or self.run
        res = d / "result"
        before = res.read_text().split()[0] if res.exists() else "0"
        (d / ".cmd.tmp").write_text(text)
        (d / ".cmd.tmp").rename(d / "cmd")
        pid = self.pid(d)
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while not res.exists() or res.read_text().split()[0] == before:
            assert cmdline_has(pid, self.NAME), f"memprobe {pid} died running {text!r}"
            assert time.monotonic() < deadline, f"memprobe {pid} did not answer {text!r}"
            time.sleep(0.01)
        return res.read_text().strip().split(" ", 1)[1]

    def ok(self, text: str, d: Path | None = None) -> str:
        """Run a command that must succeed; returns what it says after OK."""
        out = self.cmd(text, d)
        assert out.startswith("OK"), (text, out)
        return out[2:].strip()

    def verify_all(self) -> None:
        for d in self.dirs():
            assert self.ok("verify", d) == "all"

    def dump(self, flavor: Flavor, images: Path, *extra: str) -> None:
        res = criu_dump(flavor, self.root, images, *extra)
        assert res.returncode == 0, log_tail(images / "dump.log")
        if "--leave-running" in extra or (extra and extra[0] == "pre-dump"):
            return
        if self.popen is not None and self.popen.pid == self.root:
            self.popen.wait(timeout=30)
        for pid in self.pids:
            wait_gone(pid)

    def restore(self, flavor: Flavor, images: Path, *extra: str) -> None:
        res = criu_restore(flavor, images, *extra)
        assert res.returncode == 0, log_tail(images / "restore.log")
        assert int((images / "restore.pid").read_text()) == self.root
        for d in self.dirs():
            assert cmdline_has(self.pid(d), self.NAME)

    def kill(self) -> None:
        for pid in sorted(self.pids):
            if cmdline_has(pid, self.NAME):
                os.kill(pid, signal.SIGKILL)
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
        if self.popen is not None:
            self.popen.wait(timeout=30)
        for pid in self.pids:
            wait_gone(pid)


def mapped_from(vmas: list[Vma], images: Path) -> tuple[list[Vma], list[Vma]]:
    """Split vmas into those that map a pages image of images/ and the others."""
    paths = {str(p) for p in images.glob("pages-*.img")}
    mapped = [v for v in vmas if v.path in paths]
    return mapped, [v for v in vmas if v.path not in paths]
