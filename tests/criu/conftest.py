"""Fixtures for the CRIU tests: the test programs, the two CRIU flavors, and owning
what the tests restore (criu_prefix, the CRIU builds, is tests/conftest.py's)."""

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from rekindle_dev.testenv import require

from . import criu_helpers
from .criu_helpers import Flavor, Probe, flavors

HERE = Path(__file__).resolve().parent


def _compile(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    require("gcc")
    gcc = shutil.which("gcc")
    assert gcc is not None
    out = tmp_path_factory.mktemp(name) / name
    subprocess.run(
        [gcc, "-O2", "-Wall", "-Werror", "-pthread", "-o", str(out), str(HERE / f"{name}.c")],
        check=True,
        timeout=120,
    )
    return out


@pytest.fixture(autouse=True)
def own_restored_processes() -> Iterator[None]:
    """Make this process the child subreaper for the test, so that it owns what it restores.

    `criu restore -d` leaves the restored tree orphaned; without a subreaper PID 1
    adopts it, and PID 1 of some machines reaps a killed orphan seconds late. Until
    then the PID is a zombie, and restoring the same image again fails with CRIU's
    "Can't fork for PID: File exists". As the subreaper, this process adopts every
    orphan of the test and criu_helpers.wait_gone() reaps it at once; whatever is
    left is reaped when the test ends, so that no zombie holds a PID for the next.
    """
    criu_helpers.set_child_subreaper(True)
    try:
        yield
    finally:
        criu_helpers.set_child_subreaper(False)
        criu_helpers.reap_orphans()


@pytest.fixture(scope="session")
def memmix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The memmix test program (a mix of memory), compiled with gcc."""
    return _compile(tmp_path_factory, "memmix")


@pytest.fixture(scope="session")
def memprobe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The memprobe test program (semantics probes, process trees), compiled with gcc."""
    return _compile(tmp_path_factory, "memprobe")


@pytest.fixture(scope="session")
def heapprobe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The heapprobe test program (glibc heap probes, test_mmap_heap.py), compiled with gcc."""
    return _compile(tmp_path_factory, "heapprobe")


@pytest.fixture
def probe(memprobe: Path, tmp_path: Path) -> Iterator[Probe]:
    """A memprobe tree (memprobe.c) for one test, killed afterwards."""
    p = Probe(memprobe, tmp_path / "run")
    try:
        yield p
    finally:
        p.kill()


@pytest.fixture(params=["stock", "patched"])
def flavor(request: pytest.FixtureRequest, criu_prefix: Path) -> Flavor:
    """Stock CRIU, and the patched CRIU restoring with --mmap-restore."""
    return flavors(criu_prefix)[request.param]


@pytest.fixture
def patched(criu_prefix: Path) -> Flavor:
    return flavors(criu_prefix)["patched"]


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """CRIU's own test suite, stock vs --mmap-restore (tests/criu/test_zdtm.py)."""
    for s in config.stash.get(criu_helpers.ZDTM_SUMMARY, []):
        w = terminalreporter.write_line
        terminalreporter.section(f"zdtm ({s['set']}): stock vs patched CRIU with --mmap-restore")
        runs = [("stock", s["stock"], None)]
        runs += [(f"patched, {m}", r["counts"], r) for m, r in s["runs"].items()]
        for name, n, r in runs:
            mapped = f", {r['mapped_by_patch']} restores mapped memory" if r else ""
            w(f"{name:22} {n['PASS']:4} passed {n['FAIL']:4} failed {n['SKIP']:4} skipped{mapped}")
        for m, r in s["runs"].items():
            for t, why in r["known_differences"].items():
                w(f"{m}: pass with stock, fail with the patch (documented difference): {t}: {why}")
            w(f"{m}: pass with stock, fail with the patch otherwise: {r['regressions'] or 'none'}")
            if r["only_patched_passes"]:
                w(f"{m}: pass with the patch only: {r['only_patched_passes']}")
        for run, fails in s["env_failures"].items():
            for t, why in fails.items():
                w(f"{run}: fails for a cause of this machine: {t}: {why}")
        for t, res in s["fail_both"].items():
            w(f"fails with stock: {t}: {'; '.join(str(x) for x in res)}")
