"""Fixtures for the CRIU tests: the CRIU builds and the memmix test program."""

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import criu_helpers
from .criu_helpers import Flavor, Probe, flavors

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU dump/restore needs root")


@pytest.fixture(scope="session")
def criu_prefix() -> Path:
    """Directory with stock/criu and patched/criu, from scripts/build-criu (cached).

    REKINDLE_CRIU_PREFIX=DIR uses DIR instead (DIR/{stock,patched}/criu): for work on
    the patches, with a patched CRIU built by hand.
    """
    _need_root()
    override = os.environ.get("REKINDLE_CRIU_PREFIX")
    if override:
        return Path(override).resolve()
    res = subprocess.run(
        [str(REPO / "scripts" / "build-criu")],
        stdout=subprocess.PIPE,
        text=True,
        timeout=1800,
        check=False,
    )
    assert res.returncode == 0, "scripts/build-criu failed (its progress is on stderr)"
    prefix = Path(res.stdout.strip().splitlines()[-1])
    assert prefix.is_absolute(), prefix
    for flavor in ("stock", "patched"):
        assert os.access(prefix / flavor / "criu", os.X_OK), prefix / flavor / "criu"
    assert (prefix / "patched" / "plugins" / "cuda_plugin.so").is_file()
    return prefix


def _compile(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    _need_root()
    gcc = shutil.which("gcc")
    if not gcc:
        pytest.skip("gcc not found")
    out = tmp_path_factory.mktemp(name) / name
    subprocess.run(
        [gcc, "-O2", "-Wall", "-Werror", "-pthread", "-o", str(out), str(HERE / f"{name}.c")],
        check=True,
        timeout=120,
    )
    return out


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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """CRIU's own test suite, stock vs --mmap-restore (tests/criu/test_zdtm.py)."""
    for s in criu_helpers.ZDTM_SUMMARY:
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
        for t, res in s["fail_both"].items():
            w(f"fails with stock: {t}: {'; '.join(str(x) for x in res)}")
